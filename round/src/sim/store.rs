//! The simulated store: the agents' store as the protocol sees it (GET,
//! SET, ADD, COMPARE_SET on typed keys), one per store host's incarnation,
//! open until its host closes it or dies.
//!
//! Keys are typed here rather than spelled: the simulation checks the
//! protocol, and `trainlet::keys` is the one place where keys are text.

use std::collections::BTreeMap;

/// An agent's uid (one per container).
pub type Uid = u32;

/// A key of the round's protocol (`trainlet::keys::RoundKeys`' names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key {
    /// `round`.
    Round,
    /// `restarts`.
    Restarts,
    /// `host_left`: why the store host left.
    HostLeft,
    /// `claim/<place>`: the uid of the agent that holds a pod's place.
    Claim(u32),
    /// `rR/lead`.
    Lead(u64),
    /// `rR/join`.
    Join(u64),
    /// `rR/m/<slot>`.
    Member(u64, u64),
    /// `rR/quorum`.
    Quorum(u64),
    /// `rR/closed`.
    Closed(u64),
    /// `rR/members`.
    Members(u64),
    /// `rR/end`.
    End(u64),
    /// `rR/done`.
    Done(u64),
    /// `rR/stopped`.
    Stopped(u64),
    /// `rR/all_stopped`.
    AllStopped(u64),
    /// `rR/dead`.
    Dead(u64),
    /// `rR/verdict`.
    Verdict(u64),
    /// `rR/next`.
    Next(u64),
    /// `rR/left`.
    Left(u64),
    /// `rR/all_left`.
    AllLeft(u64),
    /// `rR/spare_left`.
    SpareLeft(u64),
    /// `serve/ended/<seq>`: a served run's end marker.
    Ended(u64),
}

impl Key {
    /// The round a key belongs to, if it is a round's.
    pub fn round(&self) -> Option<u64> {
        match *self {
            Key::Round | Key::Restarts | Key::HostLeft | Key::Claim(_) | Key::Ended(_) => None,
            Key::Lead(r)
            | Key::Join(r)
            | Key::Member(r, _)
            | Key::Quorum(r)
            | Key::Closed(r)
            | Key::Members(r)
            | Key::End(r)
            | Key::Done(r)
            | Key::Stopped(r)
            | Key::AllStopped(r)
            | Key::Dead(r)
            | Key::Verdict(r)
            | Key::Next(r)
            | Key::Left(r)
            | Key::AllLeft(r)
            | Key::SpareLeft(r) => Some(r),
        }
    }
}

/// One store: the one its host's agent serves, from its start to its close.
#[derive(Debug, Default)]
pub struct Store {
    /// Serving.
    pub open: bool,
    /// The job generation whose host serves it (with replica groups: the
    /// group whose keys it holds).
    pub generation: u32,
    /// The store host's incarnation that serves it (every replica group's
    /// store of one incarnation is the same store process).
    pub incarnation: u32,
    map: BTreeMap<Key, Vec<u8>>,
    /// When each deleted key was deleted (a WAIT registered before then
    /// has fired: [`Store::seen`]).
    deleted: BTreeMap<Key, u64>,
}

impl Store {
    /// A new, empty, open store of job generation `generation`, served by
    /// the store host's incarnation `incarnation`.
    pub fn new(generation: u32, incarnation: u32) -> Store {
        Store { open: true, generation, incarnation, map: BTreeMap::new(), deleted: BTreeMap::new() }
    }

    /// The value (empty when unset).
    pub fn get(&self, k: Key) -> Vec<u8> {
        self.map.get(&k).cloned().unwrap_or_default()
    }

    /// Whether `k` is set now.
    pub fn has(&self, k: Key) -> bool {
        self.map.contains_key(&k)
    }

    /// Whether a WAIT on `k` registered at tick `since` has fired: the key
    /// is set, or was until a deletion at or after `since` (a WAIT fires
    /// when its key is set, and stays fired when the key goes later).
    pub fn seen(&self, k: Key, since: u64) -> bool {
        self.has(k) || self.deleted.get(&k).is_some_and(|&at| at >= since)
    }

