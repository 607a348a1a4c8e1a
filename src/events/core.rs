//! The pure core of Kubernetes Events: which event becomes a new object,
//! which one raises an existing object's series count, and which waits or
//! is dropped. Events and the clock come in as arguments, writes go out as
//! values; no I/O and no clock of its own, so tables test it.
//!
//! One series per (type, reason, action, note): the first occurrence is a
//! new Event object, every repeat raises its count, written back as a
//! PATCH of the object's `series` at most once per [`PATCH_EVERY`] (and at
//! a flush). Every write to the API server (create or patch) spends a
//! token of one bucket: [`BURST`] at once, then one per [`REFILL`] (4 a
//! minute). What cannot be written yet waits in its series (its count
//! grows; a series first written with a count of 2 or more is created with
//! that count), so a storm becomes a few counted objects, not a flood. At
//! most [`MAX_SERIES`] series are kept; an event that finds the table full
//! of series still to be written is dropped and counted ([`Core::dropped`]).
//! A flush (on shutdown) writes everything due, without the bucket.

use std::time::Duration;

use tokio::time::Instant;

/// Writes to the API server at once before the rate limit applies.
pub const BURST: u32 = 5;
/// One more write per this long (4 a minute), once the burst is spent.
pub const REFILL: Duration = Duration::from_secs(15);
/// A series' count is written back at most this often (and at a flush).
pub const PATCH_EVERY: Duration = Duration::from_secs(30);
/// Series kept at once.
pub const MAX_SERIES: usize = 64;
/// A series silent this long starts over as a new object at its next
/// event (the API server keeps Events an hour by default, `--event-ttl`).
pub const SERIES_TTL: Duration = Duration::from_secs(30 * 60);
/// Tries of one write before it is given up.
pub const MAX_ATTEMPTS: u32 = 5;
/// The first retry's wait; each next one doubles, up to [`RETRY_CAP`].
pub const RETRY_BASE: Duration = Duration::from_secs(1);
/// The longest wait between two tries of a write.
pub const RETRY_CAP: Duration = Duration::from_secs(30);
/// The API server's limit on `note`, in bytes.
pub const NOTE_LIMIT: usize = 1024;

/// `Normal` or `Warning`, the two types the API server accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Type {
    /// Something happened as it should (a restart within budget, a spare taking a rank).
    Normal,
    /// Something went wrong (a failure, a hang, a straggler, an unhealthy pod).
    Warning,
}

impl Type {
    /// The API's spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Type::Normal => "Normal",
            Type::Warning => "Warning",
        }
    }
}

/// One event as the rest of trainlet says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Normal or Warning.
    pub type_: Type,
    /// What happened, CamelCase (`WorkerFailed`, `JobHung`, `Restarted`,
    /// `SpareTookRank`, `LeftUnhealthy`, `Straggler`); at most 128 bytes.
    pub reason: &'static str,
    /// What trainlet did about it, CamelCase (`Fail`, `Restart`, `Leave`);
    /// at most 128 bytes.
    pub action: &'static str,
    /// For a person: what and why. Cleaned and bounded by [`clean_note`]
    /// when the event is emitted. Keep counters out of it: equal notes are
    /// what folds repeats into one counted object.
    pub note: String,
}

/// The identity of one series.
type Key = (Type, &'static str, &'static str, String);

/// One series: an event and how often it happened.
#[derive(Debug)]
struct Series {
    id: u64,
    key: Key,
    /// Occurrences seen.
    count: u32,
    /// Occurrences the API server has (0: no object yet).
    posted: u32,
    /// The object's name once created.
    name: Option<String>,
    last_seen: Instant,
    last_write: Option<Instant>,
    attempts: u32,
    not_before: Option<Instant>,
}

impl Series {
    fn pending(&self) -> bool {
        self.count > self.posted
    }

    fn retry_due(&self, now: Instant) -> bool {
        self.not_before.is_none_or(|t| t <= now)
    }

