//! The link between a lane agent and the pod's agent that started it: a
//! socket the lane agent gets as fd 3 (`crate::config::LANE_FD`). Its end
//! (EOF) tells the pod's agent that the lane agent is gone. The lane agent
//! on the store host's pod also tells the host's board how its run moves
//! ([`Note`], one JSON line each); the pod's agent applies each note of
//! that lane's run to the board and ignores any other.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::serve::board::{Board, RankExit, State};

/// Longest note read (a failure report with every rank's lines).
pub const MAX_NOTE: u64 = 4 << 20;

/// What a lane agent tells the host's board.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Note {
    /// `Board::started`.
    Started {
        /// The run.
        seq: u64,
        /// The lane's round.
        round: u64,
        /// Restarts used.
        restarts: u32,
        /// Pods.
        nnodes: u32,
        /// Workers per pod.
        nproc: u32,
    },
    /// `Board::round_over`.
    RoundOver {
        /// The run.
        seq: u64,
    },
    /// `Board::ended`.
    Ended {
        /// The run.
        seq: u64,
        /// `succeeded`, `failed` or `stopped`.
        state: String,
        /// Per-rank exits.
        ranks: Vec<Rank>,
        /// The failure report.
        report: Option<serde_json::Value>,
    },
}

/// A [`RankExit`] as sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rank {
    /// Global rank.
    pub rank: u32,
    /// Exit code.
    pub exit_code: Option<i32>,
    /// Signal name.
    pub signal: Option<String>,
    /// `succeeded`, `failed` or `stopped`.
    pub state: String,
}

impl From<&RankExit> for Rank {
    fn from(r: &RankExit) -> Self {
        Self { rank: r.rank, exit_code: r.exit_code, signal: r.signal.clone(), state: r.state.to_string() }
    }
}

/// A run's final state from its word.
fn final_state(word: &str) -> Option<State> {
    match word {
        "succeeded" => Some(State::Succeeded),
        "failed" => Some(State::Failed),
        "stopped" => Some(State::Stopped),
        _ => None,
    }
}

/// The rank state words the board knows.
fn rank_word(word: &str) -> &'static str {
    match word {
        "succeeded" => "succeeded",
        "failed" => "failed",
        _ => "stopped",
    }
}

/// Apply `note` to `board` when it is of run `seq` (the lane's); false
/// when it is not (another run's, or not a final state).
pub fn apply(board: &Board, seq: u64, note: Note) -> bool {
    match note {
        Note::Started { seq: s, round, restarts, nnodes, nproc } if s == seq => {
            board.started(seq, round, restarts, nnodes, nproc);
        }
        Note::RoundOver { seq: s } if s == seq => board.round_over(seq),
        Note::Ended { seq: s, state, ranks, report } if s == seq => {
            let Some(state) = final_state(&state) else { return false };
            let ranks = ranks
                .into_iter()
                .map(|r| RankExit {
                    rank: r.rank,
                    exit_code: r.exit_code,
                    signal: r.signal,
                    state: rank_word(&r.state),
                })
                .collect();
            board.ended(seq, state, ranks, report);
        }
        _ => return false,
    }
    true
}

/// The lane agent's side: notes go out in order, on a task of their own
/// (a note never waits on the socket).
#[derive(Debug)]
pub struct Sender {
    tx: mpsc::UnboundedSender<Note>,
    task: tokio::task::JoinHandle<Option<tokio::net::UnixStream>>,
}

/// How long a lane agent that exits waits for its last notes to go out.
const FLUSH: std::time::Duration = std::time::Duration::from_secs(5);

impl Sender {
    /// Write notes to `stream` until it fails or the sender is closed.
    pub fn start(stream: tokio::net::UnixStream) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Note>();
        let task = tokio::spawn(async move {
            let mut stream = stream;
            while let Some(note) = rx.recv().await {
                let Some(line) = line_of(note) else { continue };
                if let Err(e) = stream.write_all(&line).await {
                    tracing::warn!(error = %e, "the pod's agent is gone: this lane's run is no longer shown on the board");
                    return None;
                }
            }
            Some(stream)
        });
        Self { tx, task }
    }

    /// Send `note`.
    pub fn send(&self, note: Note) {
        let _ = self.tx.send(note);
    }

    /// Send what is queued (for a few seconds at most). The link itself
    /// stays open until this process exits: its end is what tells the
    /// pod's agent that this lane agent is gone.
    pub async fn close(self) {
        drop(self.tx);
        if let Ok(Ok(Some(stream))) = tokio::time::timeout(FLUSH, self.task).await
            && let Ok(stream) = stream.into_std()
        {
            std::mem::forget(stream);
        }
    }
}

/// `note` as one line of at most [`MAX_NOTE`] bytes: a failure report
/// too large for it is replaced by a word on its size (it is in the lane
/// agent's log and file); None for a note that cannot be made to fit.
fn line_of(note: Note) -> Option<Vec<u8>> {
    let mut line = serde_json::to_vec(&note).ok()?;
    if line.len() as u64 >= MAX_NOTE
        && let Note::Ended { seq, state, ranks, report: Some(_) } = note
    {
        let report = serde_json::json!({ "truncated": format!("the failure report was {} bytes: see the lane agent's failure_report.json", line.len()) });
        line = serde_json::to_vec(&Note::Ended { seq, state, ranks, report: Some(report) }).ok()?;
    }
    if line.len() as u64 >= MAX_NOTE {
        tracing::warn!(bytes = line.len(), "a note to the board is too large; not sent");
        return None;
    }
    line.push(b'\n');
    Some(line)
}

