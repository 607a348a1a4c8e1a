//! `trainlet ssh` (and `ssh` through a link): the ssh(1)-compatible client
//! MPI launchers run as their remote shell. Signals keep their default
//! action (a killed client drops the connection, and the server then kills
//! the remote command); logs are quiet unless -v, so mpirun's output stays
//! clean. Its codes are ssh(1)'s: the remote command's, 255 for a failure.

use crate::env as names;
use crate::ssh::{argv, client};

/// Run one remote command; `args` is ssh(1)'s argv without `argv[0]`.
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
    let (default_port, retry) = match settings(env) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("trainlet ssh: error: {e}");
            return crate::exit::CONFIG;
        }
    };
    let check = env(names::TRAINLET_SSH_HOST_KEY_CHECKING).map(|v| argv::HostKeyCheck::from_setting(&v));
    let client_env = client::ClientEnv {
        key_dir: crate::ssh::keys::key_dir(
            env(names::TRAINLET_SSH_DIR).as_deref().map(std::path::Path::new),
            env("HOME").as_deref(),
        ),
        default_port,
        retry,
        check,
        local_user: crate::ssh::local::local_account().0,
    };
    let rt = match crate::process::event_loop() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("trainlet ssh: {}", crate::error::error_chain(&e));
            return client::FAILED;
        }
    };
    let code = rt.block_on(client::run(parsed, client_env));
    // stdin may be a pipe that never closes: do not wait for its reader.
    rt.shutdown_background();
    code
}

/// The default port (TRAINLET_SSH_PORT, 2222) and how long to retry
/// connecting (TRAINLET_SSH_RETRY, 60 s); a bad value is an error naming
/// the variable, as everywhere else, never a silent default.
fn settings(env: impl Fn(&str) -> Option<String>) -> Result<(u16, std::time::Duration), crate::config::Error> {
    let port = match env(names::TRAINLET_SSH_PORT) {
        None => 2222,
        Some(v) => crate::config::parse_port(names::TRAINLET_SSH_PORT, &v)?,
    };
    let retry = match env(names::TRAINLET_SSH_RETRY) {
        None => std::time::Duration::from_secs(60),
        Some(v) => crate::cli::seconds(&v).map_err(|_| crate::config::Error::Invalid {
            origin: names::TRAINLET_SSH_RETRY.to_string(),
            value: v.clone(),
            expected: "seconds, e.g. 60".to_string(),
        })?,
    };
    Ok((port, retry))
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case(&[], Ok((2222, 60.0)); "defaults")]
    #[test_case(&[("TRAINLET_SSH_PORT", "2200"), ("TRAINLET_SSH_RETRY", "5")], Ok((2200, 5.0)); "given")]
    #[test_case(&[("TRAINLET_SSH_PORT", "22x")], Err("TRAINLET_SSH_PORT"); "bad port")]
    #[test_case(&[("TRAINLET_SSH_PORT", "0")], Err("TRAINLET_SSH_PORT"); "port zero")]
    #[test_case(&[("TRAINLET_SSH_RETRY", "soon")], Err("TRAINLET_SSH_RETRY"); "bad retry")]
    fn bad_values_are_named_not_replaced(env: &[(&str, &str)], want: Result<(u16, f64), &str>) {
        let got = settings(|k| env.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_string()));
        match (got, want) {
            (Ok((port, retry)), Ok((p, r))) => assert_eq!((port, retry.as_secs_f64()), (p, r)),
            (Err(e), Err(name)) => assert!(e.to_string().contains(name), "{e}"),
            (got, want) => panic!("{got:?} vs {want:?}"),
        }
    }
}
