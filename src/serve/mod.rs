//! Serve mode: pods that stay up between runs, and the control API on the
//! store host that submits, watches and stops them.
//!
//! The store host's control API ([`api`]) checks a submission ([`spec`]),
//! puts its files into the agents' store by content ([`files`]) and
//! publishes the run; every pod's agent (the host's too) reads it at the
//! start of a round, unpacks the files into a fresh directory and runs it
//! as a job of its own (`crate::launch::serve`). Worker lines travel back
//! through the store ([`logs`]); the host's [`board::Board`] keeps each
//! run's state, exits and failure report.
//!
//! Keys, under the job's prefix (`crate::rendezvous::job_base`):
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `serve/run` | the control API | the newest run ([`spec::Run`], JSON, [`seal`]ed with the control token) |
//! | `serve/go/<seq>` | the control API | `run`: run `seq` is published (a wake-up); `shutdown <seq>`, sealed: the pods exit 0 |
//! | `serve/ended/<seq>` | the control API, the store host's agent | run `seq` is over (`succeeded`, `failed`, `stopped`) |
//! | `serve/blob/<sha256>/<i>` | the control API | a file's content in 4 MiB chunks |
//! | `serve/log/<seq>/n` | ADD per shipping agent | its slot |
//! | `serve/log/<seq>/<slot>/n`, `.../<i>` | that agent | chunks of its workers' lines, and how many |
//!
//! A run is stopped (`DELETE`, or replaced) by ending the round it runs
//! in with `stop:<seq>`: every pod stops its workers as for a planned
//! regroup (checkpoint signal, grace), and the next round finds it ended.

pub mod api;
pub mod board;
pub mod files;
pub mod logs;
pub mod spec;
pub mod tar;

use std::net::SocketAddr;
use std::time::Duration;

use crate::store::{Client, ClientError};

/// Why a serve-mode store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store connection failed.
    #[error("the agents' store")]
    Store(#[from] ClientError),
    /// A value in the store is not what trainlet wrote.
    #[error("{0}")]
    Corrupt(String),
    /// A local file or directory could not be made.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Bound on one store round trip of serve mode.
pub const STORE_WAIT: Duration = Duration::from_secs(30);

/// What `serve/go/<seq>` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Go {
    /// `run`: run `seq` is in `serve/run` (a wake-up only: the run itself is signed).
    Run,
    /// The pods exit 0 (idle timeout), [`seal`]ed `shutdown <seq>`.
    Shutdown,
    /// Something else: not the control API's.
    Forged,
}

/// The store keys of serve mode under one job prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    base: String,
}

impl Keys {
    /// Keys under `base` (the job's prefix).
    pub fn new(base: &str) -> Self {
        Self { base: format!("{base}/serve") }
    }

    /// The newest run.
    pub fn run(&self) -> String {
        format!("{}/run", self.base)
    }

    /// The go signal of run `seq`.
    pub fn go(&self, seq: u64) -> String {
        format!("{}/go/{seq}", self.base)
    }

    /// Run `seq` is over.
    pub fn ended(&self, seq: u64) -> String {
        format!("{}/ended/{seq}", self.base)
    }

    /// Chunk `i` of a blob.
    pub fn blob(&self, sha256: &str, i: u64) -> String {
        format!("{}/blob/{sha256}/{i}", self.base)
    }

    /// The slot counter of run `seq`'s log shippers.
    pub fn log_slots(&self, seq: u64) -> String {
        format!("{}/log/{seq}/n", self.base)
    }

    /// The chunk count of shipper `slot` in run `seq`.
    pub fn log_count(&self, seq: u64, slot: i64) -> String {
        format!("{}/log/{seq}/{slot}/n", self.base)
    }

    /// Chunk `i` of shipper `slot` in run `seq`.
    pub fn log_chunk(&self, seq: u64, slot: i64, i: i64) -> String {
        format!("{}/log/{seq}/{slot}/{i}", self.base)
    }
}

/// A store connection of serve mode that reconnects after a failure.
#[derive(Debug)]
pub struct Link {
    addr: SocketAddr,
    client: Option<Client>,
    /// The job's serve keys.
    pub keys: Keys,
}

impl Link {
    /// A link to the store at `addr` for the job under `base` (connects on first use).
    pub fn new(addr: SocketAddr, base: &str) -> Self {
        Self { addr, client: None, keys: Keys::new(base) }
    }

    /// The connected client, connecting first if needed.
    pub async fn client(&mut self) -> Result<&mut Client, Error> {
        if self.client.is_none() {
            let c = tokio::time::timeout(STORE_WAIT, Client::connect(self.addr))
                .await
                .map_err(|_| ClientError::Io(std::io::ErrorKind::TimedOut.into()))??;
            self.client = Some(c);
        }
        self.client.as_mut().ok_or_else(|| Error::Corrupt("no store client".into()))
    }

    /// Keep the connection after `r` only if it succeeded.
    fn kept<T>(&mut self, r: Result<T, ClientError>) -> Result<T, Error> {
        if r.is_err() {
            self.client = None;
        }
        r.map_err(Error::from)
    }

    /// GET (empty when missing).
    pub async fn get(&mut self, key: &str) -> Result<Vec<u8>, Error> {
        let r = bounded(self.client().await?.get(key)).await;
        self.kept(r)
    }

    /// SET.
    pub async fn set(&mut self, key: &str, value: &[u8]) -> Result<(), Error> {
        let r = bounded(self.client().await?.set(key, value)).await;
        self.kept(r)
    }

