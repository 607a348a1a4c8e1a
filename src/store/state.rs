//! Keys, queues and parked waiters of one store, with libuv semantics.
//!
//! A connection that sends WAIT (or BARRIER) on missing keys is parked: it
//! gets a counter of keys still missing and is listed under each of them.
//! Every write of a listed key (SET, ADD, APPEND, MULTI_SET, COMPARE_SET in
//! any branch, as libuv does) decrements the counters of its waiters; at zero
//! the waiter's channel receives STOP_WAITING. QUEUE_PUSH wakes one waiter.
//! Registrations carry a sequence number so that entries left behind by a
//! CANCEL_WAIT or a closed connection are skipped instead of waking the
//! wrong wait. The lock is never held across I/O.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use tokio::sync::mpsc::UnboundedSender;

#[cfg(test)]
use super::wire::put_u64;
use super::wire::{Command, put_bytes, put_i64};

/// Identifies one connection inside a [`State`].
pub type ConnId = u64;

/// STOP_WAITING, the reply that ends a WAIT or BARRIER.
pub const STOP_WAITING: u8 = 0;
/// WAIT_CANCELED, the reply to CANCEL_WAIT.
pub const WAIT_CANCELED: u8 = 1;

/// Why a command closes its connection (torch's server throws and closes).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// ADD on a value that is not an ASCII decimal integer.
    #[error("ADD on a key whose value is not a decimal integer")]
    NotANumber,
    /// ADD or BARRIER beyond `i64`.
    #[error("counter overflow")]
    Overflow,
    /// VALIDATE after the handshake or with the wrong magic.
    #[error("unexpected VALIDATE")]
    Validate,
}

#[derive(Debug)]
struct Parked {
    seq: u64,
    missing: usize,
}

#[derive(Debug)]
struct Conn {
    wake: UnboundedSender<u8>,
    parked: Option<Parked>,
    next_seq: u64,
}

#[derive(Debug, Default)]
struct Inner {
    kv: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    waiters: HashMap<Vec<u8>, Vec<(ConnId, u64)>>,
    conns: HashMap<ConnId, Conn>,
    next_conn: ConnId,
}

/// The whole content of one store. Cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub struct State {
    inner: Mutex<Inner>,
}

impl Inner {
    fn present(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Count one write of `key` against every connection parked on it.
    fn wake_all(&mut self, key: &[u8]) {
        let Some(list) = self.waiters.remove(key) else { return };
        for (conn, seq) in list {
            self.decrement(conn, seq);
        }
    }

    /// Count one write of `key` against the first live waiter only.
    fn wake_one(&mut self, key: &[u8]) {
        let Some(list) = self.waiters.get_mut(key) else { return };
        while !list.is_empty() {
            let (conn, seq) = list.remove(0);
            let live = self.conns.get(&conn).and_then(|c| c.parked.as_ref()).is_some_and(|p| p.seq == seq);
            if live {
                if list.is_empty() {
                    self.waiters.remove(key);
                }
                self.decrement(conn, seq);
                return;
            }
        }
        self.waiters.remove(key);
    }

    fn decrement(&mut self, conn: ConnId, seq: u64) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let Some(p) = c.parked.as_mut().filter(|p| p.seq == seq) else { return };
        p.missing -= 1;
        if p.missing == 0 {
            c.parked = None;
            // The connection may be closing; then nobody needs the reply.
            let _ = c.wake.send(STOP_WAITING);
        }
    }

    /// Park `conn` until every key in `missing` has been written once.
    fn park(&mut self, conn: ConnId, missing: Vec<Vec<u8>>) {
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let seq = c.next_seq;
        c.next_seq += 1;
        c.parked = Some(Parked { seq, missing: missing.len() });
        for key in missing {
            self.waiters.entry(key).or_default().push((conn, seq));
        }
    }

    fn set(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.kv.insert(key.clone(), value);
        self.wake_all(&key);
    }

    fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, ExecError> {
        let current = match self.kv.get(key) {
            None => 0,
            Some(v) => {
                std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<i64>().ok()).ok_or(ExecError::NotANumber)?
            }
        };
        let next = current.checked_add(delta).ok_or(ExecError::Overflow)?;
        self.kv.insert(key.to_vec(), next.to_string().into_bytes());
        Ok(next)
    }
}

impl State {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Register a connection; wake-ups for it are sent on `wake`.
    pub fn connect(&self, wake: UnboundedSender<u8>) -> ConnId {
        let mut inner = self.lock();
        let id = inner.next_conn;
        inner.next_conn += 1;
        inner.conns.insert(id, Conn { wake, parked: None, next_seq: 0 });
        id
    }

    /// Forget a connection and its parked wait.
    pub fn disconnect(&self, conn: ConnId) {
        self.lock().conns.remove(&conn);
    }

    /// Number of keys (GETNUMKEYS).
    pub fn num_keys(&self) -> usize {
        self.lock().kv.len()
    }