    /// SET.
    pub fn set(&mut self, k: Key, v: impl Into<Vec<u8>>) {
        self.map.insert(k, v.into());
    }

    /// A number's value (0 when unset or unreadable).
    pub fn num(&self, k: Key) -> i64 {
        std::str::from_utf8(&self.get(k)).ok().and_then(|s| s.parse().ok()).unwrap_or(0)
    }

    /// The job's round (`round`).
    pub fn round(&self) -> u64 {
        u64::try_from(self.num(Key::Round)).unwrap_or(0)
    }

    /// The round the job moved on to from `r` (`rR/next`), past `r`.
    pub fn next_of(&self, r: u64) -> u64 {
        u64::try_from(self.num(Key::Next(r))).unwrap_or(r + 1).max(r + 1)
    }

    /// ADD: the new value.
    pub fn add(&mut self, k: Key, d: i64) -> i64 {
        let n = self.num(k) + d;
        self.set(k, n.to_string());
        n
    }

    /// COMPARE_SET from unset: the value there afterwards (ours when it
    /// was unset), as c10d's returns it.
    pub fn cas(&mut self, k: Key, v: impl Into<Vec<u8>>) -> Vec<u8> {
        self.map.entry(k).or_insert_with(|| v.into()).clone()
    }

    /// COMPARE_SET from `expected` to `v`: the value there afterwards.
    pub fn cas_from(&mut self, k: Key, expected: &[u8], v: impl Into<Vec<u8>>) -> Vec<u8> {
        if self.get(k) == expected {
            self.set(k, v);
        }
        self.get(k)
    }

    /// Raise a counter to at least `v` (the agents' `raise`): the value now.
    pub fn raise(&mut self, k: Key, v: u64) -> u64 {
        let now = u64::try_from(self.num(k)).unwrap_or(0).max(v);
        self.set(k, now.to_string());
        now
    }

    /// The store host's clean-up when round `r` forms: the keys of every
    /// round before `r - 1` go.
    pub fn drop_rounds_before(&mut self, r: u64, now: u64) {
        let keep = r.saturating_sub(1);
        let gone: Vec<Key> = self.map.keys().filter(|k| k.round().is_some_and(|kr| kr < keep)).copied().collect();
        for k in gone {
            self.map.remove(&k);
            self.deleted.insert(k, now);
        }
    }

    /// The rounds that have keys here.
    pub fn rounds_held(&self) -> Vec<u64> {
        let held: std::collections::BTreeSet<u64> = self.map.keys().filter_map(Key::round).collect();
        held.into_iter().collect()
    }
}

/// How a round ended, as the simulated store holds it: the agent's
/// `RoundEnd` for the ends simulated, written by its `Debug` form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Every pod's workers finished.
    Success,
    /// A worker failed (or gave up on its rendezvous).
    Failure,
    /// The store host declared this uid dead, or a pod took over from it.
    Dead(Uid),
    /// This uid was stopped by a signal.
    Abort(Uid),
    /// This uid waits for room (a smaller round runs).
    Waiting(Uid),
    /// A served run was stopped.
    Stop(u64),
}

impl End {
    /// The value written.
    pub fn value(self) -> Vec<u8> {
        format!("{self:?}").into_bytes()
    }

    /// The value read; None when unset or not one.
    pub fn read(v: &[u8]) -> Option<End> {
        let text = std::str::from_utf8(v).ok()?;
        let (name, arg) = match text.split_once('(') {
            Some((name, rest)) => (name, rest.strip_suffix(')')?.parse::<u64>().ok()),
            None => (text, None),
        };
        let uid = || arg.and_then(|a| Uid::try_from(a).ok());
        Some(match name {
            "Success" => End::Success,
            "Failure" => End::Failure,
            "Dead" => End::Dead(uid()?),
            "Abort" => End::Abort(uid()?),
            "Waiting" => End::Waiting(uid()?),
            "Stop" => End::Stop(arg?),
            _ => return None,
        })
    }
}
