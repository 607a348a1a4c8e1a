//! `trainlet stacks`: every worker's stacks, as this container's agents
//! read them now (e.g. through `kubectl exec` into a pod that seems
//! stuck). The agents read their workers from outside (they are the
//! workers' ancestors, which Yama's `ptrace_scope` 1 asks for; this
//! command is not), so this command asks each one on its stacks door and
//! prints what they send: the Python frames of every thread, innermost
//! first, and a blocked thread's native frames.

use std::io::{Read, Write};
use std::time::Duration;

use crate::stacks::stall::RankStacks;
use crate::supervise::stacks::{MAX_ANSWER, door_name};

/// Longest one agent may take to answer.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Ask every agent of this container; 0 when at least one answered.
pub fn main(json: bool) -> u8 {
    let me = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
    let found: Vec<_> = super::stop::agents(me).into_iter().filter(|a| a.mode == "run").collect();
    if found.is_empty() {
        eprintln!("trainlet stacks: no trainlet agent (run, torchrun) runs in this container");
        return 1;
    }
    let mut all = Vec::new();
    let mut answered = false;
    for a in &found {
        match ask(a.pid) {
            Ok(stacks) => {
                answered = true;
                all.extend(stacks);
            }
            Err(e) => eprintln!("trainlet stacks: agent pid {}: {e}", a.pid),
        }
    }
    all.sort_by_key(|r| r.rank);
    if json {
        println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
    } else {
        print!("{}", text(&all));
    }
    if answered { 0 } else { 1 }
}

/// What the agent `pid` sends: only from the agent itself (a process of
/// the pod that took the door's name first is not believed).
fn ask(pid: i32) -> Result<Vec<RankStacks>, String> {
    use std::os::fd::AsFd;
    use std::os::linux::net::SocketAddrExt;
    let name = door_name(u32::try_from(pid).map_err(|_| "bad pid".to_string())?);
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    let mut conn = std::os::unix::net::UnixStream::connect_addr(&addr)
        .map_err(|e| format!("cannot reach its stacks door ({e}); is it a trainlet of this version?"))?;
    let me = nix::unistd::geteuid().as_raw();
    match crate::sys::peer_credentials(conn.as_fd()) {
        Some((p, uid)) if p == pid && (uid == me || uid == 0) => {}
        Some((p, uid)) => {
            return Err(format!("its stacks door is held by another process (pid {p}, uid {uid}); not believed"));
        }
        None => return Err("cannot tell who holds its stacks door; not believed".into()),
    }
    conn.set_read_timeout(Some(ANSWER_WAIT)).map_err(|e| e.to_string())?;
    conn.write_all(b"stacks\n").map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    let limit = u64::try_from(MAX_ANSWER + 1).unwrap_or(u64::MAX);
    if let Err(e) = conn.take(limit).read_to_end(&mut answer) {
        return Err(match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                format!("no answer within {ANSWER_WAIT:?}")
            }
            _ => format!("no answer: {e}"),
        });
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&answer)
        && let Some(e) = v.get("error").and_then(|e| e.as_str())
    {
        return Err(crate::stacks::clean(e));
    }
    serde_json::from_slice(&answer).map_err(|e| format!("an unreadable answer: {e}"))
}

/// The stacks as text: one block per rank, one per thread.
pub fn text(all: &[RankStacks]) -> String {
    use crate::stacks::clean as c;
    use std::fmt::Write as _;
    let mut s = String::new();
    if all.is_empty() {
        s.push_str("no worker is running\n");
    }
    for r in all {
        let p = &r.stacks;
        let py = p.python.as_deref().map(|v| format!(", Python {}", c(v))).unwrap_or_default();
        let (host, took) = (c(&r.host), p.took_ms);
        let _ = writeln!(
            s,
            "rank {} (local rank {}, {host}, pid {}{py}, read in {took:.1} ms)",
            r.rank, r.local_rank, p.pid
        );
        if let Some(note) = &p.note {
            let _ = writeln!(s, "  {}", c(note));
        }
        for t in &p.threads {
            let main = if t.main { ", main" } else { "" };
            let _ = writeln!(s, "  thread {} ({}{main}): {}", t.tid, c(&t.name), c(&t.kernel));
            for f in &t.python {
                let line = f.line.map(|l| format!(":{l}")).unwrap_or_default();
                let _ = writeln!(s, "    {} ({}{line})", c(&f.function), c(&f.file));
            }
            for n in &t.native {
                let _ = writeln!(s, "    [native] {} ({})", c(n.function.as_deref().unwrap_or(&n.pc)), c(&n.object));
            }
        }
    }
    s
}
