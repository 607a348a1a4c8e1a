//! Serve mode: pods that stay up between runs, and the control API on the
//! store host that submits, watches and stops them.
//!
//! The store host's control API ([`api`]) checks a submission ([`spec`]),
//! puts its files into the agents' store by content ([`files`]) and
//! publishes the run; every pod's agent (the host's too) reads it at the
//! start of a round, unpacks the files into a fresh directory and runs it
//! as a job of its own (`pod`). Worker lines travel back
//! through the store ([`logs`]); the host's [`board::Board`] keeps each
//! run's state, exits and failure report.
//!
//! Keys, under the job's prefix: [`crate::keys::serve`].
//!
//! A run is stopped (`DELETE`, or replaced) by ending the round it runs
//! in with `stop:<seq>`: every pod stops its workers as for a planned
//! regroup (checkpoint signal, grace), and the next round finds it ended.
//!
//! # Trust
//! The agents' store asks every connection for the control token
//! (`crate::store::Guard`): nothing without it reads a run's command, env,
//! files or lines, or writes, deletes or fills anything. On top of that,
//! whatever makes a pod act is sealed (HMAC-SHA256 under the token) for
//! one [`Scope`] (this job's key prefix and this serving session's random
//! id), one kind and one sequence number: a copy from another job sharing
//! the token, from an earlier session (a replaced store host) or for
//! another run is refused. Numbers read from the store (chunk and slot
//! counts) are bounded before use, and a write the store refuses fails
//! the request that needed it.

pub mod actor;
pub mod api;
pub mod board;
pub mod bounded;
pub mod cache;
pub mod files;
pub mod intake;
pub mod lane;
pub mod logs;
pub mod manifest;
pub mod paths;
pub(crate) mod pod;
pub mod setup;
pub mod spec;
pub mod stacks_on_demand;
pub mod tar;

use std::time::Duration;

use crate::keys::serve::ServeKeys as Keys;
use crate::store::{Client, ClientError, Dial};

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
    /// `run`: run `seq` is in `serve/run` (a wake-up only: the run itself is sealed).
    Run,
    /// `lane`: run `seq` runs in a lane of its own (`lane`): the main run's
    /// next go signal is a later one (a wake-up only).
    Lane,
    /// The pods exit 0 (idle timeout): `shutdown`, [`seal`]ed for `seq`.
    Shutdown,
    /// Something else: not the control API's.
    Forged,
}

/// What a seal is bound to: the job and the serving session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// The job's key prefix (`crate::rendezvous::job_base`).
    pub job: String,
    /// The serving session: a random id the control API draws at start
    /// ("" for the session record itself).
    pub session: String,
}

/// The kinds of sealed values.
pub mod kind {
    /// `serve/session`.
    pub const SESSION: &str = "session";
    /// `serve/run`.
    pub const RUN: &str = "run";
    /// A shutdown in `serve/go/<seq>`.
    pub const SHUTDOWN: &str = "shutdown";
    /// `serve/ended/<seq>`.
    pub const ENDED: &str = "ended";
    /// `serve/setup`.
    pub const SETUP: &str = "setup";
    /// `serve/lanes`.
    pub const LANES: &str = "lanes";
}

/// Most bytes of a session id read from the store.
const MAX_SESSION: usize = 64;

/// A store connection of serve mode that reconnects after a failure.
#[derive(Debug)]
pub struct Link {
    dial: Dial,
    client: Option<Client>,
    /// The job's serve keys.
    pub keys: Keys,
    /// The job's key prefix.
    pub job: String,
}

impl Link {
    /// A link to the store at `dial` for the job under `base` (connects on first use).
    pub fn new(dial: Dial, base: &str) -> Self {
        Self { dial, client: None, keys: Keys::new(base), job: base.to_string() }
    }

    /// A link of lane `seq`'s agent: its run is the lane's.
    pub fn for_lane(dial: Dial, base: &str, seq: u64) -> Self {
        Self { keys: Keys::for_lane(base, seq), ..Self::new(dial, base) }
    }

