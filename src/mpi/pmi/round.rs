//! One round's PMI service on this pod ([`Link`]): a socket pair per
//! local rank (the rank's end becomes its `PMI_FD`, fd 3), the server on
//! a task of its own, and the notes it sends the supervisor. Dropping the
//! link stops the server: a new round gets a new key-value space.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::fence::StoreFence;
use super::node::{Node, WorldInfo};
use super::server::{Note, serve};

/// The descriptor number a rank finds its PMI socket at (`PMI_FD`).
pub const RANK_FD: i32 = 3;

/// One round's PMI service on this pod.
#[derive(Debug)]
pub struct Link {
    /// Each local rank's end, until its spawn takes it.
    fds: Mutex<Vec<Option<Arc<OwnedFd>>>>,
    /// What the server tells, until the attempt takes it.
    notes: Mutex<Option<mpsc::UnboundedReceiver<Note>>>,
    /// The server's task.
    task: tokio::task::AbortHandle,
    /// The key-value space's name, for the log.
    kvsname: String,
}

impl Link {
    /// Start serving `job` (its `local` ranks) with `fence` for the job-wide
    /// part. Fails only when the sockets cannot be made (out of descriptors).
    pub fn start(job: WorldInfo, fence: StoreFence) -> std::io::Result<Link> {
        let mut fds = Vec::with_capacity(job.local);
        let mut servers = Vec::with_capacity(job.local);
        for _ in 0..job.local {
            // Both ends close on exec; the spawner gives the rank its end as fd 3.
            let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
            ours.set_nonblocking(true)?;
            servers.push(tokio::net::UnixStream::from_std(ours)?);
            fds.push(Some(Arc::new(OwnedFd::from(theirs))));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let kvsname = job.kvsname.clone();
        let task = tokio::spawn(async move {
            // The sockets stay open until the link is dropped, after the
            // round's ranks are gone (`server::Held`).
            let _held = serve(Node::new(job), servers, fence, tx).await;
            std::future::pending::<()>().await;
        })
        .abort_handle();
        Ok(Link { fds: Mutex::new(fds), notes: Mutex::new(Some(rx)), task, kvsname })
    }

    /// Local rank `local`'s end, taken: the agent keeps no copy once the
    /// rank is spawned, so the rank's exit closes it.
    pub fn take_fd(&self, local: u32) -> Option<Arc<OwnedFd>> {
        let mut fds = self.fds.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        fds.get_mut(local as usize).and_then(Option::take)
    }

    /// The server's notes, taken once (by the round's attempt).
    pub fn take_notes(&self) -> Option<mpsc::UnboundedReceiver<Note>> {
        self.notes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }

    /// The key-value space's name (PMI-1 kvsname, PMI-2 jobid).
    pub fn kvsname(&self) -> &str {
        &self.kvsname
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A kvsname for run `run_id`, round `round`: the run id's letters,
/// digits, `-` and `_` (MPICH builds names of shared-memory segments from
/// it), at most 200 of them.
pub fn kvsname(run_id: &str, round: u64) -> String {
    let clean: String =
        run_id.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_').take(200).collect();
    format!("trainlet-{clean}-{round}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvsnames_keep_only_safe_characters() {
        assert_eq!(kvsname("job-1", 3), "trainlet-job-1-3");
        assert_eq!(kvsname("a b;c=d/e", 0), "trainlet-abcde-0");
        assert!(kvsname(&"x".repeat(1000), 1).len() <= super::super::node::KVSNAME_MAX);
    }
}
