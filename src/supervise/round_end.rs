//! How a round ended, as its `rR/end` key in the store holds it (the
//! first writer wins, so every pod reads the same end). Written and read
//! only through [`RoundEnd`]'s `Display` and `FromStr`: nothing else
//! spells or matches the text.

use std::fmt;

use super::policy::JobEnd;

/// The tail of a failure's text when a worker hung or stopped making
/// progress (`failure:hang`, `fatal:hang`).
const HANG: &str = ":hang";

/// A round's end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoundEnd {
    /// `success`: every worker on every pod is done.
    Success,
    /// `failure`, or `fatal` when a `fail` rule matched; `:hang` after
    /// either when a worker hung or stopped making progress, so every pod
    /// reads its workers' stacks before it stops them.
    Failure {
        /// A `fail` rule matched: no restart.
        fatal: bool,
        /// A worker hung or stopped making progress.
        hang: bool,
    },
    /// `dead:UID`: the member UID was declared dead (it stopped
    /// heartbeating, or a pod restarted in its place).
    Dead(String),
    /// `waiting:UID`: pod UID waits to join a round smaller than the most
    /// the job takes.
    Waiting(String),
    /// `abort:UID:SIGNAL`: pod UID was stopped by SIGNAL.
    Abort {
        /// The pod stopped.
        uid: String,
        /// The signal that stopped it.
        signal: i32,
    },
    /// `stop:SEQ`: served run SEQ was stopped (closed, or replaced).
    Stop(u64),
    /// Any other text (an agent of another version wrote it), kept as
    /// written: read as a planned regroup.
    Other(String),
}

impl RoundEnd {
    /// How the supervisor takes it.
    pub fn job_end(&self) -> JobEnd {
        match self {
            RoundEnd::Success => JobEnd::Success,
            RoundEnd::Failure { .. } => JobEnd::Failure,
            RoundEnd::Dead(_) => JobEnd::Regroup { planned: false },
            RoundEnd::Waiting(_) | RoundEnd::Abort { .. } | RoundEnd::Stop(_) | RoundEnd::Other(_) => {
                JobEnd::Regroup { planned: true }
            }
        }
    }

    /// A worker hung or stopped making progress.
    pub fn is_hang(&self) -> bool {
        matches!(self, RoundEnd::Failure { hang: true, .. })
    }

    /// A served run was stopped: its kept workers are not kept.
    pub fn is_stop(&self) -> bool {
        matches!(self, RoundEnd::Stop(_))
    }

    /// The end a store value holds (any bytes read as some end).
    pub fn from_bytes(value: &[u8]) -> RoundEnd {
        RoundEnd::read(&String::from_utf8_lossy(value))
    }

    /// The end `text` says (any text reads as some end).
    pub fn read(text: &str) -> RoundEnd {
        let other = || RoundEnd::Other(text.to_string());
        let (what, hang) = match text.strip_suffix(HANG) {
            Some(what) => (what, true),
            None => (text, false),
        };
        match (what, hang) {
            ("success", false) => return RoundEnd::Success,
            ("failure", _) => return RoundEnd::Failure { fatal: false, hang },
            ("fatal", _) => return RoundEnd::Failure { fatal: true, hang },
            _ => {}
        }
        let Some((kind, rest)) = text.split_once(':') else { return other() };
        match kind {
            "dead" if !rest.is_empty() => RoundEnd::Dead(rest.to_string()),
            "waiting" if !rest.is_empty() => RoundEnd::Waiting(rest.to_string()),
            "stop" => rest.parse().map_or_else(|_| other(), RoundEnd::Stop),
            "abort" => match rest.rsplit_once(':') {
                Some((uid, signal)) if !uid.is_empty() => {
                    signal.parse().map_or_else(|_| other(), |signal| RoundEnd::Abort { uid: uid.to_string(), signal })
                }
                _ => other(),
            },
            _ => other(),
        }
    }
}

