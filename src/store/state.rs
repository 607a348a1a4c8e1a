//! Keys, queues and parked waiters of one store, with libuv semantics.
//!
//! A connection that sends WAIT (or BARRIER) on missing keys is parked: it
//! gets a counter of keys still missing and is listed under each of them.
//! Every write of a listed key (SET, ADD, APPEND, MULTI_SET, COMPARE_SET in
//! any branch, as libuv does) decrements the counters of its waiters; at zero
//! the waiter's channel receives STOP_WAITING. QUEUE_PUSH wakes one waiter.
//! Registrations carry a sequence number so that entries left behind by a
//! CANCEL_WAIT or a closed connection are skipped instead of waking the
//! wrong wait. The lock is never held across I/O. A wait that ends without
//! being released (CANCEL_WAIT, a new WAIT, the connection closing) takes
//! its registrations out of the lists at once, so closed connections leave
//! nothing behind.
//!
//! Memory a client can make the store hold is bounded by one [`Budget`]:
//! stored keys and values (plus [`ENTRY_OVERHEAD`] per entry), parked
//! registrations, and the partial frames the connections buffer. A write
//! that would pass it is refused before it changes anything
//! ([`ExecError::Full`]) and its connection is closed.
//! Some keys can be tied to the connection that last SET them
//! ([`State::tie`], `super::ties`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc::UnboundedSender;

use super::ties::{LOST, TieRule, Ties};
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
    /// AUTH after the handshake, or on a store that asks for no token.
    #[error("unexpected AUTH (this store asks for no token, or the handshake is over)")]
    Auth,
    /// The write would take the store past its memory budget.
    #[error("the store is full: {need} more bytes would pass its budget of {limit} bytes ({used} in use)")]
    Full {
        /// What the request needed.
        need: u64,
        /// The budget.
        limit: u64,
        /// In use before the request.
        used: u64,
    },
}

/// Counted per stored entry or parked registration on top of its bytes
/// (map slot, vector headers), so that many tiny keys are bounded too.
pub const ENTRY_OVERHEAD: u64 = 64;

/// The memory budget of an agent's stores: everything clients can make them hold.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: AtomicU64,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Self { limit, used: AtomicU64::new(0) }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes in use.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Take `n` bytes, or say why not.
    pub fn reserve(&self, n: u64) -> Result<(), ExecError> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.checked_add(n).filter(|t| *t <= self.limit).ok_or(ExecError::Full {
                need: n,
                limit: self.limit,
                used,
            })?;
            match self.used.compare_exchange_weak(used, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => used = now,
            }
        }
    }

    /// Give back `n` bytes.
    pub fn release(&self, n: u64) {
        if n == 0 {
            return;
        }
        let _ = self.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_sub(n)));
    }
}

impl Default for Budget {
    fn default() -> Self {
        Self::new(u64::MAX)
    }
}

fn entry_size(key: &[u8], value: &[u8]) -> u64 {
    (key.len() as u64).saturating_add(value.len() as u64).saturating_add(ENTRY_OVERHEAD)
}

#[derive(Debug)]
struct Parked {
    seq: u64,
    missing: usize,
    /// Every key it is listed under (duplicates included), to unlist it.
    keys: Vec<Vec<u8>>,
    /// What its registrations hold of the budget.
    charge: u64,
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
    /// Tied keys and the connection each is tied to.
    ties: Ties,
    next_conn: ConnId,
    /// Budget bytes freed under the lock, given back when it is released.
    refund: u64,
}

/// The whole content of one store. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct State {
    inner: Mutex<Inner>,
    budget: std::sync::Arc<Budget>,
    /// Which SETs tie their key (none until [`State::tie`]).
    tie: std::sync::OnceLock<TieRule>,
    /// Tied keys whose connection was closed by its peer, counted.
    losses: tokio::sync::watch::Sender<u64>,
}

