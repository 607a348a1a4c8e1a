//! Workers kept alive from one round to the next (an actor's survivors
//! mode, `crate::serve::spec::Restart::Survivors`).
//!
//! When a round ends on a worker's death or a membership change, the
//! policy core keeps the live workers ([`super::policy::Attempt::kept`]);
//! [`super::attempt`] hands those the actor's bridge saw ready to a
//! [`Carry`], which holds them until the next round of the same run takes
//! them back ([`Carry::take`]), or kills them: the verdict is not a
//! restart or regroup of their run, the pod goes idle, or the agent exits
//! ([`Carry::stop`], SIGTERM then SIGKILL after the grace period). A
//! `Carry` dropped on an error path kills what it holds.
//!
//! A kept worker is named by its pid and its start time
//! ([`crate::sys::is_same_process`]): a pid the kernel reused for another
//! process is never taken for it, signalled, or kept. While held, each is
//! spared by the end-of-round sweep ([`crate::process::sweep::keep`]), with
//! its own children (DataLoader workers). Its exit, if it dies between two
//! rounds, is reaped by the one reaper as any orphan's is; the next round
//! sees it gone and starts the rank afresh.

use std::time::Duration;

use tokio_util::task::TaskTracker;

use crate::process::sweep;
use crate::sys;

/// How often a stop looks whether the kept workers are gone.
const GONE_POLL: Duration = Duration::from_millis(20);

/// One worker kept alive for the next round.
#[derive(Debug)]
pub struct Kept {
    /// Its local rank (the same in every round).
    pub local_rank: u32,
    /// Its global rank in the round it was kept from.
    pub rank: u32,
    /// Its pid, which is also its process group.
    pub pid: i32,
    /// Its start time ([`sys::proc_start`]).
    pub start: u64,
    /// The tasks still reading its stdout and stderr.
    pub drains: TaskTracker,
    /// The last lines of its stderr, which those tasks keep.
    pub tail: crate::supervise::output::Tail,
}

impl Kept {
    fn alive(&self) -> bool {
        sys::is_same_process(self.pid, self.start)
    }

    /// Alive and not exited yet: a zombie (dead, not reaped yet) is not.
    fn live(&self) -> bool {
        self.alive() && sys::proc_stat(self.pid).is_some_and(|s| s.state != 'Z' && s.state != 'X')
    }

    /// SIGKILL what it started (its `setsid()` daemons too) and its
    /// process group.
    pub fn kill(&self) {
        if self.alive() {
            sweep::kill_below(self.pid);
        }
        self.signal(libc::SIGKILL);
    }

    fn signal(&self, sig: i32) {
        if self.alive() {
            sys::signal_group(self.pid, sig);
        }
    }
}

/// The workers of run `seq` kept between two rounds.
#[derive(Debug, Default)]
pub struct Carry {
    seq: u64,
    kept: Vec<Kept>,
}

impl Carry {
    /// Hold `kept`, the workers of run `seq` kept at the end of a round,
    /// sparing them from sweeps; what was held before is killed.
    pub fn hold(&mut self, seq: u64, kept: Vec<Kept>) {
        self.kill("replaced by newer kept workers");
        for k in &kept {
            sweep::keep(k.pid);
        }
        self.seq = seq;
        self.kept = kept;
    }

    /// Is nothing held?
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// The pids held.
    pub fn pids(&self) -> Vec<i32> {
        self.kept.iter().map(|k| k.pid).collect()
    }

    /// The held workers of run `seq` that are still alive, for the round
    /// that starts now (no longer spared by sweeps: they are workers of
    /// that round). Those of another run are killed.
    pub fn take(&mut self, seq: u64) -> Vec<Kept> {
        if self.seq != seq {
            self.kill("their run is over");
            return Vec::new();
        }
        let kept = std::mem::take(&mut self.kept);
        for k in &kept {
            sweep::release(k.pid);
        }
        let (live, gone): (Vec<Kept>, Vec<Kept>) = kept.into_iter().partition(Kept::live);
        for k in gone {
            k.kill();
            tracing::warn!(
                local_rank = k.local_rank,
                pid = k.pid,
                "a kept worker died between two rounds; its rank starts afresh"
            );
        }
        live
    }

    /// SIGKILL every held worker's process group (`why`, logged).
    pub fn kill(&mut self, why: &str) {
        if self.kept.is_empty() {
            return;
        }
        tracing::info!(pids = ?self.pids(), why, "killing the workers kept for the next round");
        for k in std::mem::take(&mut self.kept) {
            k.kill();
            sweep::release(k.pid);
        }
    }

    /// Kill what is held for a run other than `seq`.
    pub fn keep_only(&mut self, seq: u64) {
        if self.seq != seq {
            self.kill("a new run begins");
        }
    }

