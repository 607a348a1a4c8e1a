//! `trainlet ssh` (and `ssh` through a link): the ssh(1)-compatible client
//! MPI launchers run as their remote shell. Signals keep their default
//! action (a killed client drops the connection, and the server then kills
//! the remote command); logs are quiet unless -v, so mpirun's output stays
//! clean. Its codes are ssh(1)'s: the remote command's, 255 for a failure.

use crate::env as names;
use crate::ssh::{argv, client};

/// Run one remote command; `args` is ssh(1)'s argv without argv[0].
pub fn main(args: &[String]) -> u8 {
    let _ = crate::sys::unblock_signals();
    let parsed = match argv::parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "trainlet ssh: {e}\nusage: ssh [-46nqTtvx] [-i identity_file] [-l login_name] [-o option] [-p port] [user@]host command ..."
            );
            return client::FAILED;
        }
    };
    super::init_tracing(match parsed.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    });
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let retry = env(names::TRAINLET_SSH_RETRY)
        .and_then(|v| crate::cli::seconds(&v).ok())
        .unwrap_or(std::time::Duration::from_secs(60));
    let check = env(names::TRAINLET_SSH_HOST_KEY_CHECKING).map(|v| argv::HostKeyCheck::from_setting(&v));
    let client_env = client::ClientEnv {
        key_dir: crate::ssh::keys::key_dir(
            env(names::TRAINLET_SSH_DIR).as_deref().map(std::path::Path::new),
            env("HOME").as_deref(),
        ),
        default_port: env(names::TRAINLET_SSH_PORT).and_then(|p| p.parse().ok()).unwrap_or(2222),
        retry,
        check,
        local_user: crate::ssh::local::local_account().0,
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("trainlet ssh: cannot start the async runtime: {e}");
            return client::FAILED;
        }
    };
    let code = rt.block_on(client::run(parsed, client_env));
    // stdin may be a pipe that never closes: do not wait for its reader.
    rt.shutdown_background();
    code
}