    /// The connected client, connecting first if needed.
    pub async fn client(&mut self) -> Result<&mut Client, Error> {
        if self.client.is_none() {
            let c = tokio::time::timeout(STORE_WAIT, self.dial.connect())
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

    /// GET (empty when missing). A connection that broke since its last
    /// use (the store host was replaced) is dialled again once.
    pub async fn get(&mut self, key: &str) -> Result<Vec<u8>, Error> {
        let stale = self.client.is_some();
        let r = bounded(self.client().await?.get(key)).await;
        match self.kept(r) {
            Err(Error::Store(ClientError::Io(_))) if stale => {
                let r = bounded(self.client().await?.get(key)).await;
                self.kept(r)
            }
            r => r,
        }
    }

    /// SET, known to be stored (an error when the store refused it: its budget).
    pub async fn set(&mut self, key: &str, value: &[u8]) -> Result<(), Error> {
        let r = bounded(self.client().await?.set_checked(key, value)).await;
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

    /// This serving session's scope, once the control API published it;
    /// Err(why) inside when the record is not the control API's.
    pub async fn scope(&mut self, token: &str) -> Result<Option<Result<Scope, String>>, Error> {
        let raw = self.get(&self.keys.session()).await?;
        if raw.is_empty() {
            return Ok(None);
        }
        let outer = Scope { job: self.job.clone(), session: String::new() };
        Ok(Some(match unseal(token, &outer, kind::SESSION, 0, &raw) {
            Ok(id) if !id.is_empty() && id.len() <= MAX_SESSION && id.iter().all(u8::is_ascii_hexdigit) => {
                Ok(Scope { job: self.job.clone(), session: String::from_utf8_lossy(id).into_owned() })
            }
            Ok(_) => Err("the session record is not a session id".to_string()),
            Err(why) => Err(format!("the session record: {why}")),
        }))
    }

    /// Publish a new serving session (the control API, at start); its scope.
    pub async fn new_session(&mut self, token: &str) -> Result<Scope, Error> {
        let id = format!("{:016x}{:016x}", crate::sys::random_u64(), crate::sys::random_u64());
        let outer = Scope { job: self.job.clone(), session: String::new() };
        self.set(&self.keys.session(), &seal(token, &outer, kind::SESSION, 0, id.as_bytes())).await?;
        Ok(Scope { job: self.job.clone(), session: id })
    }

    /// The newest run, if one was published: Err(why) inside when it is
    /// not sealed with `token` for `scope` (written by something other
    /// than this job's control API in this session).
    pub async fn newest(&mut self, token: &str, scope: &Scope) -> Result<Option<Result<spec::Run, String>>, Error> {
        let raw = self.get(&self.keys.run()).await?;
        if raw.is_empty() {
            return Ok(None);
        }
        Ok(Some(open(token, scope, &raw)))
    }

    /// The setup steps, if any were declared: Err(why) inside when they
    /// are not sealed with `token` for `scope`.
    pub async fn setup(
        &mut self,
        token: &str,
        scope: &Scope,
    ) -> Result<Option<Result<Vec<setup::Step>, String>>, Error> {
        let raw = self.get(&self.keys.setup()).await?;
        if raw.is_empty() {
            return Ok(None);
        }
        Ok(Some(
            unseal(token, scope, kind::SETUP, 0, &raw)
                .map_err(|why| format!("the setup steps: {why}"))
                .and_then(|v| serde_json::from_slice(v).map_err(|e| format!("the setup steps: {e}"))),
        ))
    }

    /// How run `seq` (`id`) ended, if it did; Err(why) inside when the
    /// marker is not sealed for it (a forgery: the run is not over).
    pub async fn ended(
        &mut self,
        token: &str,
        scope: &Scope,
        seq: u64,
        id: &str,
    ) -> Result<Option<Result<String, String>>, Error> {
        let raw = self.get(&self.keys.ended(seq)).await?;
        if raw.is_empty() {
            return Ok(None);
        }
        Ok(Some(match unseal(token, scope, kind::ENDED, seq, &raw) {
            Ok(v) => match std::str::from_utf8(v).ok().and_then(|v| v.split_once(' ')) {
                Some((who, state)) if who == id => Ok(state.to_string()),
                _ => Err(format!("the end marker of run {seq} is another run's")),
            },
            Err(why) => Err(format!("the end marker of run {seq}: {why}")),
        }))
    }

    /// Mark run `seq` (`id`) over (`state`: succeeded, failed or stopped);
    /// the first marker stays: false when one was there already.
    /// A marker that is not sealed for this run is overwritten.
    pub async fn set_ended(
        &mut self,
        token: &str,
        scope: &Scope,
        seq: u64,
        id: &str,
        state: &str,
    ) -> Result<bool, Error> {
        // A marker already there (a stop's is the same bytes as another
        // stop's, so the compare-and-set alone cannot tell).
        if round::stop::over_already(matches!(self.ended(token, scope, seq, id).await?, Some(Ok(_)))) {
            return Ok(false);
        }
        let value = seal(token, scope, kind::ENDED, seq, format!("{id} {state}").as_bytes());
        let key = self.keys.ended(seq);
        if self.compare_set(&key, b"", &value).await? != value {
            // Another writer came in between: its marker stays when it is valid.
            if matches!(self.ended(token, scope, seq, id).await?, Some(Ok(_))) {
                return Ok(false);
            }
            self.set(&key, &value).await?;
        }
        Ok(true)
    }
}

/// What a seal covers: the scope, the kind, the sequence number, the payload.
fn sealed_message(scope: &Scope, kind: &str, seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut m = format!("trainlet serve v2\n{}\n{}\n{kind}\n{seq}\n", scope.job, scope.session).into_bytes();
    m.extend_from_slice(payload);
    m
}

/// A value as stored: the hex HMAC-SHA256, under the control token, of
/// the payload bound to `scope`, `kind` and `seq`; a newline; the payload.
pub fn seal(token: &str, scope: &Scope, kind: &str, seq: u64, payload: &[u8]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    let tag = ring::hmac::sign(&key, &sealed_message(scope, kind, seq, payload));
    let mut out = data_encoding::HEXLOWER.encode(tag.as_ref()).into_bytes();
    out.push(b'\n');
    out.extend_from_slice(payload);
    out
}

/// The payload of `value` when it was [`seal`]ed with `token` for exactly
/// this scope, kind and seq; or why not.
pub fn unseal<'a>(token: &str, scope: &Scope, kind: &str, seq: u64, value: &'a [u8]) -> Result<&'a [u8], &'static str> {
    let i = value.iter().take(65).position(|b| *b == b'\n').ok_or("not signed")?;
    let tag = data_encoding::HEXLOWER.decode(&value[..i]).map_err(|_| "not signed")?;
    let payload = &value[i + 1..];
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
    ring::hmac::verify(&key, &sealed_message(scope, kind, seq, payload), &tag)
        .map_err(|_| "its signature is not the control token's for this job, session and sequence number")?;
    Ok(payload)
}

/// The run in a value [`seal`]ed with `token` for `scope`, or why it is refused.
pub fn open(token: &str, scope: &Scope, value: &[u8]) -> Result<spec::Run, String> {
    serde_json::from_slice(unseal(token, scope, kind::RUN, 0, value)?).map_err(|e| format!("not a run: {e}"))
}

/// A random token in `dir/control-token` (mode 0600), for a control API
/// started without `--control-token-file`.
pub fn make_token(dir: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir)?;
    let path = dir.join("control-token");
    let token = format!("{:016x}{:016x}", crate::sys::random_u64(), crate::sys::random_u64());
    let _ = std::fs::remove_file(&path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
    f.write_all(token.as_bytes())?;
    Ok(path)
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

/// Wait until `key` is set, on a connection of its own (WAIT blocks it;
/// dropping the future drops the connection); its value.
pub async fn wait_key(dial: &Dial, key: &str) -> Result<Vec<u8>, Error> {
    let mut c = dial.connect().await?;
    c.wait(&[key.to_string()]).await?;
    Ok(c.get(key).await?)
}

/// Wait until `serve/go/<seq>` is set; what it says.
pub async fn wait_go(dial: &Dial, keys: &Keys, seq: u64, token: &str, scope: &Scope) -> Result<Go, Error> {
    let value = wait_key(dial, &keys.go(seq)).await?;
    Ok(if value == b"run" {
        Go::Run
    } else if value == b"lane" {
        Go::Lane
    } else if unseal(token, scope, kind::SHUTDOWN, seq, &value) == Ok(b"shutdown".as_slice()) {
        Go::Shutdown
    } else {
        Go::Forged
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_runs_sealed_with_the_token_for_this_job_and_session_open() {
        let run = spec::Run {
            id: "run-1-a".into(),
            seq: 1,
            command: vec!["python".into()],
            env: Vec::new(),
            nproc: None,
            max_restarts: 0,
            base_restarts: 0,
            files: Vec::new(),
            actor: None,
            first_slot: 0,
            lane: false,
        };
        let scope = Scope { job: "trainlet/none/j0".into(), session: "ab12".into() };
        let json = serde_json::to_vec(&run).expect("json");
        let sealed = seal("s3cret", &scope, kind::RUN, 0, &json);
        assert_eq!(open("s3cret", &scope, &sealed), Ok(run));
        assert!(open("other", &scope, &sealed).is_err_and(|e| e.contains("not the control token's")));
        assert!(open("s3cret", &scope, &json).is_err(), "an unsigned run is refused");
        let other_job = Scope { job: "trainlet/x/j0".into(), ..scope.clone() };
        let other_session = Scope { session: "cd34".into(), ..scope.clone() };
        assert!(open("s3cret", &other_job, &sealed).is_err(), "another job's run is refused");
        assert!(open("s3cret", &other_session, &sealed).is_err(), "an earlier session's run is refused");
        let mut forged = sealed.clone();
        let n = forged.len();
        forged[n - 2] ^= 1;
        assert!(open("s3cret", &scope, &forged).is_err(), "a changed run is refused");
        let stop = seal("s3cret", &scope, kind::SHUTDOWN, 3, b"shutdown");
        assert_eq!(unseal("s3cret", &scope, kind::SHUTDOWN, 3, &stop), Ok(b"shutdown".as_slice()));
        assert!(unseal("s3cret", &scope, kind::SHUTDOWN, 4, &stop).is_err(), "another sequence number");
        assert!(unseal("s3cret", &scope, kind::ENDED, 3, &stop).is_err(), "another kind");
    }
}
