//! A call as a driver sends it (`POST /v1/actors/{id}/calls`), parsed
//! within bounds (its body, and the wait it asks for), and the bytes that
//! the calls not over may hold.
//!
//! The body's arguments are kept as the text they came as and its ranks
//! are capped while they are read ([`crate::serve::bounded`]): a call's
//! body parses into little more than its own bytes. Every call not over
//! holds its encoded arguments (in its driving task, in the agents' store,
//! in each pod's bridge) until it is answered, so that those bytes are
//! bounded too, per actor ([`PER_ACTOR`]) and for the job ([`PER_JOB`],
//! every actor together), as the lengths of the calls' bodies (known
//! before a body is parsed, and more than what it holds once parsed): a
//! call past either is refused 503 with the bound named (as one past the
//! count of calls not over: clients retry a 503), before its body is
//! parsed, and changes nothing. No I/O here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Encoding;
use crate::http::{Request, Status};
use crate::serve::bounded;
use crate::serve::spec::shown;

/// Default and longest wait of a call request.
const WAIT_DEFAULT: f64 = 30.0;
const WAIT_MAX: f64 = 300.0;
/// Most bytes of a call's encoded arguments (the store takes values of
/// 8 MiB at most, the operation's envelope included).
pub(super) const MAX_ARGS: usize = 7 * 1024 * 1024;
/// Most ranks a call may name.
const MAX_RANKS: usize = 65_536;
/// Most bytes of the bodies of one actor's calls not over.
pub(super) const PER_ACTOR: usize = 64 * 1024 * 1024;
/// Most bytes of the bodies of all actors' calls not over.
pub(super) const PER_JOB: usize = 128 * 1024 * 1024;

/// A call as a driver sends it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    method: String,
    #[serde(default)]
    args: Option<Box<RawValue>>,
    #[serde(default)]
    kwargs: Option<Box<RawValue>>,
    #[serde(default)]
    pickle: Option<String>,
    #[serde(default, deserialize_with = "ranks")]
    ranks: Option<Vec<u32>>,
}

fn ranks<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
    bounded::option_seq(d, MAX_RANKS, "ranks")
}

/// A call's content, checked.
#[derive(Debug)]
pub(super) struct Spec {
    /// The method's name.
    pub method: String,
    /// How `args` is encoded.
    pub encoding: Encoding,
    /// The encoded arguments.
    pub args: String,
    /// The ranks that run it, ascending and distinct (every rank: None).
    pub ranks: Option<Vec<u32>>,
}

/// What a call whose body is `body` counts against the bounds of the
/// calls not over, known before the body is parsed: its length, and room
/// for the envelope its arguments are given (`{"args":[],"kwargs":{}}`
/// when it has none). Its encoded arguments, method and ranks are less.
pub(super) fn held_by(body: &[u8]) -> usize {
    body.len() + 64
}

/// Parse and check a call's body (all but its ranks against the actor's
/// world); a refusal is its status and message.
pub(super) fn parse(body: &[u8]) -> Result<Spec, (Status, String)> {
    let bad = |why: String| (Status::BAD, why);
    let body: Body = serde_json::from_slice(body).map_err(|e| bad(format!("the body is not a valid call: {e}")))?;
    let method_ok = !body.method.is_empty()
        && body.method.len() <= 256
        && body.method.chars().all(|c| c.is_alphanumeric() || c == '_')
        && (!body.method.starts_with('_') || body.method == "__call__");
    if !method_ok {
        return Err(bad(format!("method: {} is not the name of a public method", shown(&body.method))));
    }
    let (args, kwargs) = (body.args.as_deref(), body.kwargs.as_deref());
    // Refused for its size before the arguments are copied.
    let size = body.pickle.as_ref().map_or_else(|| bounded::encoded_len(args, kwargs), String::len);
    if size > MAX_ARGS {
        return Err((Status::TOO_LARGE, format!("the arguments are {size} bytes encoded, at most {MAX_ARGS}")));
    }
    let (encoding, args) = match body.pickle {
        Some(p) if bounded::empty(args) && bounded::empty(kwargs) => {
            if let Err(e) = data_encoding::BASE64.decode(p.as_bytes()) {
                return Err(bad(format!("pickle: not base64 ({e})")));
            }
            (Encoding::Pickle, p)
        }
        Some(_) => return Err(bad("give either pickle or args/kwargs, not both".into())),
        None => (Encoding::Json, bounded::arguments(args, kwargs, "").map_err(bad)?),
    };
    if let Some(r) = &body.ranks
        && r.is_empty()
    {
        return Err(bad(format!("ranks: no rank; give 1 to {MAX_RANKS}, or none for every rank")));
    }
    let ranks = body.ranks.map(|mut r| {
        r.sort_unstable();
        r.dedup();
        r
    });
    Ok(Spec { method: body.method, encoding, args, ranks })
}

