//! One pod's PMI server: reads each local rank's socket (PMI-1 lines or
//! PMI-2 frames, told apart by their first bytes), feeds [`Node`], and
//! carries out its effects: replies, the job-wide fence (`Fence`), and the
//! end of the job on an abort or a broken protocol.

use std::future::Future;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::mpsc;

use super::node::{Effect, Node};
use super::wire::{self, Command, MAX_LINE};

/// The job-wide part of a fence: publish this pod's puts, wait for every
/// pod, and return every pod's puts.
pub trait Fence: Send {
    /// Fence number `seq` (0, 1, ... in this attempt) with `puts`.
    fn fence(
        &mut self,
        seq: u64,
        puts: Vec<(String, String)>,
    ) -> impl Future<Output = Result<Vec<(String, String)>, String>> + Send;
}

/// What the service tells the supervisor, as it happens. A rank that
/// started and exits without [`Note::Finalized`] has left the job: the
/// supervisor sees its exit and counts it a failure whatever its code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// A local rank sent its first command (its PMI init): from now on it
    /// is a rank of the job.
    Started {
        /// The local rank.
        local: usize,
        /// It speaks PMI-2 (else PMI-1).
        v2: bool,
    },
    /// Local rank `l` finalized (sent before its reply, so before it can exit).
    Finalized(usize),
    /// A local rank called abort, asking for exit code `code` (a PMI-1
    /// client then waits to be killed; Slurm's PMI-2 one exits 1).
    Aborted {
        /// The local rank.
        local: usize,
        /// The exit code it asked for.
        code: i32,
        /// Its message.
        why: String,
    },
    /// A local rank broke the protocol or asked for spawn: it waits for a
    /// reply it will never get, and must be stopped.
    Refused {
        /// The local rank.
        local: usize,
        /// What it did.
        why: String,
    },
    /// The job-wide fence failed: no rank of this pod can go on.
    Fence(String),
}

/// Replies a rank may leave unread before it is refused: a rank that does
/// not read must not stall the others' service, nor grow trainlet.
const OUTBOX: usize = 256;

/// What a reader saw: a command, its end, or why it stopped.
enum Read {
    Command(usize, Command),
    Eof(usize),
    Bad(usize, String),
}

/// Read one message: a PMI-1 line, or a PMI-2 frame (its length prefix
/// starts with a digit or a space); `None` at the end of the stream (a
/// reset is an end too: a rank that exits with replies unread resets it).
async fn next(reader: &mut BufReader<tokio::net::unix::OwnedReadHalf>) -> Result<Option<Command>, String> {
    match read_one(reader).await {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(None),
        Err(e) => Err(e.to_string()),
        Ok(r) => r,
    }
}

async fn read_one(
    reader: &mut BufReader<tokio::net::unix::OwnedReadHalf>,
) -> std::io::Result<Result<Option<Command>, String>> {
    let head = reader.fill_buf().await?;
    let Some(&first) = head.first() else { return Ok(Ok(None)) };
    if !(first == b' ' || first.is_ascii_digit()) {
        let mut line = Vec::new();
        let n = (&mut *reader).take(MAX_LINE as u64).read_until(b'\n', &mut line).await?;
        if n >= MAX_LINE && !line.ends_with(b"\n") {
            return Ok(Err(format!("a PMI-1 line over {MAX_LINE} bytes")));
        }
        return Ok(wire::parse_v1(&line).map(Some).map_err(|e| e.to_string()));
    }
    let mut prefix = [0u8; 6];
    reader.read_exact(&mut prefix).await?;
    let len = match wire::frame_len(&prefix) {
        Ok(n) => n,
        Err(e) => return Ok(Err(e.to_string())),
    };
    let mut body = vec![0u8; len];
    if let Err(e) = reader.read_exact(&mut body).await {
        return match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Ok(Err(format!("a PMI-2 frame cut short: {len} bytes announced"))),
            _ => Err(e),
        };
    }
    Ok(wire::parse_v2(&body).map(Some).map_err(|e| e.to_string()))
}

/// The task that writes local rank `local`'s replies in order; its
/// outbox holds [`OUTBOX`] of them. It ends when the rank is gone.
fn writer(mut write: OwnedWriteHalf) -> mpsc::Sender<Vec<u8>> {
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(OUTBOX);
    tokio::spawn(async move {
        while let Some(bytes) = rx.recv().await {
            if write.write_all(&bytes).await.is_err() {
                return;
            }
        }
    });
    tx
}

