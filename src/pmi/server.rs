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

/// How the service ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// Every local rank finalized and closed its socket.
    Finalized,
    /// A local rank closed its socket (exited) without finalizing.
    Closed {
        /// The local rank.
        local: usize,
    },
    /// A local rank aborted the job, or broke the protocol.
    Aborted {
        /// The local rank.
        local: usize,
        /// Its exit code.
        code: i32,
        /// Why.
        why: String,
    },
    /// The job-wide fence failed.
    Fence(String),
}

/// What a reader saw: a command, its end, or why it stopped.
enum Read {
    Command(usize, Command),
    Eof(usize),
    Bad(usize, String),
}

/// Read one message: a PMI-1 line (`cmd=`/`mcmd=`) or a PMI-2 frame.
async fn next(reader: &mut BufReader<tokio::net::unix::OwnedReadHalf>) -> Result<Option<Command>, String> {
    let head = reader.fill_buf().await.map_err(|e| e.to_string())?;
    if head.is_empty() {
        return Ok(None);
    }
    if head.starts_with(b"c") || head.starts_with(b"m") {
        let mut line = Vec::new();
        let n = (&mut *reader).take(MAX_LINE as u64).read_until(b'\n', &mut line).await.map_err(|e| e.to_string())?;
        if n >= MAX_LINE && !line.ends_with(b"\n") {
            return Err(format!("a PMI-1 line over {MAX_LINE} bytes"));
        }
        return wire::parse_v1(&line).map(Some).map_err(|e| e.to_string());
    }
    let mut prefix = [0u8; 6];
    reader.read_exact(&mut prefix).await.map_err(|e| e.to_string())?;
    let len = wire::frame_len(&prefix).map_err(|e| e.to_string())?;
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).await.map_err(|e| e.to_string())?;
    wire::parse_v2(&body).map(Some).map_err(|e| e.to_string())
}