impl fmt::Display for RoundEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RoundEnd::Success => f.write_str("success"),
            RoundEnd::Failure { fatal, hang } => {
                f.write_str(if *fatal { "fatal" } else { "failure" })?;
                if *hang { f.write_str(HANG) } else { Ok(()) }
            }
            RoundEnd::Dead(uid) => write!(f, "dead:{uid}"),
            RoundEnd::Waiting(uid) => write!(f, "waiting:{uid}"),
            RoundEnd::Abort { uid, signal } => write!(f, "abort:{uid}:{signal}"),
            RoundEnd::Stop(seq) => write!(f, "stop:{seq}"),
            RoundEnd::Other(text) => f.write_str(text),
        }
    }
}

impl std::str::FromStr for RoundEnd {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(RoundEnd::read(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn other(s: &str) -> RoundEnd {
        RoundEnd::Other(s.into())
    }

    #[test_case("success", RoundEnd::Success, JobEnd::Success; "success")]
    #[test_case("failure", RoundEnd::Failure { fatal: false, hang: false }, JobEnd::Failure; "failure")]
    #[test_case("fatal", RoundEnd::Failure { fatal: true, hang: false }, JobEnd::Failure; "fatal")]
    #[test_case("failure:hang", RoundEnd::Failure { fatal: false, hang: true }, JobEnd::Failure; "hang")]
    #[test_case("fatal:hang", RoundEnd::Failure { fatal: true, hang: true }, JobEnd::Failure; "fatal hang")]
    #[test_case("dead:h#1#2", RoundEnd::Dead("h#1#2".into()), JobEnd::Regroup { planned: false }; "dead")]
    #[test_case("dead:h:hang", RoundEnd::Dead("h:hang".into()), JobEnd::Regroup { planned: false }; "a uid that ends like a hang")]
    #[test_case("waiting:h#1#2", RoundEnd::Waiting("h#1#2".into()), JobEnd::Regroup { planned: true }; "waiting")]
    #[test_case("abort:h#1#2:15", RoundEnd::Abort { uid: "h#1#2".into(), signal: 15 }, JobEnd::Regroup { planned: true }; "abort")]
    #[test_case("stop:7", RoundEnd::Stop(7), JobEnd::Regroup { planned: true }; "stop")]
    fn each_end_reads_and_writes_back(text: &str, want: RoundEnd, job: JobEnd) {
        let end: RoundEnd = text.parse().unwrap_or_else(|e: std::convert::Infallible| match e {});
        assert_eq!(end, want);
        assert_eq!(end.job_end(), job);
        assert_eq!(end.to_string(), text);
    }

    #[test_case("success:hang"; "success cannot hang")]
    #[test_case("stop:"; "stop without a run")]
    #[test_case("stop:x"; "stop of no number")]
    #[test_case("abort:h#1#2"; "abort without a signal")]
    #[test_case("abort::15"; "abort without a pod")]
    #[test_case("dead:"; "dead without a pod")]
    #[test_case("regroup:soon"; "a newer agent's end")]
    #[test_case(""; "empty")]
    fn other_text_is_kept_as_written_and_regroups(text: &str) {
        let end = RoundEnd::read(text);
        assert_eq!(end, other(text));
        assert_eq!(end.job_end(), JobEnd::Regroup { planned: true });
        assert_eq!(end.to_string(), text);
        assert!(!end.is_hang() && !end.is_stop());
    }

    #[test]
    fn a_store_value_reads_as_its_text_and_bad_utf8_as_other_text() {
        assert_eq!(RoundEnd::from_bytes(b"stop:12"), RoundEnd::Stop(12));
        assert_eq!(RoundEnd::from_bytes(b"dead:\xffx"), RoundEnd::Dead("\u{fffd}x".into()));
        assert_eq!(RoundEnd::from_bytes(b"\xfe"), other("\u{fffd}"));
    }

    #[test]
    fn only_a_failure_hangs_and_only_a_stop_stops() {
        assert!(RoundEnd::Failure { fatal: true, hang: true }.is_hang());
        assert!(!RoundEnd::Failure { fatal: false, hang: false }.is_hang());
        assert!(RoundEnd::Stop(3).is_stop());
        assert!(!RoundEnd::Abort { uid: "stop".into(), signal: 3 }.is_stop());
    }
}