    /// When a patch of this series may go (it has an object and news).
    fn patch_at(&self) -> Option<Instant> {
        let (Some(_), true) = (&self.name, self.pending()) else { return None };
        let spaced = self.last_write.map(|w| w + PATCH_EVERY);
        match (spaced, self.not_before) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A write for the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The series, for [`Core::done`].
    pub id: u64,
    /// Create a new object, or patch the named one's series.
    pub kind: WriteKind,
    /// Normal or Warning.
    pub type_: Type,
    /// The event's reason.
    pub reason: &'static str,
    /// The event's action.
    pub action: &'static str,
    /// The event's note (already cleaned).
    pub note: String,
    /// Occurrences so far (1: a single event, no series).
    pub count: u32,
}

/// Create or patch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteKind {
    /// A new Event object.
    Create,
    /// Raise the named object's series count.
    Patch(String),
}

/// How a write ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The object now exists under this name, with the write's count.
    Created(String),
    /// The object's series now has the write's count.
    Patched,
    /// The object is gone (its TTL ran out): create it again.
    Gone,
    /// Try again later (a 5xx, a timeout, a conflict).
    Retry,
}

/// What became of an emitted event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    /// A new series.
    New,
    /// A repeat: its series' count is raised.
    Counted,
    /// The table is full of series still to be written: dropped, counted.
    Dropped,
}

/// The decisions: series, the write budget, and what was lost.
#[derive(Debug)]
pub struct Core {
    series: Vec<Series>,
    next_id: u64,
    tokens: u32,
    refilled_at: Instant,
    dropped: u64,
    given_up: u64,
}

impl Core {
    /// A full bucket at `now`.
    pub fn new(now: Instant) -> Self {
        Self { series: Vec::new(), next_id: 0, tokens: BURST, refilled_at: now, dropped: 0, given_up: 0 }
    }

    /// Events dropped because [`MAX_SERIES`] series were all still to be written.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Occurrences whose writes failed [`MAX_ATTEMPTS`] times.
    pub fn given_up(&self) -> u64 {
        self.given_up
    }

    /// Whether any write is still to be done.
    pub fn pending(&self) -> bool {
        self.series.iter().any(Series::pending)
    }

    /// Count one event (its note already cleaned).
    pub fn observe(&mut self, e: Event, now: Instant) -> Observed {
        let key = (e.type_, e.reason, e.action, e.note);
        if let Some(i) = self.series.iter().position(|s| s.key == key) {
            let stale = !self.series[i].pending() && now.duration_since(self.series[i].last_seen) >= SERIES_TTL;
            if !stale {
                let s = &mut self.series[i];
                s.count = s.count.saturating_add(1);
                s.last_seen = now;
                return Observed::Counted;
            }
            self.series.remove(i);
        }
        if self.series.len() >= MAX_SERIES {
            // Forget the series written longest ago; none: drop this one.
            let quiet = self.series.iter().enumerate().filter(|(_, s)| !s.pending()).min_by_key(|(_, s)| s.last_seen);
            match quiet.map(|(i, _)| i) {
                Some(i) => {
                    self.series.remove(i);
                }
                None => {
                    self.dropped += 1;
                    return Observed::Dropped;
                }
            }
        }
        self.next_id += 1;
        self.series.push(Series {
            id: self.next_id,
            key,
            count: 1,
            posted: 0,
            name: None,
            last_seen: now,
            last_write: None,
            attempts: 0,
            not_before: None,
        });
        Observed::New
    }

    fn refill(&mut self, now: Instant) {
        if self.tokens >= BURST {
            self.refilled_at = now;
            return;
        }
        let gained = now.duration_since(self.refilled_at).as_nanos() / REFILL.as_nanos();
        let gained = u32::try_from(gained).unwrap_or(u32::MAX);
        if gained > 0 {
            self.tokens = self.tokens.saturating_add(gained).min(BURST);
            self.refilled_at = if self.tokens >= BURST { now } else { self.refilled_at + REFILL * gained };
        }
    }