/// The pod's agent's side: read lane `seq`'s notes until EOF, applying
/// them to `board` when there is one. Returns when the lane agent is gone.
pub async fn read(stream: tokio::net::UnixStream, seq: u64, board: Option<Arc<Board>>) {
    use tokio::io::AsyncReadExt;
    let mut reader = tokio::io::BufReader::new(stream);
    let mut line = Vec::new();
    let mut skipping = false;
    loop {
        line.clear();
        match (&mut reader).take(MAX_NOTE + 1).read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            // Too long: skipped to its end, held no longer than MAX_NOTE.
            Ok(_) if line.last() != Some(&b'\n') => {
                if !std::mem::replace(&mut skipping, true) {
                    tracing::warn!(run = seq, "a lane agent's note is longer than {MAX_NOTE} bytes; skipped");
                }
                continue;
            }
            Ok(_) if std::mem::replace(&mut skipping, false) => continue,
            Ok(_) => {}
        }
        let Some(board) = &board else { continue };
        match serde_json::from_slice::<Note>(&line) {
            Ok(note) => {
                if !apply(board, seq, note) {
                    tracing::warn!(run = seq, "a lane agent sent a note of another run or state; ignored");
                }
            }
            Err(e) => tracing::warn!(run = seq, error = %e, "a lane agent sent a note that is not one; ignored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::spec::Run;

    #[tokio::test]
    async fn notes_of_the_lanes_run_reach_the_board_and_others_do_not() {
        let board = Arc::new(Board::default());
        let run = |seq| Run {
            id: format!("run-{seq}-x"),
            seq,
            command: Vec::new(),
            env: Vec::new(),
            nproc: Some(1),
            max_restarts: 0,
            base_restarts: 0,
            files: Vec::new(),
            actor: None,
            first_slot: 1,
            lane: true,
        };
        board.submitted(&run(2), 0);
        board.submitted(&run(3), 0);
        let (ours, theirs) = tokio::net::UnixStream::pair().expect("pair");
        let reading = tokio::spawn(read(ours, 2, Some(Arc::clone(&board))));
        let tx = Sender::start(theirs);
        tx.send(Note::Started { seq: 2, round: 4, restarts: 1, nnodes: 2, nproc: 1 });
        tx.send(Note::Started { seq: 3, round: 9, restarts: 0, nnodes: 2, nproc: 1 });
        let rank = Rank { rank: 1, exit_code: Some(3), signal: None, state: "failed".into() };
        tx.send(Note::Ended { seq: 2, state: "failed".into(), ranks: vec![rank], report: None });
        drop(tx);
        tokio::time::timeout(std::time::Duration::from_secs(10), reading).await.expect("EOF ends it").expect("task");
        let two = board.by_seq(2).expect("run 2");
        assert_eq!((two.state, two.restarts, two.nnodes), (State::Failed, 1, Some(2)));
        assert_eq!(two.ranks, vec![RankExit { rank: 1, exit_code: Some(3), signal: None, state: "failed" }]);
        assert_eq!(board.by_seq(3).expect("run 3").state, State::Starting, "another run's note is ignored");
        // Not a final state: refused.
        assert!(!apply(&board, 3, Note::Ended { seq: 3, state: "running".into(), ranks: Vec::new(), report: None }));
    }

    #[tokio::test]
    async fn a_line_too_long_is_skipped_unheld_and_the_next_note_counts() {
        let board = Arc::new(Board::default());
        let mut run = crate::serve::board::tests::run(2);
        run.lane = true;
        board.submitted(&run, 0);
        let (ours, mut theirs) = tokio::net::UnixStream::pair().expect("pair");
        let reading = tokio::spawn(read(ours, 2, Some(Arc::clone(&board))));
        let chunk = vec![b'x'; 1 << 16];
        for _ in 0..(2 * MAX_NOTE / (1 << 16)) {
            theirs.write_all(&chunk).await.expect("write");
        }
        theirs.write_all(b"\n{\"round_over\":{\"seq\":2}}\n").await.expect("write");
        let note = Note::Started { seq: 2, round: 1, restarts: 0, nnodes: 1, nproc: 1 };
        theirs.write_all(&line_of(note).expect("line")).await.expect("write");
        drop(theirs);
        tokio::time::timeout(std::time::Duration::from_secs(20), reading).await.expect("EOF ends it").expect("task");
        assert_eq!(board.by_seq(2).map(|r| r.state), Some(State::Running), "the note after the long line counts");
        // A report too large to send goes as a word on its size.
        let big = serde_json::json!({ "lines": "y".repeat(4 << 20) });
        let line = line_of(Note::Ended { seq: 2, state: "failed".into(), ranks: Vec::new(), report: Some(big) })
            .expect("sent without its report");
        assert!((line.len() as u64) < MAX_NOTE && String::from_utf8_lossy(&line).contains("truncated"));
    }
}
