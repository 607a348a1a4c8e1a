//! The control API's side of the lanes: open a lane for an actor placed
//! beside the main run (its rounds served on the store host, its run and
//! the lanes record published), and close the lanes whose runs are over
//! (the record published without them, their rounds, run, files and lines
//! let go).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Entry, Record};
use crate::rendezvous::host::Rounds;
use crate::serve::board::Board;
use crate::serve::spec::{FileRef, Run};
use crate::serve::{Error, Link, Scope, files, kind, seal};
use crate::store::Dial;

/// How often the open lanes are checked without a change on the board
/// (a close that failed on the store is tried again).
const RECHECK: Duration = Duration::from_secs(5);

/// The open lanes, on the store host.
#[derive(Debug)]
pub struct Lanes {
    rounds: Rounds,
    run_id: String,
    attempt: u64,
    /// How long a lane's run may stay `stopping` before it is taken for stopped.
    stop_limit: Duration,
    cancel: CancellationToken,
    /// Held across each publication, so that the record's versions reach
    /// the store in order.
    open: tokio::sync::Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    version: u64,
    lanes: BTreeMap<u64, Lane>,
}

#[derive(Debug)]
struct Lane {
    entry: Entry,
    files: Vec<FileRef>,
    rounds: CancellationToken,
}

impl Open {
    fn record(&self) -> Record {
        Record { version: self.version, lanes: self.lanes.values().map(|l| l.entry).collect() }
    }
}

impl Lanes {
    /// Lanes of the job `run_id` (JobSet attempt `attempt`), their rounds
    /// served by `rounds` until `cancel`; a run stops within `stop_limit`.
    pub fn new(
        rounds: Rounds,
        (run_id, attempt): (String, u64),
        stop_limit: Duration,
        cancel: CancellationToken,
    ) -> Self {
        let open = tokio::sync::Mutex::new(Open::default());
        Self { rounds, run_id, attempt, stop_limit, cancel, open }
    }

    /// The runs of the open lanes.
    async fn seqs(&self) -> Vec<u64> {
        self.open.lock().await.lanes.keys().copied().collect()
    }

    /// The rendezvous key prefix of lane `seq`.
    pub fn base(&self, seq: u64) -> String {
        crate::rendezvous::job_base(&crate::config::lane_rdzv_id(&self.run_id, seq), self.attempt)
    }

    /// The files of the open lanes (kept when the main run's are let go).
    pub async fn files(&self) -> Vec<FileRef> {
        self.open.lock().await.lanes.values().flat_map(|l| l.files.iter().cloned()).collect()
    }

    /// Open a lane for `run` (placed by [`super::place`]): its rounds
    /// served, its run and the lanes record published. Nothing stays
    /// behind when a write fails.
    pub async fn open(&self, link: &mut Link, token: &str, scope: &Scope, run: &Run) -> Result<(), Error> {
        let entry = Entry { seq: run.seq, nproc: run.nproc.unwrap_or(1), first: run.first_slot };
        let json = serde_json::to_vec(run).map_err(|e| Error::Corrupt(e.to_string()))?;
        let mut open = self.open.lock().await;
        if open.lanes.len() >= super::MAX_LANES {
            return Err(Error::Corrupt(format!("{} lanes are open already (at most that many)", super::MAX_LANES)));
        }
        // The lane's agents join as soon as they see it: its rounds first.
        let rounds = self.cancel.child_token();
        self.rounds.serve(self.base(run.seq), rounds.clone());
        let published = async {
            link.set(&link.keys.lane_run(run.seq), &seal(token, scope, kind::RUN, 0, &json)).await?;
            open.version += 1;
            open.lanes.insert(run.seq, Lane { entry, files: run.files.clone(), rounds: rounds.clone() });
            link.set_lanes(token, scope, &open.record()).await?;
            // Idle pods wait for the main run's go signal of this seq: it
            // tells them to wait for a later one.
            link.set(&link.keys.go(run.seq), b"lane").await
        }
        .await;
        if let Err(e) = published {
            rounds.cancel();
            // The record may list it already: published again without it.
            if open.lanes.remove(&run.seq).is_some() {
                open.version += 1;
                let _ = link.set_lanes(token, scope, &open.record()).await;
            }
            let _ = link.delete(&link.keys.lane_run(run.seq)).await;
            return Err(e);
        }
        tracing::info!(run = %run.id, workers = entry.nproc, first_slot = entry.first, "opened a lane beside the main run");
        Ok(())
    }

