//! `trainlet stacks`: every worker's stacks, as this container's agents
//! read them now (e.g. through `kubectl exec` into a pod that seems
//! stuck). The agents read their workers from outside (they are the
//! workers' ancestors, which Yama's `ptrace_scope` 1 asks for; this
//! command is not), so this command asks each one on its stacks door and
//! prints what they send: the Python frames of every thread, innermost
//! first, and a blocked thread's native frames.

use crate::stacks::stall::RankStacks;
use crate::supervise::hang_read::ask_door;

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
        match ask_door(a.pid) {
            Ok(stacks) => {
                answered = true;
                all.extend(stacks);
            }
            Err(e) => eprintln!("trainlet stacks: agent pid {}: {e}", a.pid),
        }
    }
    if !answered {
        return 1;
    }
    all.sort_by_key(|r| (r.lane, r.rank));
    if json {
        println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
    } else {
        print!("{}", text(&all));
    }
    0
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
        let lane = r.lane.map(|l| format!("run {l}'s ")).unwrap_or_default();
        let _ = writeln!(
            s,
            "{lane}rank {} (local rank {}, {host}, pid {}{py}, read in {took:.1} ms)",
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