    /// Number of open connections.
    pub fn connections(&self) -> usize {
        self.lock().conns.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps half-updated
        // in a way later commands could not handle, so poisoning is ignored.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Execute one command for `conn`, appending any immediate reply to
    /// `out`. A parked WAIT/BARRIER replies later through the wake channel.
    pub fn apply(&self, conn: ConnId, cmd: Command, out: &mut Vec<u8>) -> Result<(), ExecError> {
        let mut g = self.lock();
        let inner = &mut *g;
        match cmd {
            Command::Validate(_) => return Err(ExecError::Validate),
            Command::Ping(nonce) => out.extend_from_slice(&nonce.to_le_bytes()),
            Command::Set { key, value } => inner.set(key, value),
            Command::CompareSet { key, expected, desired } => {
                let reply = match inner.kv.get(&key) {
                    None if expected.is_empty() => {
                        inner.kv.insert(key.clone(), desired.clone());
                        desired
                    }
                    None => expected,
                    Some(current) if *current == expected => {
                        inner.kv.insert(key.clone(), desired.clone());
                        desired
                    }
                    Some(current) => current.clone(),
                };
                put_bytes(out, &reply);
                inner.wake_all(&key);
            }
            Command::Get(key) => put_bytes(out, inner.kv.get(&key).map_or(&[][..], Vec::as_slice)),
            Command::Add { key, delta } => {
                let n = inner.add(&key, delta)?;
                put_i64(out, n);
                inner.wake_all(&key);
            }
            Command::Check(keys) => {
                let ready = keys.iter().all(|k| inner.present(k));
                out.push(u8::from(!ready));
            }
            Command::Wait(keys) => {
                let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !inner.present(k)).collect();
                if missing.is_empty() {
                    out.push(STOP_WAITING);
                } else {
                    inner.park(conn, missing);
                }
            }
            Command::GetNumKeys => put_i64(out, i64::try_from(inner.kv.len()).unwrap_or(i64::MAX)),
            Command::DeleteKey(key) => put_i64(out, i64::from(inner.kv.remove(&key).is_some())),
            Command::Append { key, value } => {
                inner.kv.entry(key.clone()).or_default().extend_from_slice(&value);
                inner.wake_all(&key);
            }
            Command::MultiGet(keys) => {
                for k in &keys {
                    put_bytes(out, inner.kv.get(k).map_or(&[][..], Vec::as_slice));
                }
            }
            Command::MultiSet(pairs) => {
                for (k, v) in pairs {
                    inner.set(k, v);
                }
            }
            Command::CancelWait => {
                if let Some(c) = inner.conns.get_mut(&conn) {
                    c.parked = None;
                }
                out.push(WAIT_CANCELED);
            }
            Command::QueuePush { key, value } => {
                inner.queues.entry(key.clone()).or_default().push_back(value);
                inner.wake_one(&key);
            }
            Command::QueuePop(key) => {
                let q = inner.queues.get_mut(&key);
                let len = q.as_ref().map_or(0, |q| q.len());
                put_i64(out, i64::try_from(len).unwrap_or(i64::MAX));
                if let Some(value) = q.and_then(VecDeque::pop_front) {
                    put_bytes(out, &value);
                }
            }
            Command::QueueLen(key) => {
                let len = inner.queues.get(&key).map_or(0, VecDeque::len);
                put_i64(out, i64::try_from(len).unwrap_or(i64::MAX));
            }
            Command::ListKeys => {
                put_i64(out, i64::try_from(inner.kv.len()).unwrap_or(i64::MAX));
                for k in inner.kv.keys() {
                    put_bytes(out, k);
                }
            }
            Command::Barrier { key, world_size } => {
                let arrived = inner.add(&key, 1)?;
                if arrived >= world_size {
                    out.push(STOP_WAITING);
                    inner.wake_all(&key);
                } else {
                    inner.park(conn, vec![key]);
                }
            }
        }
        Ok(())
    }
}