/// `?wait=S`, bounded.
pub(super) fn wait_of(req: &Request) -> Duration {
    let s = req
        .query
        .split('&')
        .find_map(|kv| kv.strip_prefix("wait="))
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
        .unwrap_or(WAIT_DEFAULT);
    Duration::from_secs_f64(s.min(WAIT_MAX))
}

/// The bytes of the calls not over: per actor, and for the job.
#[derive(Debug)]
pub(super) struct Open {
    job: Arc<Semaphore>,
    actors: Mutex<HashMap<u64, Arc<Semaphore>>>,
}

/// A call's share of [`Open`], given back when it is dropped (the call is
/// over).
#[derive(Debug)]
pub(super) struct Share {
    _actor: OwnedSemaphorePermit,
    _job: OwnedSemaphorePermit,
}

impl Open {
    pub(super) fn new() -> Self {
        Self { job: Arc::new(Semaphore::new(PER_JOB)), actors: Mutex::default() }
    }

    /// `bytes` for a call of the actor of run `seq`, or why not (the bound
    /// it would pass, named).
    pub(super) fn take(&self, seq: u64, bytes: usize) -> Result<Share, String> {
        let n = u32::try_from(bytes).unwrap_or(u32::MAX);
        let actor = {
            let mut actors = self.actors.lock().unwrap_or_else(PoisonError::into_inner);
            // Actors whose calls are all over hold nothing: forgotten.
            actors.retain(|s, a| *s == seq || a.available_permits() < PER_ACTOR);
            Arc::clone(actors.entry(seq).or_insert_with(|| Arc::new(Semaphore::new(PER_ACTOR))))
        };
        let refused = |held: usize, bound: usize, whose: &str| {
            format!(
                "the calls of {whose} not over hold {held} bytes, and this one {bytes} more: \
                 at most {bound} together; try again once some are over"
            )
        };
        let held = |s: &Semaphore, bound: usize| bound.saturating_sub(s.available_permits());
        let Ok(a) = Arc::clone(&actor).try_acquire_many_owned(n) else {
            return Err(refused(held(&actor, PER_ACTOR), PER_ACTOR, "this actor"));
        };
        let Ok(j) = Arc::clone(&self.job).try_acquire_many_owned(n) else {
            return Err(refused(held(&self.job, PER_JOB), PER_JOB, "every actor of the job"));
        };
        Ok(Share { _actor: a, _job: j })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_keep_their_arguments_as_sent_and_refuse_what_is_not_a_call() {
        let s = parse(br#"{"method": "train", "args": [1, "x"], "kwargs": {"lr": 0.5}, "ranks": [3, 1, 3]}"#)
            .expect("a call");
        assert_eq!(s.args, r#"{"args":[1, "x"],"kwargs":{"lr": 0.5}}"#);
        assert_eq!((s.encoding, s.ranks.as_deref()), (Encoding::Json, Some([1, 3].as_slice())));
        assert!(held_by(br#"{"method": "m"}"#) > r#"{"args":[],"kwargs":{}}"#.len() + 1);
        let p = parse(br#"{"method": "m", "pickle": "gAR9lC4=", "args": []}"#).expect("pickle");
        assert_eq!((p.encoding, p.args.as_str()), (Encoding::Pickle, "gAR9lC4="));
        let many = format!(r#"{{"method": "m", "ranks": [{}0]}}"#, "0,".repeat(MAX_RANKS));
        for (body, status, says) in [
            (r#"{"method": "_x"}"#, 400, "not the name of a public method"),
            (r#"{"method": "m", "args": {"a": 1}}"#, 400, "args: a list of JSON values"),
            (r#"{"method": "m", "kwargs": [1]}"#, 400, "kwargs: an object"),
            (r#"{"method": "m", "pickle": "gA==", "args": [1]}"#, 400, "either pickle or args"),
            (r#"{"method": "m", "ranks": []}"#, 400, "ranks: no rank"),
            (many.as_str(), 400, "more than 65536 ranks"),
        ] {
            let (st, why) = parse(body.as_bytes()).expect_err(body);
            assert!(st.0 == status && why.contains(says), "{}: {st:?} {why}", &body[..body.len().min(80)]);
        }
    }

    #[test]
    fn open_calls_are_bounded_in_bytes_per_actor_and_per_job() {
        let open = Open::new();
        let third = PER_ACTOR / 3;
        let a: Vec<Share> = (0..3).map(|_| open.take(1, third).expect("within the actor's bound")).collect();
        let why = open.take(1, third).expect_err("past the actor's bound");
        assert!(why.contains("this actor") && why.contains(&PER_ACTOR.to_string()), "{why}");
        let b: Vec<Share> = (0..3).map(|_| open.take(2, third).expect("another actor")).collect();
        let why = open.take(3, PER_JOB - 6 * third + 1).expect_err("past the job's bound");
        assert!(why.contains("every actor of the job") && why.contains(&PER_JOB.to_string()), "{why}");
        drop(a);
        open.take(1, third).expect("given back once over");
        drop(b);
    }
}