    /// The next write due at `now`, oldest series first, creates before
    /// patches; `flush`: everything pending, spacing and bucket aside
    /// (retries still wait their turn).
    pub fn next(&mut self, now: Instant, flush: bool) -> Option<Write> {
        self.refill(now);
        if !flush && self.tokens == 0 {
            return None;
        }
        let create = self.series.iter().position(|s| s.name.is_none() && s.pending() && s.retry_due(now));
        let patch = || {
            self.series.iter().position(|s| {
                s.name.is_some() && s.pending() && s.retry_due(now) && (flush || s.patch_at().is_some_and(|t| t <= now))
            })
        };
        let i = create.or_else(patch)?;
        if !flush {
            self.tokens -= 1;
        }
        let s = &self.series[i];
        let kind = match &s.name {
            None => WriteKind::Create,
            Some(n) => WriteKind::Patch(n.clone()),
        };
        let (type_, reason, action, note) = s.key.clone();
        Some(Write { id: s.id, kind, type_, reason, action, note, count: s.count })
    }

    /// How the write `w` ended at `now`.
    pub fn done(&mut self, w: &Write, outcome: Outcome, now: Instant) {
        let Some(i) = self.series.iter().position(|s| s.id == w.id) else { return };
        let s = &mut self.series[i];
        match outcome {
            Outcome::Created(name) => {
                s.name = Some(name);
                s.posted = w.count;
                s.last_write = Some(now);
                s.attempts = 0;
                s.not_before = None;
            }
            Outcome::Patched => {
                s.posted = w.count;
                s.last_write = Some(now);
                s.attempts = 0;
                s.not_before = None;
            }
            Outcome::Gone => {
                // A new object for the whole count so far.
                s.name = None;
                s.posted = 0;
                s.last_write = None;
            }
            Outcome::Retry => {
                s.attempts += 1;
                if s.attempts >= MAX_ATTEMPTS {
                    self.given_up += u64::from(s.count - s.posted);
                    self.series.remove(i);
                    return;
                }
                let wait = RETRY_BASE.saturating_mul(1 << (s.attempts - 1).min(16)).min(RETRY_CAP);
                s.not_before = Some(now + wait);
            }
        }
    }

    /// When the next write may be due (None: nothing pending).
    pub fn wake_at(&self, now: Instant) -> Option<Instant> {
        let token_at = if self.tokens > 0 { now } else { self.refilled_at + REFILL };
        self.series
            .iter()
            .filter_map(|s| match &s.name {
                None if s.pending() => Some(s.not_before.unwrap_or(now)),
                None => None,
                Some(_) => s.patch_at().or_else(|| s.pending().then_some(now)),
            })
            .min()
            .map(|t| t.max(token_at))
    }
}