/// Encode a list of keys the way LIST_KEYS replies (for tests and clients).
#[cfg(test)]
fn list_reply(keys: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    put_u64(&mut out, keys.len());
    for k in keys {
        put_bytes(&mut out, k);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

    fn conn(s: &State) -> (ConnId, UnboundedReceiver<u8>) {
        let (tx, rx) = unbounded_channel();
        (s.connect(tx), rx)
    }

    fn run(s: &State, c: ConnId, cmd: Command) -> Vec<u8> {
        let mut out = Vec::new();
        s.apply(c, cmd, &mut out).expect("apply");
        out
    }

    fn bytes(v: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        put_bytes(&mut out, v);
        out
    }

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn cas(key: &str, expected: &str, desired: &str) -> Command {
        Command::CompareSet { key: k(key), expected: k(expected), desired: k(desired) }
    }

    #[test]
    fn compare_set_has_the_four_libuv_cases() {
        let s = State::new();
        let (c, _rx) = conn(&s);
        assert_eq!(run(&s, c, cas("m", "", "new")), bytes(b"new"), "missing, empty expected: stored");
        assert_eq!(run(&s, c, cas("m2", "x", "y")), bytes(b"x"), "missing, expected given: returns expected");
        assert_eq!(run(&s, c, Command::Get(k("m2"))), bytes(b""), "and stores nothing");
        assert_eq!(run(&s, c, cas("m", "new", "w")), bytes(b"w"), "match: swapped");
        assert_eq!(run(&s, c, cas("m", "zz", "q")), bytes(b"w"), "mismatch: current value");
    }

    #[test]
    fn wait_is_released_by_the_last_missing_key_and_cas_wakes() {
        let s = State::new();
        let (a, mut rx) = conn(&s);
        let (b, _rb) = conn(&s);
        assert!(run(&s, a, Command::Wait(vec![k("x"), k("y")])).is_empty());
        run(&s, b, Command::Set { key: k("x"), value: k("1") });
        assert!(rx.try_recv().is_err(), "one key still missing");
        run(&s, b, cas("y", "", "2"));
        assert_eq!(rx.try_recv().ok(), Some(STOP_WAITING));
    }

    #[test]
    fn cancel_wait_drops_the_registration() {
        let s = State::new();
        let (a, mut rx) = conn(&s);
        let (b, _rb) = conn(&s);
        run(&s, a, Command::Wait(vec![k("late")]));
        assert_eq!(run(&s, a, Command::CancelWait), vec![WAIT_CANCELED]);
        run(&s, b, Command::Set { key: k("late"), value: k("v") });
        assert!(rx.try_recv().is_err(), "a cancelled wait must not be released");
        assert_eq!(run(&s, a, Command::Wait(vec![k("late")])), vec![STOP_WAITING]);
    }

    #[test]
    fn add_counts_and_rejects_non_numbers() {
        let s = State::new();
        let (c, _rx) = conn(&s);
        assert_eq!(run(&s, c, Command::Add { key: k("n"), delta: 5 }), 5i64.to_le_bytes());
        assert_eq!(run(&s, c, Command::Add { key: k("n"), delta: 2 }), 7i64.to_le_bytes());
        assert_eq!(run(&s, c, Command::Get(k("n"))), bytes(b"7"));
        run(&s, c, Command::Set { key: k("t"), value: k("abc") });
        let mut out = Vec::new();
        assert!(matches!(s.apply(c, Command::Add { key: k("t"), delta: 1 }, &mut out), Err(ExecError::NotANumber)));
    }

    #[test]
    fn queue_push_wakes_one_waiter_and_pop_reports_length() {
        let s = State::new();
        let (a, mut ra) = conn(&s);
        let (b, mut rb) = conn(&s);
        let (p, _rp) = conn(&s);
        run(&s, a, Command::Wait(vec![k("q")]));
        run(&s, b, Command::Wait(vec![k("q")]));
        run(&s, p, Command::QueuePush { key: k("q"), value: k("a") });
        assert_eq!(ra.try_recv().ok(), Some(STOP_WAITING));
        assert!(rb.try_recv().is_err(), "only one waiter per push");
        let mut want = 1i64.to_le_bytes().to_vec();
        want.extend(bytes(b"a"));
        assert_eq!(run(&s, a, Command::QueuePop(k("q"))), want);
        assert_eq!(run(&s, a, Command::QueuePop(k("q"))), 0i64.to_le_bytes());
        assert_eq!(run(&s, a, Command::GetNumKeys), 0i64.to_le_bytes(), "queues are not keys");
    }

    #[test]
    fn barrier_releases_everyone_at_world_size() {
        let s = State::new();
        let (a, mut ra) = conn(&s);
        let (b, _rb) = conn(&s);
        assert!(run(&s, a, Command::Barrier { key: k("/bar"), world_size: 2 }).is_empty());
        assert!(ra.try_recv().is_err());
        assert_eq!(run(&s, b, Command::Barrier { key: k("/bar"), world_size: 2 }), vec![STOP_WAITING]);
        assert_eq!(ra.try_recv().ok(), Some(STOP_WAITING));
        assert_eq!(run(&s, a, Command::Get(k("/bar"))), bytes(b"2"));
    }

    #[test]
    fn list_keys_delete_and_num_keys() {
        let s = State::new();
        let (c, _rx) = conn(&s);
        run(&s, c, Command::MultiSet(vec![(k("/m1"), k("x1"))]));
        assert_eq!(run(&s, c, Command::ListKeys), list_reply(&[b"/m1"]));
        assert_eq!(run(&s, c, Command::DeleteKey(k("/m1"))), 1i64.to_le_bytes());
        assert_eq!(run(&s, c, Command::DeleteKey(k("/m1"))), 0i64.to_le_bytes());
        assert_eq!(run(&s, c, Command::GetNumKeys), 0i64.to_le_bytes());
    }

    #[test]
    fn a_closed_waiter_does_not_break_later_writes() {
        let s = State::new();
        let (a, _ra) = conn(&s);
        let (b, _rb) = conn(&s);
        run(&s, a, Command::Wait(vec![k("x")]));
        s.disconnect(a);
        run(&s, b, Command::Set { key: k("x"), value: k("1") });
        assert_eq!(s.connections(), 1);
    }
}