/// Serve `node`'s local ranks on `ranks` (local rank `l` on `ranks[l]`)
/// until they all finalize, one leaves or aborts, or a fence fails.
pub async fn serve(mut node: Node, ranks: Vec<UnixStream>, mut fence: impl Fence) -> Ended {
    let (tx, mut rx) = mpsc::channel::<Read>(ranks.len().max(1));
    let mut writers: Vec<OwnedWriteHalf> = Vec::with_capacity(ranks.len());
    for (local, stream) in ranks.into_iter().enumerate() {
        let (read, write) = stream.into_split();
        writers.push(write);
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
    let mut finalized = vec![false; writers.len()];
    let mut open = writers.len();
    let mut seq = 0u64;
    while let Some(msg) = rx.recv().await {
        let (local, cmd) = match msg {
            Read::Command(l, c) => (l, c),
            Read::Eof(l) => {
                if !finalized[l] {
                    return Ended::Closed { local: l };
                }
                open -= 1;
                if open == 0 {
                    return Ended::Finalized;
                }
                continue;
            }
            Read::Bad(l, why) => return Ended::Aborted { local: l, code: 1, why: format!("local rank {l}: {why}") },
        };
        if cmd.name == "finalize" {
            finalized[local] = true;
        }
        let mut effects = node.handle(local, &cmd);
        while !effects.is_empty() {
            let mut more = Vec::new();
            for effect in effects {
                match effect {
                    Effect::Reply { local, bytes } => {
                        // A rank gone meanwhile shows as its reader's EOF.
                        let _ = writers[local].write_all(&bytes).await;
                    }
                    Effect::Abort { local, code, why } => return Ended::Aborted { local, code, why },
                    Effect::Fence { puts } => match fence.fence(seq, puts).await {
                        Ok(all) => {
                            seq += 1;
                            more.extend(node.fenced(all));
                        }
                        Err(why) => return Ended::Fence(why),
                    },
                }
            }
            effects = more;
        }
    }
    Ended::Finalized
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, Write};

    use super::super::node::Job;
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

    fn pair() -> (UnixStream, std::os::unix::net::UnixStream) {
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
        a.set_nonblocking(true).expect("nonblocking");
        (UnixStream::from_std(a).expect("tokio"), b)
    }

    #[tokio::test]
    async fn two_ranks_exchange_cards_through_a_fence_and_finalize() {
        let job = Job { kvsname: "kvs_1".into(), size: 2, first_rank: 0, local: 2, mapping: "(vector,(0,1,2))".into() };
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
        let ended = serve(Node::new(job), vec![s0, s1], Alone).await;
        let (g0, g1) = (r0.join().expect("rank 0"), r1.join().expect("rank 1"));
        assert_eq!(ended, Ended::Finalized);
        assert_eq!(g0[2], "cmd=barrier_out rc=0");
        assert_eq!(g0[3], "cmd=get_result rc=0 found=TRUE value=one");
        assert_eq!(g1[3], "cmd=get_result rc=0 found=TRUE value=zero");
        assert_eq!(g1[4], "cmd=finalize_ack rc=0");
    }

    #[tokio::test]
    async fn a_rank_that_leaves_before_finalize_or_aborts_ends_the_service() {
        let job = |local| Job { kvsname: "k".into(), size: 2, first_rank: 0, local, mapping: "m".into() };
        let (s0, c0) = pair();
        drop(c0);
        assert_eq!(serve(Node::new(job(1)), vec![s0], Alone).await, Ended::Closed { local: 0 });
        let (s0, mut c0) = pair();
        c0.write_all(b"cmd=abort exitcode=7 message=oops\n").expect("write");
        let ended = serve(Node::new(job(1)), vec![s0], Alone).await;
        assert_eq!(ended, Ended::Aborted { local: 0, code: 7, why: "rank 0 called abort: oops".into() });
        let (s0, mut c0) = pair();
        c0.write_all(b"garbage\n").expect("write");
        assert!(matches!(serve(Node::new(job(1)), vec![s0], Alone).await, Ended::Aborted { .. }));
    }

    /// Real MPICH ranks (Debian's, an `MPI_Allreduce` program built with
    /// `mpicc.mpich` into `PMI_TEST_PROGRAM`) against this server, one pod
    /// of 2 ranks. Ignored: it belongs in tests/it once the launch path
    /// serves PMI (issue 29); run with `--ignored` and the program built.
    #[tokio::test]
    #[ignore = "needs PMI_TEST_PROGRAM: an MPICH program (work in progress, issue 29)"]
    async fn mpich_ranks_run_an_allreduce_on_this_server() {
        let program = std::env::var("PMI_TEST_PROGRAM").expect("PMI_TEST_PROGRAM");
        let job = Job { kvsname: "kvs_1".into(), size: 2, first_rank: 0, local: 2, mapping: "(vector,(0,1,2))".into() };
        let mut servers = Vec::new();
        let mut children = Vec::new();
        for r in 0..2 {
            let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
            let fd = std::os::fd::AsRawFd::as_raw_fd(&b);
            nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty())).expect("inheritable");
            children.push(
                std::process::Command::new(&program)
                    .env("PMI_FD", fd.to_string())
                    .env("PMI_RANK", r.to_string())
                    .env("PMI_SIZE", "2")
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .expect("spawn"),
            );
            drop(b);
            a.set_nonblocking(true).expect("nonblocking");
            servers.push(UnixStream::from_std(a).expect("tokio"));
        }
        let ended =
            tokio::time::timeout(std::time::Duration::from_secs(60), serve(Node::new(job), servers, Alone)).await;
        let outs: Vec<String> = children
            .into_iter()
            .map(|c| String::from_utf8_lossy(&c.wait_with_output().expect("wait").stdout).into_owned())
            .collect();
        assert_eq!(ended, Ok(Ended::Finalized), "{outs:?}");
        assert!(outs.iter().all(|o| o.contains("of 2 sum 3")), "{outs:?}");
    }

    /// Two pods of 2 real MPICH ranks each, one store between them (the
    /// fence of `super::super::fence`). Ignored like the test above.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs PMI_TEST_PROGRAM: an MPICH program (work in progress, issue 29)"]
    async fn mpich_ranks_on_two_pods_meet_through_the_store() {
        use std::sync::Arc;

        use crate::store::{Budget, Client, StoreServer, bind_listener};

        let program = std::env::var("PMI_TEST_PROGRAM").expect("PMI_TEST_PROGRAM");
        let cancel = tokio_util::sync::CancellationToken::new();
        let listener = bind_listener(Some("127.0.0.1".parse().expect("ip")), 0).expect("bind");
        let store = StoreServer::start(listener, Arc::new(Budget::new(64 << 20)), cancel.child_token()).expect("serve");
        let mut pods = Vec::new();
        let mut children = Vec::new();
        for node in 0..2u32 {
            let job = Job {
                kvsname: "kvs_1".into(),
                size: 4,
                first_rank: node * 2,
                local: 2,
                mapping: "(vector,(0,2,2))".into(),
            };
            let mut servers = Vec::new();
            for l in 0..2 {
                let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
                let fd = std::os::fd::AsRawFd::as_raw_fd(&b);
                nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty())).expect("inheritable");
                children.push(
                    std::process::Command::new(&program)
                        .env("PMI_FD", fd.to_string())
                        .env("PMI_RANK", (node * 2 + l).to_string())
                        .env("PMI_SIZE", "4")
                        .stdout(std::process::Stdio::piped())
                        .spawn()
                        .expect("spawn"),
                );
                drop(b);
                a.set_nonblocking(true).expect("nonblocking");
                servers.push(UnixStream::from_std(a).expect("tokio"));
            }
            let client = Client::connect(store.local_addr()).await.expect("connect");
            let fence = super::super::fence::StoreFence {
                client,
                prefix: "trainlet/r/pmi/0".into(),
                node: node as usize,
                nnodes: 2,
            };
            pods.push(tokio::spawn(serve(Node::new(job), servers, fence)));
        }
        for pod in pods {
            let ended = tokio::time::timeout(std::time::Duration::from_secs(60), pod).await;
            assert!(matches!(ended, Ok(Ok(Ended::Finalized))), "{ended:?}");
        }
        let outs: Vec<String> = children
            .into_iter()
            .map(|c| String::from_utf8_lossy(&c.wait_with_output().expect("wait").stdout).into_owned())
            .collect();
        assert!(outs.iter().all(|o| o.contains("of 4 sum 10")), "{outs:?}");
        cancel.cancel();
    }
}
