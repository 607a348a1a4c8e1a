//! `trainlet stop`: stop this container's trainlet agents exactly as
//! SIGTERM does, for a Kubernetes `lifecycle.preStop` hook.
//!
//! A TrainJob's `command` replaces the image's ENTRYPOINT, and the Kubeflow
//! SDK always sets one (`bash -c "...; torchrun file.py"`), so a shell, not
//! trainlet, is PID 1 and the kubelet's SIGTERM reaches only the shell,
//! which ignores it (a shell as PID 1 has no default action for SIGTERM):
//! no checkpoint, no report, SIGKILL at the end of the grace period. The
//! kubelet runs the preStop hook first, inside the grace period, whatever
//! PID 1 is; the shipped runtimes run `trainlet stop` there. It finds every
//! agent in the container's PID namespace (processes of this same binary
//! running `run`/`torchrun` or `mpi`/`mpirun`/`mpiexec`: /proc is the
//! registry, no pid file), sends each SIGTERM, and waits until they are
//! gone (bounded by `--timeout`), so the pod stops checkpoint first.

use std::time::{Duration, Instant};

use crate::sys;

/// A trainlet agent found in /proc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agent {
    /// Its pid.
    pub pid: i32,
    /// `run` or `mpi`.
    pub mode: &'static str,
}

/// What an agent's argv says it is: `run` or `mpi` (None: not an agent,
/// e.g. `trainlet sshd`, `trainlet ssh`, the NVML probe or `--help`).
pub fn classify(argv: &[String]) -> Option<&'static str> {
    let name = argv.first().map(|a| a.rsplit('/').next().unwrap_or(a))?;
    if argv.iter().skip(1).any(|a| a == "--help" || a == "-h" || a == "--version" || a == "-V") {
        return None;
    }
    match name {
        "torchrun" => Some("run"),
        "mpirun" | "mpiexec" => Some("mpi"),
        _ => match argv.get(1).map(String::as_str) {
            Some("run") => Some("run"),
            Some("mpi") => Some("mpi"),
            _ => None,
        },
    }
}

/// The agents of this PID namespace (this binary, other than `me`).
pub fn agents(me: i32) -> Vec<Agent> {
    let Some(exe) = sys::own_exe() else {
        return Vec::new();
    };
    let mut found: Vec<Agent> = sys::process_table()
        .into_iter()
        .filter(|p| p.pid != me && p.state != 'Z')
        .filter(|p| std::fs::read_link(format!("/proc/{}/exe", p.pid)).ok().as_ref() == Some(&exe))
        .filter_map(|p| {
            let raw = std::fs::read(format!("/proc/{}/cmdline", p.pid)).ok()?;
            let argv: Vec<String> = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some(Agent { pid: p.pid, mode: classify(&argv)? })
        })
        .collect();
    found.sort_by_key(|a| a.pid);
    found
}

fn gone(pid: i32) -> bool {
    sys::proc_state(pid).is_none_or(|s| s == 'Z')
}

/// SIGTERM every agent and wait up to `timeout` for all to exit. Returns
/// the exit code: 0 when every agent is gone (or none ran), 1 when one is
/// still running at the timeout.
pub fn stop(timeout: Duration) -> u8 {
    let found = agents(std::process::id().try_into().unwrap_or(i32::MAX));
    if found.is_empty() {
        eprintln!(
            "trainlet stop: no trainlet agent (run, torchrun, mpi, mpirun) runs in this container; nothing to stop"
        );
        return 0;
    }
    for a in &found {
        eprintln!("trainlet stop: sending SIGTERM to trainlet {} (pid {}), as the kubelet would", a.mode, a.pid);
        // Not sys::signal_process: that one never signals PID 1, and here
        // PID 1 is exactly who may need it.
        if let Err(e) = nix::sys::signal::kill(nix::unistd::Pid::from_raw(a.pid), nix::sys::signal::Signal::SIGTERM) {
            eprintln!("trainlet stop: cannot signal pid {}: {e}", a.pid);
        }
    }
    let started = Instant::now();
    let mut reported = Instant::now();
    loop {
        let left: Vec<i32> = found.iter().map(|a| a.pid).filter(|p| !gone(*p)).collect();
        if left.is_empty() {
            eprintln!("trainlet stop: every agent exited after {:.1}s", started.elapsed().as_secs_f64());
            return 0;
        }
        if started.elapsed() >= timeout {
            eprintln!("trainlet stop: pids {left:?} still running after {timeout:?} (--timeout); giving up");
            return 1;
        }
        if reported.elapsed() >= Duration::from_secs(10) {
            eprintln!(
                "trainlet stop: waiting for pids {left:?} to stop their workers ({:.0}s)",
                started.elapsed().as_secs_f64()
            );
            reported = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test_case("/usr/local/bin/trainlet run train.py", Some("run"); "run")]
    #[test_case("torchrun --nproc-per-node 2 f.py", Some("run"); "torchrun link")]
    #[test_case("trainlet mpi -- mpirun -np 4 x", Some("mpi"); "mpi")]
    #[test_case("/usr/local/bin/mpirun --hostfile /etc/mpi/hostfile bash -c x", Some("mpi"); "mpirun link")]
    #[test_case("trainlet sshd", None; "sshd is not an agent")]
    #[test_case("trainlet nvml-probe 1", None; "probe")]
    #[test_case("ssh host orted", None; "ssh client")]
    #[test_case("trainlet run --help", None; "help")]
    #[test_case("trainlet stop", None; "stop itself")]
    fn agents_are_told_by_their_argv(line: &str, want: Option<&str>) {
        assert_eq!(classify(&argv(line)), want);
    }
}