/// A note fit for the API server: ANSI escape sequences removed, every
/// other control character a space, runs of white space one space, trimmed,
/// and at most [`NOTE_LIMIT`] bytes (cut at a character, with an ellipsis).
/// Notes carry text from workers.
pub fn clean_note(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len().min(NOTE_LIMIT));
    let mut chars = raw.chars().peekable();
    let mut space = false;
    while let Some(c) = chars.next() {
        let c = if c == '\u{1b}' {
            // CSI: ESC [ parameters, a final byte in @..~; other escapes: ESC and one more.
            if chars.peek() == Some(&'[') {
                chars.next();
                for f in chars.by_ref() {
                    if ('@'..='~').contains(&f) {
                        break;
                    }
                }
            } else {
                chars.next();
            }
            continue;
        } else if c.is_control() || c.is_whitespace() {
            ' '
        } else {
            c
        };
        if c == ' ' {
            space = !out.is_empty();
            continue;
        }
        if space {
            out.push(' ');
            space = false;
        }
        out.push(c);
        if out.len() > NOTE_LIMIT {
            break;
        }
    }
    if out.len() > NOTE_LIMIT {
        const MORE: &str = "…";
        let mut cut = NOTE_LIMIT - MORE.len();
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str(MORE);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn ev(reason: &'static str, note: &str) -> Event {
        Event { type_: Type::Warning, reason, action: "Fail", note: note.to_string() }
    }

    /// Every write due at `now`, each answered `ok` (creates get `name-<id>`).
    fn run(core: &mut Core, now: Instant, flush: bool) -> Vec<(WriteKind, &'static str, String, u32)> {
        let mut out = Vec::new();
        while let Some(w) = core.next(now, flush) {
            let outcome = match w.kind {
                WriteKind::Create => Outcome::Created(format!("name-{}", w.id)),
                WriteKind::Patch(_) => Outcome::Patched,
            };
            core.done(&w, outcome, now);
            out.push((w.kind, w.reason, w.note, w.count));
        }
        out
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn five_repeats_and_two_others_are_three_objects_and_one_count_of_five() {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        assert_eq!(core.observe(ev("JobHung", "a"), t0), Observed::New);
        assert_eq!(run(&mut core, t0, false), [(WriteKind::Create, "JobHung", "a".into(), 1)]);
        for _ in 0..4 {
            assert_eq!(core.observe(ev("JobHung", "a"), t0), Observed::Counted);
        }
        core.observe(ev("JobHung", "b"), t0);
        core.observe(ev("JobHung", "c"), t0);
        let got = run(&mut core, t0, false);
        assert_eq!(
            got,
            [(WriteKind::Create, "JobHung", "b".into(), 1), (WriteKind::Create, "JobHung", "c".into(), 1)],
            "the repeats wait for the series' spacing"
        );
        assert_eq!(run(&mut core, t0, true), [(WriteKind::Patch("name-1".into()), "JobHung", "a".into(), 5)]);
        assert!(!core.pending());
    }

    #[test]
    fn a_storm_is_a_burst_then_four_writes_a_minute() {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        for i in 0..20 {
            core.observe(ev("WorkerFailed", &format!("rank {i}")), t0);
        }
        assert_eq!(run(&mut core, t0, false).len(), BURST as usize);
        assert_eq!(run(&mut core, t0 + secs(14), false).len(), 0);
        assert_eq!(run(&mut core, t0 + secs(15), false).len(), 1);
        assert_eq!(run(&mut core, t0 + secs(75), false).len(), 4, "one per 15 s");
        assert_eq!(core.wake_at(t0 + secs(75)), Some(t0 + secs(90)));
        assert_eq!(run(&mut core, t0 + secs(75), true).len(), 10, "a flush writes the rest");
    }

    #[test]
    fn a_restart_loop_is_one_object_whose_count_is_written_every_30_s() {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        let mut writes = Vec::new();
        for s in 0..120 {
            let now = t0 + secs(s);
            core.observe(ev("Restarted", "rank 3 exited with code 1"), now);
            writes.extend(run(&mut core, now, false).into_iter().map(|(k, _, _, n)| (s, k, n)));
        }
        assert_eq!(
            writes,
            [
                (0, WriteKind::Create, 1),
                (30, WriteKind::Patch("name-1".into()), 31),
                (60, WriteKind::Patch("name-1".into()), 61),
                (90, WriteKind::Patch("name-1".into()), 91),
            ]
        );
        assert_eq!(core.wake_at(t0 + secs(119)), Some(t0 + secs(120)));
    }

    #[test]
    fn repeats_before_the_first_write_make_an_object_with_a_count() {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        for _ in 0..3 {
            core.observe(ev("Straggler", "rank 7 is 40% slower"), t0);
        }
        assert_eq!(run(&mut core, t0, false), [(WriteKind::Create, "Straggler", "rank 7 is 40% slower".into(), 3)]);
    }

    #[test_case(&[Outcome::Retry], Some(1); "first retry after 1 s")]
    #[test_case(&[Outcome::Retry, Outcome::Retry], Some(2); "then 2 s")]
    #[test_case(&[Outcome::Retry, Outcome::Retry, Outcome::Retry, Outcome::Retry], Some(8); "then 8 s")]
    #[test_case(&[Outcome::Retry, Outcome::Retry, Outcome::Retry, Outcome::Retry, Outcome::Retry], None; "given up after five tries")]
    fn failed_writes_back_off_then_give_up(outcomes: &[Outcome], wait: Option<u64>) {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        core.observe(ev("JobHung", "a"), t0);
        let mut now = t0;
        for o in outcomes {
            now = core.wake_at(now).expect("a write due");
            let w = core.next(now, true).expect("a write");
            core.done(&w, o.clone(), now);
        }
        assert_eq!(core.next(now, true), None, "not before its time");
        assert_eq!(core.wake_at(now).map(|t| t - now), wait.map(secs));
        assert_eq!(core.given_up(), u64::from(wait.is_none()));
    }

    #[test]
    fn an_expired_object_is_created_again_with_the_whole_count() {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        core.observe(ev("JobHung", "a"), t0);
        run(&mut core, t0, false);
        core.observe(ev("JobHung", "a"), t0 + secs(40));
        let w = core.next(t0 + secs(40), false).expect("the patch");
        assert_eq!(w.kind, WriteKind::Patch("name-1".into()));
        core.done(&w, Outcome::Gone, t0 + secs(40));
        let w = core.next(t0 + secs(40), false).expect("the create");
        assert_eq!((w.kind, w.count), (WriteKind::Create, 2));
    }

    #[test]
    fn a_quiet_series_starts_over_after_its_ttl() {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        core.observe(ev("JobHung", "a"), t0);
        run(&mut core, t0, false);
        assert_eq!(core.observe(ev("JobHung", "a"), t0 + SERIES_TTL), Observed::New);
        assert_eq!(run(&mut core, t0 + SERIES_TTL, false)[0].0, WriteKind::Create);
    }

    #[test]
    fn a_full_table_forgets_written_series_and_drops_when_none_is() {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        for i in 0..MAX_SERIES {
            core.observe(ev("WorkerFailed", &format!("{i}")), t0);
        }
        assert_eq!(core.observe(ev("WorkerFailed", "one more"), t0), Observed::Dropped);
        assert_eq!(core.dropped(), 1);
        run(&mut core, t0, false);
        assert_eq!(core.observe(ev("WorkerFailed", "one more"), t0), Observed::New, "a written series made room");
    }

    #[test]
    fn types_reasons_and_actions_are_their_own_series() {
        let t0 = Instant::now();
        let mut core = Core::new(t0);
        core.observe(ev("A", "n"), t0);
        assert_eq!(core.observe(Event { type_: Type::Normal, ..ev("A", "n") }, t0), Observed::New);
        assert_eq!(core.observe(ev("B", "n"), t0), Observed::New);
        assert_eq!(core.observe(Event { action: "Restart", ..ev("A", "n") }, t0), Observed::New);
        assert_eq!(core.observe(ev("A", "n"), t0), Observed::Counted);
    }

    #[test_case("rank 3 exited with code 1", "rank 3 exited with code 1"; "plain")]
    #[test_case("  a\n\tb\r\n\nc  ", "a b c"; "white space folded")]
    #[test_case("\x1b[31mred\x1b[0m text", "red text"; "ansi colours removed")]
    #[test_case("bell\x07 nul\0 del\x7f", "bell nul del"; "control characters")]
    #[test_case("\x1b]0;title\x07x", "0;title x"; "other escapes lose their escape")]
    #[test_case("", ""; "empty")]
    #[test_case("naïve 日本", "naïve 日本"; "unicode kept")]
    fn notes_are_cleaned(raw: &str, want: &str) {
        assert_eq!(clean_note(raw), want);
    }

    #[test_case(1024, 1024; "at the limit")]
    #[test_case(1025, 1024; "one over")]
    #[test_case(100_000, 1024; "far over")]
    fn notes_are_bounded_in_bytes(len: usize, bytes: usize) {
        let s = clean_note(&"é".repeat(len / 2 + 1)[..len / 2 * 2]);
        assert!(s.len() <= bytes, "{} bytes", s.len());
        let ascii = clean_note(&"x".repeat(len));
        assert!(ascii.len() <= NOTE_LIMIT);
        assert_eq!(ascii.ends_with('…'), len > NOTE_LIMIT);
        assert_eq!(ascii.len() == len, len <= NOTE_LIMIT);
    }
}
