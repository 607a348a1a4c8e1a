//! Static rendezvous between trainlet agents, over the agents' store.
//!
//! All keys live under `trainlet/<run_id>/` (torch's clients prefix their
//! keys with `/`, so they never collide). Per job:
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `claim/<node>` | each agent, COMPARE_SET once | who holds a node rank (duplicates are refused) |
//! | `a<N>/info/<node>` | each agent | nnodes, nproc, restart budget, host, pid |
//! | `a<N>/port` | the store host | port of attempt N's fresh worker store |
//! | `a<N>/end` | first writer wins (COMPARE_SET) | `success`, `failure` or `abort:<node>:<signal>` |
//! | `a<N>/done` | ADD per pod whose workers all exited 0 | the pod reaching nnodes writes `end=success` |
//! | `a<N>/failures/<node>` | each agent after stopping | JSON list of its failures |
//! | `a<N>/stopped`, `a<N>/all_stopped` | ADD per pod, then the last one | every pod's workers are gone |
//! | `a<N>/left`, `a<N>/all_left` | ADD per pod on exit, then the last one | the store host may close the store |
//!
//! Every wait is bounded. Attempts never share keys or worker stores, so no
//! worker of attempt N+1 can read attempt N's data.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::store::{Client, ClientError, Endpoint, connect_with_retry};
use crate::supervise::policy::JobEnd;
use crate::supervise::report::Failure;

/// Errors of the rendezvous.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Could not reach the store before the deadline.
    #[error("rendezvous store not reachable")]
    Unreachable(#[source] ClientError),
    /// The store connection broke during the job.
    #[error("lost the connection to the rendezvous store at {endpoint}")]
    Lost {
        /// The store.
        endpoint: Endpoint,
        /// What failed.
        #[source]
        source: ClientError,
    },
    /// Some pods never joined.
    #[error("timed out after {waited:?} waiting for node ranks {missing:?} to join attempt {attempt} at {endpoint}")]
    Timeout {
        /// How long we waited.
        waited: Duration,
        /// Node ranks that did not show up.
        missing: Vec<u32>,
        /// Restart attempt.
        attempt: u32,
        /// The store.
        endpoint: Endpoint,
    },
    /// Pods disagree on the world.
    #[error("pods disagree on the job: {0}")]
    Mismatch(String),
    /// Another pod left (stopped by a signal) while the pods were meeting.
    #[error("node rank {node_rank} left the rendezvous of attempt {attempt} (stopped by {signal})")]
    PeerLeft {
        /// Who left.
        node_rank: String,
        /// The signal that stopped it.
        signal: String,
        /// Restart attempt.
        attempt: u32,
    },
    /// Two pods claim the same node rank.
    #[error("node rank {node_rank} is already held by {holder}; each pod needs its own node rank")]
    Duplicate {
        /// The contested rank.
        node_rank: u32,
        /// Who holds it.
        holder: String,
    },
}

/// What an agent announces about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Its node rank.
    pub node_rank: u32,
    /// Node count it was configured with.
    pub nnodes: u32,
    /// Workers per node it was configured with.
    pub nproc: u32,
    /// Restart budget it was configured with.
    pub max_restarts: u32,
    /// Host name or --local-addr.
    pub host: String,
    /// Agent pid.
    pub pid: u32,
}

impl NodeInfo {
    fn who(&self) -> String {
        format!("node rank {} ({} pid {})", self.node_rank, self.host, self.pid)
    }
}

/// Compare every pod's announcement with ours; name each that differs.
pub fn check_world(me: &NodeInfo, all: &[NodeInfo]) -> Result<(), Error> {
    let mut diffs = Vec::new();
    for (i, other) in all.iter().enumerate() {
        let mut d = Vec::new();
        if u32::try_from(i).ok() != Some(other.node_rank) {
            d.push(format!("announced node rank {} in slot {i}", other.node_rank));
        }
        for (what, theirs, ours) in [
            ("nnodes", other.nnodes, me.nnodes),
            ("nproc-per-node", other.nproc, me.nproc),
            ("max-restarts", other.max_restarts, me.max_restarts),
        ] {
            if theirs != ours {
                d.push(format!("{what} {theirs} vs {ours} on {}", me.who()));
            }
        }
        if !d.is_empty() {
            diffs.push(format!("{}: {}", other.who(), d.join(", ")));
        }
    }
    if diffs.is_empty() { Ok(()) } else { Err(Error::Mismatch(diffs.join("; "))) }
}

/// One agent's connection to the rendezvous.
#[derive(Debug)]
pub struct Session {
    endpoint: Endpoint,
    addr: SocketAddr,
    client: Client,
    base: String,
    me: NodeInfo,
}