/// The ranks' sockets, held open after the service ends (dropping this
/// closes them). A rank waiting for a reply that will not come (its
/// abort's, a refused command's, a failed fence's) must go on waiting
/// until the supervisor stops it, not read the end of its socket: MPICH's
/// `MPI_Abort` returns when `PMI_Abort` reads one, and the rank runs on
/// into its next collective, which the others then complete with it.
#[derive(Debug)]
#[must_use = "dropping it closes every rank's socket"]
pub struct Held {
    _open: Vec<mpsc::Sender<Vec<u8>>>,
}

/// Serve `node`'s local ranks on `ranks` (local rank `l` on `ranks[l]`),
/// telling `notes` what happens, until every socket is closed or the job
/// ends here (an abort, a refusal, a failed fence: each the last note).
/// A closed socket is not an end by itself: the rank's exit tells. The
/// sockets stay open in what it returns.
pub async fn serve(node: Node, ranks: Vec<UnixStream>, fence: impl Fence, notes: mpsc::UnboundedSender<Note>) -> Held {
    let (tx, rx) = mpsc::channel::<Read>(ranks.len().max(1));
    let mut writers: Vec<mpsc::Sender<Vec<u8>>> = Vec::with_capacity(ranks.len());
    for (local, stream) in ranks.into_iter().enumerate() {
        let (read, write) = stream.into_split();
        writers.push(writer(write));
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(read);
            loop {
                let msg = match next(&mut reader).await {
                    Ok(Some(cmd)) => Read::Command(local, cmd),
                    Ok(None) => Read::Eof(local),
                    Err(why) => Read::Bad(local, why),
                };
                let stop = !matches!(msg, Read::Command(..));
                if tx.send(msg).await.is_err() || stop {
                    return;
                }
            }
        });
    }
    drop(tx);
    // The supervisor gone means the round is over: nothing to tell.
    if let Some(last) = answer(node, rx, &writers, fence, &notes).await {
        let _ = notes.send(last);
    }
    Held { _open: writers }
}