    /// Close the lanes whose runs `board` shows over (or no longer has):
    /// the record published without them, their rounds no longer served,
    /// their run and the files nobody else uses let go.
    async fn close_over(&self, link: &mut Link, (token, scope): (&str, &Scope), board: &Board) -> Result<(), Error> {
        let mut open = self.open.lock().await;
        let over: Vec<u64> =
            open.lanes.keys().copied().filter(|seq| board.by_seq(*seq).is_none_or(|r| r.state.is_final())).collect();
        if over.is_empty() {
            return Ok(());
        }
        let gone: Vec<(u64, Lane)> = over.iter().filter_map(|seq| open.lanes.remove_entry(seq)).collect();
        open.version += 1;
        if let Err(e) = link.set_lanes(token, scope, &open.record()).await {
            open.version -= 1;
            open.lanes.extend(gone);
            return Err(e);
        }
        // Nobody waits for the version before the last any more (a pod
        // that does reads the record again within seconds).
        let old = open.version.saturating_sub(2);
        let mut keep: Vec<FileRef> = open.lanes.values().flat_map(|l| l.files.iter().cloned()).collect();
        drop(open);
        for (seq, lane) in &gone {
            lane.rounds.cancel();
            tracing::info!(run = seq, "closed the lane of a run that is over");
        }
        // What is left in the store: let go as far as it will (the next
        // close or submission tries the rest of the files again).
        let mut left = Vec::new();
        if old > 0
            && let Err(e) = link.delete(&link.keys.lanes_wake(old)).await
        {
            left.push(e);
        }
        // Without the main run's files known, no file is let go.
        let known = match link.newest(token, scope).await {
            Ok(Some(Ok(main))) => {
                keep.extend(main.files);
                true
            }
            Ok(None) => true,
            Ok(Some(Err(_))) => false,
            Err(e) => {
                left.push(e);
                false
            }
        };
        for (seq, lane) in &gone {
            if let Err(e) = link.delete(&link.keys.lane_run(*seq)).await {
                left.push(e);
            }
            if known && let Err(e) = files::forget(link, &lane.files, &keep).await {
                left.push(e);
            }
        }
        match left.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Close lanes as their runs end, until `cancel`: on every change of the
/// board, and every few seconds (a close the store refused is tried
/// again). `submit` is the control API's submission lock: files are let go
/// only between two submissions.
pub async fn keep(
    lanes: Arc<Lanes>,
    board: Arc<Board>,
    (dial, base, token_file, scope): (Dial, String, std::path::PathBuf, Scope),
    submit: Arc<tokio::sync::Mutex<()>>,
    cancel: CancellationToken,
) {
    let mut link = Link::new(dial, &base);
    let mut w = board.watch();
    let mut stopping: BTreeMap<u64, tokio::time::Instant> = BTreeMap::new();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = w.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(RECHECK) => {}
        }
        let token = match crate::serve::read_token(&token_file) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the control token; the lanes of runs that are over stay open");
                continue;
            }
        };
        // A run whose pods never say it ended (its lane agents cannot
        // start, or their note was lost) is taken for stopped after twice
        // the stop limit, and its lane closed.
        let seqs = lanes.seqs().await;
        stopping.retain(|seq, _| seqs.contains(seq));
        for seq in seqs {
            if board.by_seq(seq).is_some_and(|r| r.state == crate::serve::board::State::Stopping) {
                let since = *stopping.entry(seq).or_insert_with(tokio::time::Instant::now);
                if since.elapsed() > lanes.stop_limit * 2 {
                    tracing::warn!(run = seq, "the lane's pods did not say its run ended; it is taken for stopped");
                    board.ended(seq, crate::serve::board::State::Stopped, Vec::new(), None);
                }
            }
        }
        let _one = submit.lock().await;
        if let Err(e) = lanes.close_over(&mut link, (&token, &scope), &board).await {
            tracing::warn!(error = %crate::error::error_chain(&e), "cannot close the lanes of runs that are over; trying again");
        }
    }
}
