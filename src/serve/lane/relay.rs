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
#[derive(Debug, Clone)]
pub struct Sender {
    tx: mpsc::UnboundedSender<Note>,
}

impl Sender {
    /// Write notes to `stream` until it fails or every sender is dropped.
    pub fn start(stream: tokio::net::UnixStream) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Note>();
        tokio::spawn(async move {
            let mut stream = stream;
            while let Some(note) = rx.recv().await {
                let Ok(mut line) = serde_json::to_vec(&note) else { continue };
                line.push(b'\n');
                if let Err(e) = stream.write_all(&line).await {
                    tracing::warn!(error = %e, "the pod's agent is gone: this lane's run is no longer shown on the board");
                    return;
                }
            }
        });
        Self { tx }
    }

    /// Send `note`.
    pub fn send(&self, note: Note) {
        let _ = self.tx.send(note);
    }
}

/// The pod's agent's side: read lane `seq`'s notes until EOF, applying
/// them to `board` when there is one. Returns when the lane agent is gone.
pub async fn read(stream: tokio::net::UnixStream, seq: u64, board: Option<Arc<Board>>) {
    use tokio::io::AsyncReadExt;
    let mut reader = tokio::io::BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut reader).take(MAX_NOTE + 1).read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) if line.last() != Some(&b'\n') => {
                tracing::warn!(run = seq, "a lane agent's note is longer than {MAX_NOTE} bytes; the link is dropped");
                return;
            }
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
    async fn an_endless_line_drops_the_link_instead_of_growing() {
        let (ours, mut theirs) = tokio::net::UnixStream::pair().expect("pair");
        let reading = tokio::spawn(read(ours, 2, Some(Arc::new(Board::default()))));
        let writing = tokio::spawn(async move {
            let chunk = vec![b'x'; 1 << 16];
            for _ in 0..(MAX_NOTE / (1 << 16) + 4) {
                if theirs.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        });
        tokio::time::timeout(std::time::Duration::from_secs(20), reading).await.expect("dropped").expect("task");
        writing.abort();
    }
}