impl Default for State {
    fn default() -> Self {
        Self::with_budget(std::sync::Arc::default())
    }
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
            // Every key it waited for was written, and each write took the
            // key's list away: nothing is left to unlist.
            let charge = p.charge;
            c.parked = None;
            self.refund += charge;
            // The connection may be closing; then nobody needs the reply.
            let _ = c.wake.send(STOP_WAITING);
        }
    }

    /// Park `conn` until every key in `missing` has been written once.
    /// Its registrations are reserved from `budget` first: each key is held
    /// twice (the list's map key, the wait's own list) plus the overhead.
    fn park(&mut self, budget: &Budget, conn: ConnId, missing: Vec<Vec<u8>>) -> Result<(), ExecError> {
        let charge = missing
            .iter()
            .fold(0u64, |t, k| t.saturating_add((k.len() as u64).saturating_mul(2)).saturating_add(ENTRY_OVERHEAD));
        budget.reserve(charge)?;
        self.unpark(conn);
        let Some(c) = self.conns.get_mut(&conn) else {
            self.refund += charge;
            return Ok(());
        };
        let seq = c.next_seq;
        c.next_seq += 1;
        for key in &missing {
            self.waiters.entry(key.clone()).or_default().push((conn, seq));
        }
        c.parked = Some(Parked { seq, missing: missing.len(), keys: missing, charge });
        Ok(())
    }

    /// End `conn`'s parked wait, if any, without releasing it: take its
    /// registrations out of every list and give back what they held.
    fn unpark(&mut self, conn: ConnId) {
        let Some(p) = self.conns.get_mut(&conn).and_then(|c| c.parked.take()) else { return };
        for key in &p.keys {
            if let Some(list) = self.waiters.get_mut(key) {
                list.retain(|&(c, s)| (c, s) != (conn, p.seq));
                if list.is_empty() {
                    self.waiters.remove(key);
                }
            }
        }
        self.refund += p.charge;
    }

    /// Store `value` under `key`, the growth reserved from `budget` first
    /// (one map lookup).
    fn put(&mut self, budget: &Budget, key: Vec<u8>, value: Vec<u8>) -> Result<(), ExecError> {
        let new = entry_size(&key, &value);
        match self.kv.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let old = entry_size(e.key(), e.get());
                if new > old {
                    budget.reserve(new - old)?;
                } else {
                    self.refund += old - new;
                }
                e.insert(value);
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                budget.reserve(new)?;
                e.insert(value);
            }
        }
        Ok(())
    }

    /// Store `value` under `key` when its size is already reserved.
    fn put_reserved(&mut self, key: Vec<u8>, value: Vec<u8>) {
        if let Some(old) = self.kv.get(&key) {
            self.refund += entry_size(&key, old);
        }
        self.kv.insert(key, value);
    }

    fn set(&mut self, budget: &Budget, key: Vec<u8>, value: Vec<u8>) -> Result<(), ExecError> {
        // The key is only needed again when someone waits on it.
        let woken = self.waiters.contains_key(&key).then(|| key.clone());
        self.put(budget, key, value)?;
        if let Some(k) = woken {
            self.wake_all(&k);
        }
        Ok(())
    }

    fn untie(&mut self, budget: &Budget, conn: ConnId, lost: bool) -> u64 {
        let mut n = 0;
        for key in self.ties.take(conn) {
            // Past the budget the key keeps its value (the heartbeat
            // timeout still finds the death).
            if lost && self.kv.contains_key(&key) && self.put(budget, key.clone(), LOST.to_vec()).is_ok() {
                self.wake_all(&key);
                n += 1;
            }
        }
        n
    }

    fn add(&mut self, budget: &Budget, key: &[u8], delta: i64) -> Result<i64, ExecError> {
        let current = match self.kv.get(key) {
            None => 0,
            Some(v) => {
                std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<i64>().ok()).ok_or(ExecError::NotANumber)?
            }
        };
        let next = current.checked_add(delta).ok_or(ExecError::Overflow)?;
        self.put(budget, key.to_vec(), next.to_string().into_bytes())?;
        Ok(next)
    }
}

