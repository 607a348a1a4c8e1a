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
use crate::serve::{Error, Link, Scope, files, kind, logs, seal};
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
    /// served by `rounds` until `cancel`.
    pub fn new(rounds: Rounds, run_id: String, attempt: u64, cancel: CancellationToken) -> Self {
        Self { rounds, run_id, attempt, cancel, open: tokio::sync::Mutex::new(Open::default()) }
    }

    /// The rendezvous key prefix of lane `seq`.
    pub fn base(&self, seq: u64) -> String {
        crate::rendezvous::job_base(&crate::config::lane_rdzv_id(&self.run_id, seq), self.attempt)
    }

    /// The files of the open lanes (kept when the main run's are let go).
    pub async fn files(&self) -> Vec<FileRef> {
        self.open.lock().await.lanes.values().flat_map(|l| l.files.iter().cloned()).collect()
    }

    /// Is run `seq` an open lane (its lines are kept)?
    pub async fn is_open(&self, seq: u64) -> bool {
        self.open.lock().await.lanes.contains_key(&seq)
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
            link.set_lanes(token, scope, &open.record()).await
        }
        .await;
        if let Err(e) = published {
            rounds.cancel();
            open.lanes.remove(&run.seq);
            let _ = link.delete(&link.keys.lane_run(run.seq)).await;
            return Err(e);
        }
        tracing::info!(run = %run.id, workers = entry.nproc, first_slot = entry.first, "opened a lane beside the main run");
        Ok(())
    }

    /// Close the lanes whose runs `board` shows over (or no longer has).
    /// `keep`: the files the main run uses; `next_seq`: the next run's
    /// number (a closed lane's lines go when they are past the kept ones).
    async fn close_over(&self, link: &mut Link, (token, scope): (&str, &Scope), board: &Board) -> Result<(), Error> {
        let mut open = self.open.lock().await;
        let over: Vec<u64> =
            open.lanes.keys().copied().filter(|seq| board.by_seq(*seq).is_none_or(|r| r.state.is_final())).collect();
        if over.is_empty() {
            return Ok(());
        }
        let mut gone = Vec::new();
        for seq in &over {
            if let Some(l) = open.lanes.remove(seq) {
                gone.push((*seq, l));
            }
        }
        open.version += 1;
        if let Err(e) = link.set_lanes(token, scope, &open.record()).await {
            for (seq, l) in gone {
                open.lanes.insert(seq, l);
            }
            return Err(e);
        }
        let mut keep: Vec<FileRef> = open.lanes.values().flat_map(|l| l.files.iter().cloned()).collect();
        drop(open);
        if let Some(Ok(main)) = link.newest(token, scope).await? {
            keep.extend(main.files);
        }
        for (seq, lane) in gone {
            lane.rounds.cancel();
            tracing::info!(run = seq, "closed the lane of a run that is over");
            link.delete(&link.keys.lane_run(seq)).await?;
            files::forget(link, &lane.files, &keep).await?;
            if seq + crate::serve::api::KEEP_LOGS < board.next_seq() {
                let keys = link.keys.clone();
                logs::forget(link, &keys, seq).await?;
            }
        }
        Ok(())
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
        let _one = submit.lock().await;
        if let Err(e) = lanes.close_over(&mut link, (&token, &scope), &board).await {
            tracing::warn!(error = %crate::error::error_chain(&e), "cannot close the lanes of runs that are over; trying again");
        }
    }
}
