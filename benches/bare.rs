//! The launcher-overhead floor (`compare.rs`'s `bare_job`): `bare N PROG`
//! starts PROG N times with the standard library's `Command`, waits for all
//! of them and exits 0 when all did: fork/exec/wait with no agent. Built by
//! the benchmark with `rustc -O` on its own, so the floor is the same
//! whichever profile built the benchmark (the gate's is the test profile's).

use std::process::{Child, Command, ExitCode, Stdio};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let [_, n, prog] = args.as_slice() else {
        eprintln!("usage: bare N PROG");
        return ExitCode::from(2);
    };
    let Ok(n) = n.parse::<u32>() else {
        eprintln!("bare: N must be a count, not {n:?}");
        return ExitCode::from(2);
    };
    let mut children: Vec<Child> = Vec::new();
    for _ in 0..n {
        match Command::new(prog).stdin(Stdio::null()).spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                eprintln!("bare: cannot start {prog}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let ok = children.into_iter().all(|mut c| c.wait().is_ok_and(|s| s.success()));
    if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