impl State {
    /// An empty store without a memory budget (tests, tools).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store whose clients' data counts against `budget` (which
    /// several stores of one agent share).
    pub fn with_budget(budget: std::sync::Arc<Budget>) -> Self {
        Self {
            inner: Mutex::default(),
            budget,
            tie: std::sync::OnceLock::new(),
            losses: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Tie the keys `rule` says to the connection that last SET them (see
    /// the module doc); once per store, a second rule is ignored. SETs
    /// before it tie nothing.
    pub fn tie(&self, rule: TieRule) {
        let _ = self.tie.set(rule);
    }

    /// The count of tied keys lost so far; it changes at every loss.
    pub fn losses(&self) -> tokio::sync::watch::Receiver<u64> {
        self.losses.subscribe()
    }

    /// The store's memory budget.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Register a connection; wake-ups for it are sent on `wake`.
    pub fn connect(&self, wake: UnboundedSender<u8>) -> ConnId {
        let mut inner = self.lock();
        let id = inner.next_conn;
        inner.next_conn += 1;
        inner.conns.insert(id, Conn { wake, parked: None, next_seq: 0 });
        id
    }

    /// Forget a connection and its parked wait; `lost`: its peer closed it
    /// (EOF, a reset), and its tied keys become [`LOST`].
    pub fn disconnect(&self, conn: ConnId, lost: bool) {
        let mut g = self.lock();
        g.unpark(conn);
        let n = g.untie(&self.budget, conn, lost);
        g.conns.remove(&conn);
        let refund = std::mem::take(&mut g.refund);
        drop(g);
        self.budget.release(refund);
        if n > 0 {
            self.losses.send_modify(|c| *c += n);
        }
    }

    /// Keys listed in parked waits (all connections), for tests and metrics.
    pub fn registrations(&self) -> usize {
        self.lock().waiters.values().map(Vec::len).sum()
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
    /// Returns the bytes of the reply reserved from the budget (large
    /// MULTI_GET and LIST_KEYS replies): the caller releases them once the
    /// reply is written.
    pub fn apply(&self, conn: ConnId, cmd: Command, out: &mut Vec<u8>) -> Result<u64, ExecError> {
        let mut g = self.lock();
        if let (Command::Set { key, value }, Some(rule)) = (&cmd, self.tie.get()) {
            // A key whose value the rule unties (a heartbeat's `bye`: its
            // agent left) is tied again by no later SET: one still in
            // flight from the agent's heartbeat may be read after its
            // `bye`, and the close of that connection is no death.
            let left = g.kv.get(key).is_some_and(|v| !rule(key, v));
            g.ties.set(conn, key, rule(key, value) && !left);
        }
        let done = Self::apply_locked(&mut g, &self.budget, conn, cmd, out);
        let refund = std::mem::take(&mut g.refund);
        drop(g);
        self.budget.release(refund);
        done
    }

    fn apply_locked(
        inner: &mut Inner,
        budget: &Budget,
        conn: ConnId,
        cmd: Command,
        out: &mut Vec<u8>,
    ) -> Result<u64, ExecError> {
        let mut reply_charge = 0;
        match cmd {
            Command::Validate(_) => return Err(ExecError::Validate),
            // The handshake is the connection's, before any command.
            Command::Auth(_) => return Err(ExecError::Auth),
            Command::Ping(nonce) => out.extend_from_slice(&nonce.to_le_bytes()),
            Command::Set { key, value } => inner.set(budget, key, value)?,
            Command::CompareSet { key, expected, desired } => {
                let swap = match inner.kv.get(&key) {
                    None => expected.is_empty(),
                    Some(current) => *current == expected,
                };
                let reply = if swap {
                    inner.put(budget, key.clone(), desired.clone())?;
                    desired
                } else {
                    inner.kv.get(&key).cloned().unwrap_or(expected)
                };
                put_bytes(out, &reply);
                inner.wake_all(&key);
            }
            Command::Get(key) => put_bytes(out, inner.kv.get(&key).map_or(&[][..], Vec::as_slice)),
            Command::Add { key, delta } => {
                let n = inner.add(budget, &key, delta)?;
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
                    inner.unpark(conn);
                    out.push(STOP_WAITING);
                } else {
                    inner.park(budget, conn, missing)?;
                }
            }
            Command::GetNumKeys => put_i64(out, i64::try_from(inner.kv.len()).unwrap_or(i64::MAX)),
            Command::DeleteKey(key) => {
                inner.ties.forget(&key);
                let old = inner.kv.remove(&key);
                if let Some(v) = &old {
                    inner.refund += entry_size(&key, v);
                }
                put_i64(out, i64::from(old.is_some()));
            }
            Command::Append { key, value } => {
                let grow = (value.len() as u64).saturating_add(if inner.kv.contains_key(&key) {
                    0
                } else {
                    (key.len() as u64).saturating_add(ENTRY_OVERHEAD)
                });
                budget.reserve(grow)?;
                inner.kv.entry(key.clone()).or_default().extend_from_slice(&value);
                inner.wake_all(&key);
            }
            Command::MultiGet(keys) => {
                let size = keys.iter().fold(0u64, |t, k| {
                    t.saturating_add(8).saturating_add(inner.kv.get(k).map_or(0, |v| v.len() as u64))
                });
                reply_charge = reserve_reply(budget, size)?;
                for k in &keys {
                    put_bytes(out, inner.kv.get(k).map_or(&[][..], Vec::as_slice));
                }
            }
            Command::MultiSet(pairs) => {
                // All or nothing: reserve every new entry, then give back
                // what the overwritten ones held.
                let need = pairs.iter().fold(0u64, |t, (k, v)| t.saturating_add(entry_size(k, v)));
                budget.reserve(need)?;
                for (k, v) in pairs {
                    let woken = inner.waiters.contains_key(&k).then(|| k.clone());
                    inner.put_reserved(k, v);
                    if let Some(k) = woken {
                        inner.wake_all(&k);
                    }
                }
            }
            Command::CancelWait => {
                inner.unpark(conn);
                out.push(WAIT_CANCELED);
            }
            Command::QueuePush { key, value } => {
                budget.reserve(entry_size(&key, &value))?;
                inner.queues.entry(key.clone()).or_default().push_back(value);
                inner.wake_one(&key);
            }
            Command::QueuePop(key) => {
                let q = inner.queues.get_mut(&key);
                let len = q.as_ref().map_or(0, |q| q.len());
                put_i64(out, i64::try_from(len).unwrap_or(i64::MAX));
                if let Some(q) = q
                    && let Some(value) = q.pop_front()
                {
                    let empty = q.is_empty();
                    put_bytes(out, &value);
                    inner.refund += entry_size(&key, &value);
                    if empty {
                        inner.queues.remove(&key);
                    }
                }
            }
            Command::QueueLen(key) => {
                let len = inner.queues.get(&key).map_or(0, VecDeque::len);
                put_i64(out, i64::try_from(len).unwrap_or(i64::MAX));
            }
            Command::ListKeys => {
                let size = inner.kv.keys().fold(8u64, |t, k| t.saturating_add(8).saturating_add(k.len() as u64));
                reply_charge = reserve_reply(budget, size)?;
                put_i64(out, i64::try_from(inner.kv.len()).unwrap_or(i64::MAX));
                for k in inner.kv.keys() {
                    put_bytes(out, k);
                }
            }
            Command::Barrier { key, world_size } => {
                let arrived = inner.add(budget, &key, 1)?;
                if arrived >= world_size {
                    out.push(STOP_WAITING);
                    inner.wake_all(&key);
                } else {
                    inner.park(budget, conn, vec![key])?;
                }
            }
        }
        Ok(reply_charge)
    }
}

/// Replies up to this size are not charged to the budget (the server
/// writes out whatever it has before it grows past this).
pub const FREE_REPLY: u64 = 1024 * 1024;

/// Reserve a reply of `size` bytes when it is large; returns the charge.
fn reserve_reply(budget: &Budget, size: u64) -> Result<u64, ExecError> {
    if size <= FREE_REPLY {
        return Ok(0);
    }
    budget.reserve(size)?;
    Ok(size)
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

    fn budgeted(limit: u64) -> State {
        State::with_budget(std::sync::Arc::new(Budget::new(limit)))
    }

    fn set(key: &str, len: usize) -> Command {
        Command::Set { key: k(key), value: vec![b'x'; len] }
    }

    #[test]
    fn writes_past_the_budget_are_refused_and_change_nothing() {
        let s = budgeted(1000);
        let (c, _rx) = conn(&s);
        run(&s, c, set("a", 400));
        assert_eq!(s.budget().used(), 400 + 1 + ENTRY_OVERHEAD);
        let mut out = Vec::new();
        assert!(matches!(s.apply(c, set("b", 600), &mut out), Err(ExecError::Full { .. })));
        assert_eq!(run(&s, c, Command::Get(k("b"))), bytes(b""), "nothing stored");
        let pairs = vec![(k("c"), vec![1; 100]), (k("d"), vec![1; 500])];
        assert!(matches!(s.apply(c, Command::MultiSet(pairs), &mut out), Err(ExecError::Full { .. })));
        assert_eq!(run(&s, c, Command::GetNumKeys), 1i64.to_le_bytes(), "a MULTI_SET is all or nothing");
        assert!(matches!(
            s.apply(c, Command::Append { key: k("a"), value: vec![0; 600] }, &mut out),
            Err(ExecError::Full { .. })
        ));
        // Overwriting with less, deleting and popping give memory back.
        run(&s, c, set("a", 10));
        assert_eq!(s.budget().used(), 10 + 1 + ENTRY_OVERHEAD);
        run(&s, c, Command::DeleteKey(k("a")));
        run(&s, c, Command::QueuePush { key: k("q"), value: vec![0; 500] });
        run(&s, c, Command::QueuePop(k("q")));
        assert_eq!(s.budget().used(), 0);
        run(&s, c, set("b", 600));
    }

    #[test]
    fn wait_registrations_are_freed_when_their_connection_closes_or_cancels() {
        let s = budgeted(10_000_000);
        let keys: Vec<Vec<u8>> = (0..1000).map(|i| format!("/never/{i}").into_bytes()).collect();
        let (a, _ra) = conn(&s);
        let (b, _rb) = conn(&s);
        run(&s, a, Command::Wait(keys.clone()));
        run(&s, b, Command::Wait(keys.clone()));
        assert_eq!(s.registrations(), 2000);
        assert!(s.budget().used() > 0);
        s.disconnect(a, false);
        assert_eq!(s.registrations(), 1000, "the closed connection's registrations are gone");
        assert_eq!(run(&s, b, Command::CancelWait), vec![WAIT_CANCELED]);
        assert_eq!(s.registrations(), 0, "a cancelled wait is unlisted");
        // A second WAIT replaces the first (a hostile client can send two).
        run(&s, b, Command::Wait(keys.clone()));
        run(&s, b, Command::Wait(keys[..10].to_vec()));
        assert_eq!(s.registrations(), 10);
        s.disconnect(b, false);
        assert_eq!((s.registrations(), s.budget().used()), (0, 0));
    }

    #[test]
    fn large_replies_are_charged_until_written() {
        let s = budgeted(20_000_000);
        let (c, _rx) = conn(&s);
        run(&s, c, set("big", 4_000_000));
        let mut out = Vec::new();
        let charge = s.apply(c, Command::MultiGet(vec![k("big"); 3]), &mut out).expect("fits");
        assert_eq!(charge, 3 * (8 + 4_000_000));
        // Many copies of one value cannot make one reply pass the budget.
        let mut out = Vec::new();
        assert!(matches!(s.apply(c, Command::MultiGet(vec![k("big"); 5]), &mut out), Err(ExecError::Full { .. })));
        assert!(out.is_empty());
        s.budget().release(charge);
    }

    #[test]
    fn a_closed_waiter_does_not_break_later_writes() {
        let s = State::new();
        let (a, _ra) = conn(&s);
        let (b, _rb) = conn(&s);
        run(&s, a, Command::Wait(vec![k("x")]));
        s.disconnect(a, false);
        run(&s, b, Command::Set { key: k("x"), value: k("1") });
        assert_eq!(s.connections(), 1);
    }

    /// The tie rule of these tests: keys under `hb/`, unless `bye`.
    fn tie_hb(key: &[u8], value: &[u8]) -> bool {
        key.starts_with(b"hb/") && value != b"bye"
    }

    fn get(s: &State, c: ConnId, key: &str) -> Vec<u8> {
        let mut out = Vec::new();
        s.apply(c, Command::Get(k(key)), &mut out).expect("get");
        out[8..].to_vec()
    }

    #[test]
    fn a_tied_key_reads_lost_once_its_connection_is_closed_by_its_peer() {
        let s = State::new();
        s.tie(tie_hb);
        let mut losses = s.losses();
        let (a, _ra) = conn(&s);
        let (b, _rb) = conn(&s);
        let (w, mut rw) = conn(&s);
        run(&s, a, Command::Set { key: k("hb/a"), value: k("1") });
        run(&s, a, Command::Set { key: k("other"), value: k("1") });
        // A waiter on the key wakes at the loss (as at any write).
        run(&s, b, Command::Set { key: k("hb/b"), value: k("1") });
        run(&s, w, Command::Wait(vec![k("hb/a"), k("later")]));
        s.disconnect(a, true);
        assert_eq!(get(&s, b, "hb/a"), LOST);
        assert_eq!(get(&s, b, "other"), b"1", "only tied keys");
        assert_eq!(*losses.borrow_and_update(), 1);
        assert!(rw.try_recv().is_err(), "one of two keys written: still waiting");
        // A clean close (the server's own, at shutdown) loses nothing.
        s.disconnect(b, false);
        assert_eq!(get(&s, w, "hb/b"), b"1");
        assert!(!losses.has_changed().expect("open"));
    }

    #[test]
    fn a_tie_follows_the_last_writer_and_bye_unties() {
        let s = State::new();
        s.tie(tie_hb);
        let (a, _ra) = conn(&s);
        let (b, _rb) = conn(&s);
        let (c, _rc) = conn(&s);
        // Reconnected: the new connection beats, the old one's close is no loss.
        run(&s, a, Command::Set { key: k("hb/x"), value: k("1") });
        run(&s, b, Command::Set { key: k("hb/x"), value: k("2") });
        s.disconnect(a, true);
        assert_eq!(get(&s, c, "hb/x"), b"2");
        // `bye` unties: the agent left.
        run(&s, b, Command::Set { key: k("hb/x"), value: k("bye") });
        s.disconnect(b, true);
        assert_eq!(get(&s, c, "hb/x"), b"bye");
        // A deleted key stays deleted.
        let (e, _re) = conn(&s);
        run(&s, e, Command::Set { key: k("hb/y"), value: k("1") });
        run(&s, c, Command::DeleteKey(k("hb/y")));
        s.disconnect(e, true);
        assert_eq!(get(&s, c, "hb/y"), b"");
    }

    #[test]
    fn a_beat_read_after_a_newer_connections_or_after_bye_ties_nothing() {
        let s = State::new();
        s.tie(tie_hb);
        let (old, _ro) = conn(&s);
        let (new, _rn) = conn(&s);
        let (w, _rw) = conn(&s);
        // The agent redialled: its new connection's beat is read, then one
        // still in flight on the old connection, which then closes.
        run(&s, new, Command::Set { key: k("hb/x"), value: k("42") });
        run(&s, old, Command::Set { key: k("hb/x"), value: k("41") });
        s.disconnect(old, true);
        assert_eq!(get(&s, w, "hb/x"), b"41", "no loss: the new connection holds the key");
        // It left (`bye` on the session's connection), and a beat still in
        // flight on its heartbeat's connection is read after: that
        // connection's close is no death.
        run(&s, w, Command::Set { key: k("hb/x"), value: k("bye") });
        run(&s, new, Command::Set { key: k("hb/x"), value: k("43") });
        s.disconnect(new, true);
        assert_eq!(get(&s, w, "hb/x"), b"43");
    }
}