/// Answer the ranks' commands as they come, telling `notes` what happens,
/// until every reader is done (`None`) or the job ends here (the last note).
async fn answer(
    mut node: Node,
    mut rx: mpsc::Receiver<Read>,
    writers: &[mpsc::Sender<Vec<u8>>],
    mut fence: impl Fence,
    notes: &mpsc::UnboundedSender<Note>,
) -> Option<Note> {
    let mut started = vec![false; writers.len()];
    let mut seq = 0u64;
    let note = |n: Note| {
        let _ = notes.send(n);
    };
    while let Some(msg) = rx.recv().await {
        let (local, cmd) = match msg {
            Read::Command(l, c) => (l, c),
            // A rank gone: the fences it leaves waiting can never complete.
            Read::Eof(l) => {
                if let Some(Effect::Refuse { local, why }) = node.closed(l).into_iter().next() {
                    return Some(Note::Refused { local, why });
                }
                continue;
            }
            Read::Bad(l, why) => return Some(Note::Refused { local: l, why: format!("local rank {l}: {why}") }),
        };
        tracing::trace!(
            local,
            cmd = %cmd.name.escape_debug(),
            key = %cmd.get("key").unwrap_or_default().escape_debug(),
            "PMI command"
        );
        if cmd.name == "finalize" {
            note(Note::Finalized(local));
        }
        let mut effects = node.handle(local, &cmd);
        // Before its reply, so before it can exit.
        if !started[local] {
            started[local] = true;
            note(Note::Started { local, v2: node.wire(local) == super::node::Wire::V2 });
        }
        while !effects.is_empty() {
            let mut more = Vec::new();
            for effect in effects {
                match effect {
                    Effect::Reply { local, bytes } => match writers[local].try_send(bytes) {
                        // A rank gone meanwhile shows as its exit.
                        Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
                        Err(mpsc::error::TrySendError::Full(_)) => {
                            let why = format!("local rank {local} left {OUTBOX} PMI replies unread");
                            return Some(Note::Refused { local, why });
                        }
                    },
                    Effect::Abort { local, code, why } => return Some(Note::Aborted { local, code, why }),
                    Effect::Refuse { local, why } => return Some(Note::Refused { local, why }),
                    Effect::Fence { puts } => match fence.fence(seq, puts).await {
                        Ok(all) => {
                            tracing::debug!(fence = seq, keys = all.len(), "PMI fence done");
                            seq += 1;
                            more.extend(node.fenced(all));
                        }
                        Err(why) => return Some(Note::Fence(why)),
                    },
                }
            }
            effects = more;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, Write};

    use super::super::node::WorldInfo;
    use super::*;

    /// One pod: its own puts are the job's.
    struct Alone;

    impl Fence for Alone {
        async fn fence(&mut self, _seq: u64, puts: Vec<(String, String)>) -> Result<Vec<(String, String)>, String> {
            Ok(puts)
        }
    }

    /// A rank played by a thread over a socketpair: sends `lines` (PMI-1),
    /// returns the replies.
    fn rank(
        stream: std::os::unix::net::UnixStream,
        lines: &'static [&'static str],
    ) -> std::thread::JoinHandle<Vec<String>> {
        std::thread::spawn(move || {
            let mut reader = std::io::BufReader::new(stream.try_clone().expect("clone"));
            let mut stream = stream;
            let mut got = Vec::new();
            for line in lines {
                stream.write_all(format!("{line}\n").as_bytes()).expect("write");
                let mut reply = String::new();
                reader.read_line(&mut reply).expect("read");
                got.push(reply.trim_end().to_string());
            }
            got
        })
    }

    /// Serve to the end; every note, in order.
    async fn run(node: Node, ranks: Vec<UnixStream>, fence: impl Fence) -> Vec<Note> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        drop(serve(node, ranks, fence, tx).await);
        let mut notes = Vec::new();
        while let Ok(n) = rx.try_recv() {
            notes.push(n);
        }
        notes
    }

    /// A rank that never reads its replies is refused once its outbox is
    /// full, and the service goes on answering the others meanwhile.
    #[tokio::test]
    async fn a_rank_that_does_not_read_is_refused_and_does_not_stall_the_others() {
        let job = WorldInfo { kvsname: "k".into(), size: 2, first_rank: 0, local: 2, mapping: "m".into() };
        let (s0, mut c0) = pair();
        let (s1, c1) = pair();
        // Replies of about 1 KB: more than the socket's buffer and the outbox hold.
        let c0_end = c0.try_clone().expect("clone");
        let flood = std::thread::spawn(move || {
            let value = "v".repeat(1000);
            let _ = c0.write_all(format!("cmd=put kvsname=k key=big value={value}\n").as_bytes());
            for _ in 0..2000 {
                if c0.write_all(b"cmd=get kvsname=k key=big\n").is_err() {
                    break;
                }
            }
            c0
        });
        let r1 = rank(c1, &["cmd=init pmi_version=1 pmi_subversion=1", "cmd=get_appnum"]);
        let notes = tokio::time::timeout(std::time::Duration::from_secs(30), run(Node::new(job), vec![s0, s1], Alone))
            .await
            .expect("no stall");
        assert!(
            notes.iter().any(|n| matches!(n, Note::Refused { local: 0, why } if why.contains("unread"))),
            "{notes:?}"
        );
        // The rank is done for (trainlet kills it): its writes fail, and the thread ends.
        c0_end.shutdown(std::net::Shutdown::Both).expect("shutdown");
        drop(flood.join().expect("flood"));
        let _ = r1.join();
    }

    /// A rank that exits with replies unread resets its socket: that is its
    /// end, not a broken protocol.
    #[tokio::test]
    async fn a_reset_is_the_end_of_a_rank_not_a_fault() {
        let job = WorldInfo { kvsname: "k".into(), size: 1, first_rank: 0, local: 1, mapping: "m".into() };
        let (s0, mut c0) = pair();
        let rank = std::thread::spawn(move || {
            for line in [&b"cmd=init pmi_version=1 pmi_subversion=1\n"[..], b"cmd=finalize\n"] {
                c0.write_all(line).expect("write");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        });
        let notes = run(Node::new(job), vec![s0], Alone).await;
        rank.join().expect("rank");
        assert_eq!(notes, [Note::Started { local: 0, v2: false }, Note::Finalized(0)]);
    }

    fn pair() -> (UnixStream, std::os::unix::net::UnixStream) {
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
        a.set_nonblocking(true).expect("nonblocking");
        (UnixStream::from_std(a).expect("tokio"), b)
    }

    #[tokio::test]
    async fn two_ranks_exchange_cards_through_a_fence_and_finalize() {
        let job =
            WorldInfo { kvsname: "kvs_1".into(), size: 2, first_rank: 0, local: 2, mapping: "(vector,(0,1,2))".into() };
        let (s0, c0) = pair();
        let (s1, c1) = pair();
        let r0 = rank(
            c0,
            &[
                "cmd=init pmi_version=1 pmi_subversion=1",
                "cmd=put kvsname=kvs_1 key=card-0 value=zero",
                "cmd=barrier_in",
                "cmd=get kvsname=kvs_1 key=card-1",
                "cmd=finalize",
            ],
        );
        let r1 = rank(
            c1,
            &[
                "cmd=init pmi_version=1 pmi_subversion=1",
                "cmd=put kvsname=kvs_1 key=card-1 value=one",
                "cmd=barrier_in",
                "cmd=get kvsname=kvs_1 key=card-0",
                "cmd=finalize",
            ],
        );
        let notes = run(Node::new(job), vec![s0, s1], Alone).await;
        let (g0, g1) = (r0.join().expect("rank 0"), r1.join().expect("rank 1"));
        let mut sorted = notes.clone();
        sorted.sort_by_key(|n| format!("{n:?}"));
        assert_eq!(
            sorted,
            [
                Note::Finalized(0),
                Note::Finalized(1),
                Note::Started { local: 0, v2: false },
                Note::Started { local: 1, v2: false }
            ],
            "{notes:?}"
        );
        assert_eq!(g0[2], "cmd=barrier_out rc=0");
        assert_eq!(g0[3], "cmd=get_result rc=0 found=TRUE value=one");
        assert_eq!(g1[3], "cmd=get_result rc=0 found=TRUE value=zero");
        assert_eq!(g1[4], "cmd=finalize_ack rc=0");
    }

    #[tokio::test]
    async fn an_abort_or_a_broken_rank_ends_the_service_and_a_closed_socket_does_not() {
        let job = |local| WorldInfo { kvsname: "k".into(), size: 2, first_rank: 0, local, mapping: "m".into() };
        // Rank 0 leaves at once; rank 1 goes on to finalize.
        let (s0, c0) = pair();
        let (s1, c1) = pair();
        drop(c0);
        let r1 = rank(c1, &["cmd=init pmi_version=1 pmi_subversion=1", "cmd=finalize"]);
        let notes = run(Node::new(job(2)), vec![s0, s1], Alone).await;
        assert_eq!(r1.join().expect("rank 1")[1], "cmd=finalize_ack rc=0");
        assert_eq!(notes, [Note::Started { local: 1, v2: false }, Note::Finalized(1)]);
        let (s0, mut c0) = pair();
        c0.write_all(b"cmd=abort exitcode=7 message=oops\n").expect("write");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let held = serve(Node::new(job(1)), vec![s0], Alone, tx).await;
        assert_eq!(rx.recv().await, Some(Note::Started { local: 0, v2: false }));
        assert_eq!(rx.recv().await, Some(Note::Aborted { local: 0, code: 7, why: "oops".into() }));
        // The aborting rank waits to be killed: no reply, and no end to read
        // (MPICH's MPI_Abort would return on one and run on) until the
        // sockets are let go.
        let c0 = tokio::task::spawn_blocking(move || {
            c0.set_read_timeout(Some(std::time::Duration::from_millis(300))).expect("timeout");
            let mut byte = [0u8; 1];
            let waited = std::io::Read::read(&mut c0, &mut byte).map_err(|e| e.kind());
            (c0, waited)
        });
        let (mut c0, waited) = c0.await.expect("reader");
        assert_eq!(waited, Err(std::io::ErrorKind::WouldBlock), "nothing to read while held");
        drop(held);
        let closed = tokio::task::spawn_blocking(move || {
            c0.set_read_timeout(Some(std::time::Duration::from_secs(30))).expect("timeout");
            std::io::Read::read(&mut c0, &mut [0u8; 1]).map_err(|e| e.kind())
        });
        assert_eq!(closed.await.expect("reader"), Ok(0), "the end, once let go");
        // An empty line is not a PMI-2 length: refused, not waited on.
        let (s0, mut c0) = pair();
        c0.write_all(b"\n").expect("write");
        assert!(matches!(run(Node::new(job(1)), vec![s0], Alone).await.as_slice(), [Note::Refused { local: 0, .. }]));
        let (s0, mut c0) = pair();
        c0.write_all(b"    60cmd=get;").expect("write");
        drop(c0);
        let notes = run(Node::new(job(1)), vec![s0], Alone).await;
        assert!(matches!(notes.as_slice(), [Note::Refused { why, .. }] if why.contains("cut short")), "{notes:?}");
        let (s0, mut c0) = pair();
        c0.write_all(b"garbage\n").expect("write");
        assert!(matches!(run(Node::new(job(1)), vec![s0], Alone).await.as_slice(), [Note::Refused { local: 0, .. }]));
        let (s0, mut c0) = pair();
        c0.write_all(b"mcmd=spawn\n").expect("write");
        let notes = run(Node::new(job(1)), vec![s0], Alone).await;
        assert!(
            matches!(notes.as_slice(), [Note::Started { local: 0, v2: false }, Note::Refused { why, .. }] if why.contains("spawn")),
            "{notes:?}"
        );
    }
}