    /// Stop every held worker as a round's stop does: SIGTERM to its
    /// process group, then SIGKILL once `grace` has passed.
    pub async fn stop(&mut self, grace: Duration) {
        if self.kept.is_empty() {
            return;
        }
        tracing::info!(pids = ?self.pids(), grace_s = grace.as_secs_f64(), "stopping the workers kept for the next round");
        for k in &self.kept {
            k.signal(libc::SIGTERM);
        }
        let until = tokio::time::Instant::now() + grace;
        while self.kept.iter().any(Kept::alive) && tokio::time::Instant::now() < until {
            tokio::time::sleep(GONE_POLL).await;
        }
        self.kill("the grace period is over");
    }
}

impl Drop for Carry {
    fn drop(&mut self) {
        self.kill("the agent is leaving");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sleeper(trap_term: bool) -> (std::process::Child, Kept) {
        use std::os::unix::process::CommandExt;
        let script = if trap_term { "trap 'exit 0' TERM; sleep 60 & wait" } else { "sleep 60 & wait" };
        let child = std::process::Command::new("sh").args(["-c", script]).process_group(0).spawn().expect("sh");
        let pid = i32::try_from(child.id()).expect("pid");
        let start = sys::proc_start(pid).expect("start");
        let kept = Kept { local_rank: 0, rank: 0, pid, start, drains: TaskTracker::new(), tail: Default::default() };
        (child, kept)
    }

    fn exited_within(child: &mut std::process::Child, limit: Duration) -> bool {
        let until = std::time::Instant::now() + limit;
        while std::time::Instant::now() < until {
            if child.try_wait().expect("wait").is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn the_next_round_of_the_same_run_takes_its_live_workers() {
        let (mut child, kept) = sleeper(false);
        let pid = kept.pid;
        let mut carry = Carry::default();
        carry.hold(4, vec![kept]);
        assert_eq!(carry.pids(), [pid]);
        let back = carry.take(4);
        assert_eq!(back.iter().map(|k| k.pid).collect::<Vec<_>>(), [pid]);
        assert!(carry.is_empty());
        drop(carry);
        assert!(!exited_within(&mut child, Duration::from_millis(200)), "taken back, not killed");
        sys::signal_group(pid, libc::SIGKILL);
        let _ = child.wait();
    }

    #[test]
    fn another_run_or_a_drop_kills_them_and_a_reused_pid_is_not_taken() {
        let (mut child, kept) = sleeper(false);
        let mut carry = Carry::default();
        carry.hold(4, vec![kept]);
        assert!(carry.take(5).is_empty(), "run 5 does not get run 4's workers");
        assert!(exited_within(&mut child, Duration::from_secs(10)), "killed");

        let (mut child, mut kept) = sleeper(false);
        kept.start += 1; // as if the pid now named another process
        let mut carry = Carry::default();
        carry.hold(4, vec![kept]);
        assert!(carry.take(4).is_empty(), "not the process that was kept");
        drop(carry);
        assert!(!exited_within(&mut child, Duration::from_millis(200)), "a process that is not ours is not signalled");
        sys::signal_group(i32::try_from(child.id()).expect("pid"), libc::SIGKILL);
        let _ = child.wait();

        let (mut child, kept) = sleeper(false);
        Carry::default().hold(4, vec![kept]);
        assert!(exited_within(&mut child, Duration::from_secs(10)), "a dropped carry kills what it holds");
    }

    #[test]
    fn a_kept_worker_dead_but_not_reaped_yet_is_not_taken() {
        let (mut child, kept) = sleeper(false);
        let pid = kept.pid;
        sys::signal_group(pid, libc::SIGKILL);
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while sys::proc_stat(pid).is_some_and(|s| s.state != 'Z') && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sys::proc_stat(pid).map(|s| s.state), Some('Z'), "a zombie, not reaped");
        let mut carry = Carry::default();
        carry.hold(4, vec![kept]);
        assert!(carry.take(4).is_empty(), "a zombie could never rejoin");
        let _ = child.wait();
    }

    #[tokio::test]
    async fn a_stop_sends_sigterm_first() {
        let (mut child, kept) = sleeper(true);
        let mut carry = Carry::default();
        carry.hold(1, vec![kept]);
        tokio::time::sleep(Duration::from_millis(100)).await; // the trap is set
        let reaper = std::thread::spawn(move || child.wait().expect("wait"));
        carry.stop(Duration::from_secs(20)).await;
        let status = reaper.join().expect("reaper");
        assert_eq!(status.code(), Some(0), "the trap ran: SIGTERM came first ({status:?})");
        assert!(carry.is_empty());
    }
}