impl Session {
    /// Connect (retrying until `deadline`) and claim our node rank.
    pub async fn join(
        endpoint: &Endpoint,
        run_id: &str,
        me: NodeInfo,
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Result<Self, Error> {
        let client = connect_with_retry(endpoint, deadline, cancel).await.map_err(Error::Unreachable)?;
        let addr = client_addr(&client)?;
        let mut s = Self { endpoint: endpoint.clone(), addr, client, base: format!("trainlet/{run_id}"), me };
        let token = serde_json::to_vec(&s.me).unwrap_or_default();
        let key = format!("{}/claim/{}", s.base, s.me.node_rank);
        let held = s.client.compare_set(&key, b"", &token).await.map_err(|e| s.lost(e))?;
        if held != token {
            let holder = serde_json::from_slice::<NodeInfo>(&held).map_or_else(|_| "another pod".into(), |o| o.who());
            return Err(Error::Duplicate { node_rank: s.me.node_rank, holder });
        }
        Ok(s)
    }

    fn lost(&self, source: ClientError) -> Error {
        Error::Lost { endpoint: self.endpoint.clone(), source }
    }

    fn key(&self, attempt: u32, rest: &str) -> String {
        format!("{}/a{attempt}/{rest}", self.base)
    }

    /// Announce ourselves for `attempt` and wait until every pod has, then
    /// check that all agree. The store host passes its worker store port;
    /// everyone gets it back.
    pub async fn attempt(&mut self, attempt: u32, worker_port: Option<u16>, deadline: Instant) -> Result<u16, Error> {
        let info = serde_json::to_vec(&self.me).unwrap_or_default();
        let me_key = self.key(attempt, &format!("info/{}", self.me.node_rank));
        self.client.set(&me_key, &info).await.map_err(|e| self.lost(e))?;
        let port_key = self.key(attempt, "port");
        if let Some(p) = worker_port {
            self.client.set(&port_key, p.to_string().as_bytes()).await.map_err(|e| self.lost(e))?;
        }
        let info_keys: Vec<String> = (0..self.me.nnodes).map(|n| self.key(attempt, &format!("info/{n}"))).collect();
        let mut wait_keys = info_keys.clone();
        wait_keys.push(port_key.clone());
        self.wait_bounded(&wait_keys, deadline, attempt).await?;
        let values = self.client.multi_get(&info_keys).await.map_err(|e| self.lost(e))?;
        let all: Vec<NodeInfo> = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                serde_json::from_slice(v)
                    .map_err(|_| Error::Mismatch(format!("node rank {i} announced unreadable data")))
            })
            .collect::<Result<_, _>>()?;
        check_world(&self.me, &all)?;
        let port = self.client.get(&port_key).await.map_err(|e| self.lost(e))?;
        std::str::from_utf8(&port)
            .ok()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| Error::Mismatch("the store host published an unreadable worker port".into()))
    }

    /// WAIT for `keys` on a second connection, so that running out of
    /// `limit` leaves this one usable; Ok(false) on timeout.
    async fn wait_for(&self, keys: &[String], limit: Duration) -> Result<bool, Error> {
        let mut waiter = Client::connect(self.addr).await.map_err(|e| self.lost(e))?;
        match tokio::time::timeout(limit, waiter.wait(keys)).await {
            Ok(r) => r.map(|()| true).map_err(|e| self.lost(e)),
            Err(_) => Ok(false),
        }
    }

    /// WAIT on a second connection so that a timeout leaves this one usable;
    /// on timeout, name the node ranks whose info is missing.
    async fn wait_bounded(&mut self, keys: &[String], deadline: Instant, attempt: u32) -> Result<(), Error> {
        let started = Instant::now();
        // A pod stopped while we meet publishes `end`; watch it too, so that
        // nobody waits out the join deadline for a pod that is gone.
        let end = self.key(attempt, "end");
        let limit = deadline.saturating_duration_since(started);
        let joined = tokio::select! {
            joined = self.wait_for(keys, limit) => joined?,
            left = self.wait_for(std::slice::from_ref(&end), limit) => {
                if left? {
                    let v = self.client.get(&end).await.map_err(|e| self.lost(e))?;
                    let v = String::from_utf8_lossy(&v);
                    let mut parts = v.strip_prefix("abort:").unwrap_or(&v).splitn(2, ':');
                    let node_rank = parts.next().unwrap_or("?").to_string();
                    let signal = parts.next().and_then(|s| s.parse().ok()).map_or_else(|| "a signal".into(), crate::sys::signal_name);
                    return Err(Error::PeerLeft { node_rank, signal, attempt });
                }
                false
            }
        };
        if joined {
            return Ok(());
        }
        let mut missing = Vec::new();
        for n in 0..self.me.nnodes {
            let k = self.key(attempt, &format!("info/{n}"));
            if !self.client.check(&[k]).await.map_err(|e| self.lost(e))? {
                missing.push(n);
            }
        }
        Err(Error::Timeout { waited: started.elapsed(), missing, attempt, endpoint: self.endpoint.clone() })
    }

    async fn end(&mut self, attempt: u32, value: &str) -> Result<(), Error> {
        let key = self.key(attempt, "end");
        self.client.compare_set(&key, b"", value.as_bytes()).await.map_err(|e| self.lost(e))?;
        Ok(())
    }

    /// A worker failed here: end the attempt as failed (first writer wins).
    pub async fn publish_failure(&mut self, attempt: u32) -> Result<(), Error> {
        self.end(attempt, "failure").await
    }

    /// This agent is leaving because of `signal`.
    pub async fn publish_abort(&mut self, attempt: u32, signal: i32) -> Result<(), Error> {
        let v = format!("abort:{}:{signal}", self.me.node_rank);
        self.end(attempt, &v).await
    }

    /// Every worker here exited 0; the last pod to say so ends the attempt.
    pub async fn publish_local_done(&mut self, attempt: u32) -> Result<(), Error> {
        let key = self.key(attempt, "done");
        let n = self.client.add(&key, 1).await.map_err(|e| self.lost(e))?;
        if n >= i64::from(self.me.nnodes) {
            self.end(attempt, "success").await?;
        }
        Ok(())
    }

    /// A future that resolves when the attempt's end is published, on its
    /// own connection. A broken connection reads as [`JobEnd::Lost`].
    pub fn watch_end(&self, attempt: u32) -> impl std::future::Future<Output = JobEnd> + Send + 'static {
        let addr = self.addr;
        let key = self.key(attempt, "end");
        async move {
            let run = async {
                let mut c = Client::connect(addr).await?;
                c.wait(std::slice::from_ref(&key)).await?;
                c.get(&key).await
            };
            match run.await {
                Ok(v) if v == b"success" => JobEnd::Success,
                Ok(v) if v == b"failure" => JobEnd::Failure,
                Ok(_) => JobEnd::Abort,
                Err(_) => JobEnd::Lost,
            }
        }
    }

    /// Record our failures and that our workers are gone; the last pod
    /// marks the attempt fully stopped.
    pub async fn report_stopped(&mut self, attempt: u32, failures: &[Failure]) -> Result<(), Error> {
        let key = self.key(attempt, &format!("failures/{}", self.me.node_rank));
        let v = serde_json::to_vec(failures).unwrap_or_default();
        self.client.set(&key, &v).await.map_err(|e| self.lost(e))?;
        let n = self.client.add(&self.key(attempt, "stopped"), 1).await.map_err(|e| self.lost(e))?;
        if n >= i64::from(self.me.nnodes) {
            let k = self.key(attempt, "all_stopped");
            self.client.set(&k, b"1").await.map_err(|e| self.lost(e))?;
        }
        Ok(())
    }

    /// Wait up to `limit` until every pod reported stopped; false on timeout.
    pub async fn wait_all_stopped(&mut self, attempt: u32, limit: Duration) -> Result<bool, Error> {
        self.wait_for(&[self.key(attempt, "all_stopped")], limit).await
    }

    /// Every pod's failures for `attempt` (pods that did not report count as none).
    pub async fn failures(&mut self, attempt: u32) -> Result<Vec<Failure>, Error> {
        let keys: Vec<String> = (0..self.me.nnodes).map(|n| self.key(attempt, &format!("failures/{n}"))).collect();
        let values = self.client.multi_get(&keys).await.map_err(|e| self.lost(e))?;
        Ok(values.iter().flat_map(|v| serde_json::from_slice::<Vec<Failure>>(v).unwrap_or_default()).collect())
    }

    /// Say we are done reading this attempt's results. The store host then
    /// waits (up to `limit`) for every pod to say so before its store goes
    /// away, so nobody loses the store in the middle of reading the outcome.
    pub async fn leave(&mut self, attempt: u32, host: bool, limit: Duration) -> Result<(), Error> {
        let n = self.client.add(&self.key(attempt, "left"), 1).await.map_err(|e| self.lost(e))?;
        let all = self.key(attempt, "all_left");
        if n >= i64::from(self.me.nnodes) {
            self.client.set(&all, b"1").await.map_err(|e| self.lost(e))?;
        }
        if host && !self.wait_for(&[all], limit).await? {
            tracing::warn!(attempt, "not every pod confirmed the end of the job; closing the store anyway");
        }
        Ok(())
    }

    /// The store's address as resolved.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn client_addr(c: &Client) -> Result<SocketAddr, Error> {
    c.peer_addr().map_err(|e| Error::Unreachable(ClientError::Io(e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(node_rank: u32, nproc: u32) -> NodeInfo {
        NodeInfo { node_rank, nnodes: 2, nproc, max_restarts: 0, host: format!("pod-{node_rank}"), pid: 7 }
    }

    #[test]
    fn agreeing_pods_pass() {
        assert!(check_world(&info(0, 2), &[info(0, 2), info(1, 2)]).is_ok());
    }

    #[test]
    fn a_mismatch_names_the_pod_and_setting() {
        let err = check_world(&info(0, 2), &[info(0, 2), info(1, 4)]).expect_err("mismatch").to_string();
        assert!(err.contains("node rank 1 (pod-1 pid 7): nproc-per-node 4 vs 2 on node rank 0 (pod-0 pid 7)"), "{err}");
    }
}