    /// ADD; the new value.
    pub async fn add(&mut self, key: &str, delta: i64) -> Result<i64, Error> {
        let r = bounded(self.client().await?.add(key, delta)).await;
        self.kept(r)
    }

    /// COMPARE_SET; what the key holds afterwards.
    pub async fn compare_set(&mut self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, Error> {
        let r = bounded(self.client().await?.compare_set(key, expected, desired)).await;
        self.kept(r)
    }

    /// DELETE_KEY.
    pub async fn delete(&mut self, key: &str) -> Result<bool, Error> {
        let r = bounded(self.client().await?.delete_key(key)).await;
        self.kept(r)
    }

    /// CHECK one key.
    pub async fn exists(&mut self, key: &str) -> Result<bool, Error> {
        let r = bounded(self.client().await?.check(&[key.to_string()])).await;
        self.kept(r)
    }

    /// The newest run, if one was published: Err(why) inside when it is
    /// not signed with `token` (written by something other than the control API).
    pub async fn newest(&mut self, token: &str) -> Result<Option<Result<spec::Run, String>>, Error> {
        let raw = self.get(&self.keys.run()).await?;
        if raw.is_empty() {
            return Ok(None);
        }
        Ok(Some(open(token, &raw)))
    }

    /// Is run `seq` over?
    pub async fn is_ended(&mut self, seq: u64) -> Result<bool, Error> {
        Ok(!self.get(&self.keys.ended(seq)).await?.is_empty())
    }

    /// Mark run `seq` over (`state`: succeeded, failed or stopped).
    pub async fn set_ended(&mut self, seq: u64, state: &str) -> Result<(), Error> {
        self.compare_set(&self.keys.ended(seq), b"", state.as_bytes()).await.map(|_| ())
    }
}

/// A run as stored: the hex HMAC-SHA256 of its JSON under the control
/// token, a newline, the JSON. The store is open to anything that reaches
/// its port (as torch's is); the signature keeps a store writer from
/// running a command on every pod, which only the token's holder may.
pub fn seal(token: &str, run_json: &[u8]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    let tag = ring::hmac::sign(&key, run_json);
    let mut out = data_encoding::HEXLOWER.encode(tag.as_ref()).into_bytes();
    out.push(b'\n');
    out.extend_from_slice(run_json);
    out
}

/// What `value` holds when it was [`seal`]ed with `token`, or why not.
pub fn unseal<'a>(token: &str, value: &'a [u8]) -> Result<&'a [u8], &'static str> {
    let i = value.iter().position(|b| *b == b'\n').ok_or("not signed")?;
    let tag = data_encoding::HEXLOWER.decode(&value[..i]).map_err(|_| "not signed")?;
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    ring::hmac::verify(&key, &value[i + 1..], &tag).map_err(|_| "its signature does not match the control token")?;
    Ok(&value[i + 1..])
}

/// The run in a value [`seal`]ed with `token`, or why it is refused.
pub fn open(token: &str, value: &[u8]) -> Result<spec::Run, String> {
    serde_json::from_slice(unseal(token, value)?).map_err(|e| format!("not a run: {e}"))
}

/// The token in `file` (trimmed; an empty file is an error).
pub fn read_token(file: &std::path::Path) -> std::io::Result<String> {
    let t = std::fs::read_to_string(file)?.trim().to_string();
    if t.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "the token file is empty"));
    }
    Ok(t)
}

/// `f`, bounded by [`STORE_WAIT`].
async fn bounded<T>(f: impl Future<Output = Result<T, ClientError>>) -> Result<T, ClientError> {
    tokio::time::timeout(STORE_WAIT, f)
        .await
        .unwrap_or_else(|_| Err(ClientError::Io(std::io::ErrorKind::TimedOut.into())))
}

/// Wait until `serve/go/<seq>` is set, on a connection of its own (WAIT
/// blocks it; dropping the future drops the connection); what it says.
pub async fn wait_go(addr: SocketAddr, keys: Keys, seq: u64, token: &str) -> Result<Go, Error> {
    let mut c = Client::connect(addr).await?;
    let key = keys.go(seq);
    c.wait(std::slice::from_ref(&key)).await?;
    let value = c.get(&key).await?;
    Ok(if value == b"run" {
        Go::Run
    } else if unseal(token, &value) == Ok(shutdown_word(seq).as_bytes()) {
        Go::Shutdown
    } else {
        Go::Forged
    })
}

/// What the control API seals into `serve/go/<seq>` to end the job.
pub fn shutdown_word(seq: u64) -> String {
    format!("shutdown {seq}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_runs_sealed_with_the_token_open() {
        let run = spec::Run {
            id: "run-1-a".into(),
            seq: 1,
            command: vec!["python".into()],
            env: Vec::new(),
            nproc: None,
            max_restarts: 0,
            base_restarts: 0,
            files: Vec::new(),
        };
        let json = serde_json::to_vec(&run).expect("json");
        let sealed = seal("s3cret", &json);
        assert_eq!(open("s3cret", &sealed), Ok(run));
        assert!(open("other", &sealed).is_err_and(|e| e.contains("does not match")));
        assert!(open("s3cret", &json).is_err(), "an unsigned run is refused");
        let mut forged = sealed.clone();
        let n = forged.len();
        forged[n - 2] ^= 1;
        assert!(open("s3cret", &forged).is_err(), "a changed run is refused");
    }
}
