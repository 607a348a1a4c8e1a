//! Lanes: several actors at once on the same warm pods.
//!
//! The pods' main run (`crate::serve::pod`) is one run at a time. An actor
//! submitted while the main run holds some of the pods' worker slots, and
//! that fits in the slots left, runs in a lane of its own: on every pod
//! the pod's agent starts a lane agent ([`agents`]), trainlet itself again
//! with `TRAINLET_LANE` (`crate::config::Lane`), which dials the pod's
//! store, meets the lane's other agents in a rendezvous of its own (its
//! own rounds, worker store and process group), and runs the actor on
//! its slots (`nproc` workers, the GPUs of those slots) until the actor is
//! over. A lane agent is an ordinary agent in serve mode: survivors mode,
//! setup steps, the cache, restarts and calls work as for the main run,
//! and a failure, restart or regroup of one lane never touches another.
//!
//! The control API ([`host`]) places each submission ([`place`]), keeps
//! the list of open lanes in the store (`serve/lanes`, sealed, with a
//! wake-up key per version) and serves each lane's rounds. The lane agent
//! on the store host's pod tells the host's board how its run moves
//! ([`relay`]); every lane agent's link to its pod's agent tells that
//! agent when it is gone.
//!
//! | key | written by | meaning |
//! |---|---|---|
//! | `serve/lanes` | the control API | the open lanes ([`Record`], JSON, sealed) |
//! | `serve/lanes/v/<version>` | the control API | version `version` of the record is out (a wake-up only) |
//! | `serve/lane/<seq>/run` | the control API | the run of lane `seq` (sealed as a run) |

pub mod agents;
pub mod host;
pub mod relay;

use serde::{Deserialize, Serialize};

use super::{Link, Scope, kind, seal, unseal};

/// Most lanes open at once (a pod with that many worker slots).
pub const MAX_LANES: usize = 64;

/// One open lane: its run and the slots it takes on every pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// The run (actor) it serves.
    pub seq: u64,
    /// Workers per pod.
    pub nproc: u32,
    /// First worker slot.
    pub first: u32,
}

/// The open lanes, as the control API publishes them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// Bumped on every change.
    pub version: u64,
    /// The lanes.
    pub lanes: Vec<Entry>,
}

impl Link {
    /// The open lanes (None when none was ever published); Err(why) inside
    /// when the record is not sealed with `token` for `scope`.
    pub async fn lanes(&mut self, token: &str, scope: &Scope) -> Result<Option<Result<Record, String>>, super::Error> {
        let raw = self.get(&self.keys.lanes()).await?;
        if raw.is_empty() {
            return Ok(None);
        }
        Ok(Some(
            unseal(token, scope, kind::LANES, 0, &raw)
                .map_err(|why| format!("the lanes record: {why}"))
                .and_then(|v| serde_json::from_slice::<Record>(v).map_err(|e| format!("the lanes record: {e}")))
                .and_then(|r| {
                    if r.lanes.len() > MAX_LANES {
                        Err(format!("the lanes record lists {} lanes (at most {MAX_LANES})", r.lanes.len()))
                    } else {
                        Ok(r)
                    }
                }),
        ))
    }

    /// Publish `record`, then its wake-up.
    pub async fn set_lanes(&mut self, token: &str, scope: &Scope, record: &Record) -> Result<(), super::Error> {
        let json = serde_json::to_vec(record).map_err(|e| super::Error::Corrupt(e.to_string()))?;
        self.set(&self.keys.lanes(), &seal(token, scope, kind::LANES, 0, &json)).await?;
        self.set(&self.keys.lanes_wake(record.version), b"1").await
    }
}

/// What holds some of the pods' worker slots: a run or actor not over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The run's id.
    pub id: String,
    /// The actor's target, when it is one.
    pub actor: Option<String>,
    /// First slot.
    pub first: u32,
    /// Slots (workers per pod).
    pub nproc: u32,
    /// It runs in a lane (else it is the main run).
    pub lane: bool,
    /// It is being stopped: its slots are free once it is over.
    pub stopping: bool,
}

impl Held {
    fn named(&self) -> String {
        match &self.actor {
            Some(t) => format!("actor {} ({})", super::spec::shown(t), self.id),
            None => format!("run {}", self.id),
        }
    }
}

/// Where a submission goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// The main run, from this slot.
    Main(u32),
    /// A lane of its own, from this slot.
    Lane(u32),
}

/// Place a submission of `want` workers per pod on pods of `slots` worker
/// slots, beside what `held` (the runs not over) holds. Alone it takes
/// the main run from slot 0, whatever it asks (as many workers as it
/// likes). Beside others it needs `want` free slots in a row: an actor
/// beside the main run gets a lane; a run (not an actor) beside the main
/// run is refused, as is anything that does not fit (the message names
/// what holds the slots).
pub fn place(slots: u32, held: &[Held], want: u32, actor: bool) -> Result<Place, String> {
    let main = held.iter().find(|h| !h.lane);
    if let (Some(m), false) = (main, actor) {
        return Err(format!(
            "{} is not over; pass \"replace\": true to stop it and start this one (only actors run beside it)",
            m.named()
        ));
    }
    if held.is_empty() {
        return Ok(Place::Main(0));
    }
    // The lowest free run of `want` slots starts at 0 or where a holder's ends.
    let overlaps = |first: u32, end: u32| held.iter().any(|h| first < h.first.saturating_add(h.nproc) && h.first < end);
    let free = std::iter::once(0)
        .chain(held.iter().map(|h| h.first.saturating_add(h.nproc)))
        .filter(|&first| first.checked_add(want).is_some_and(|end| end <= slots && !overlaps(first, end)))
        .min();
    match free {
        Some(first) if main.is_some() => Ok(Place::Lane(first)),
        Some(first) => Ok(Place::Main(first)),
        None => {
            let holders: Vec<String> = held
                .iter()
                .map(|h| format!("{} holds slots {}..{}", h.named(), h.first, h.first.saturating_add(h.nproc)))
                .collect();
            Err(format!(
                "{want} workers per pod do not fit beside what runs now (the pods have {slots} worker slots each): {}; close one, or ask for fewer workers per pod (nproc_per_node)",
                holders.join(", ")
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: &str, first: u32, nproc: u32, lane: bool) -> Held {
        Held { id: id.into(), actor: Some("m:T".into()), first, nproc, lane, stopping: false }
    }

    #[test]
    fn submissions_are_placed_in_free_slots_or_refused_naming_the_holders() {
        let main = held("run-1-a", 0, 1, false);
        let lane = held("run-2-b", 1, 2, true);
        // Alone: the main run, whatever it asks.
        assert_eq!(place(2, &[], 8, false), Ok(Place::Main(0)));
        assert_eq!(place(2, &[], 1, true), Ok(Place::Main(0)));
        // An actor beside the main run: a lane in the first free slots.
        assert_eq!(place(4, std::slice::from_ref(&main), 2, true), Ok(Place::Lane(1)));
        assert_eq!(place(4, &[main.clone(), lane.clone()], 1, true), Ok(Place::Lane(3)));
        // The main run is over, a lane is not: the main run again, around the lane.
        assert_eq!(place(4, std::slice::from_ref(&lane), 1, true), Ok(Place::Main(0)));
        assert_eq!(place(4, std::slice::from_ref(&lane), 1, false), Ok(Place::Main(0)));
        assert_eq!(place(4, &[held("run-3-c", 0, 2, true)], 2, false), Ok(Place::Main(2)));
        // No room: the holders are named.
        let full = place(3, &[main.clone(), lane.clone()], 1, true).expect_err("full");
        assert!(full.contains(r#"actor "m:T" (run-1-a) holds slots 0..1"#), "{full}");
        assert!(full.contains(r#"actor "m:T" (run-2-b) holds slots 1..3"#), "{full}");
        assert!(full.contains("3 worker slots each"), "{full}");
        // Free slots, but not in a row.
        let gaps = [held("a", 0, 1, false), held("b", 2, 1, true)];
        assert!(place(4, &gaps, 2, true).is_err());
        assert_eq!(place(4, &gaps, 1, true), Ok(Place::Lane(1)));
        // A run (not an actor) beside the main run.
        let run = place(8, std::slice::from_ref(&main), 1, false).expect_err("a run beside");
        assert!(run.contains("replace") && run.contains("run-1-a"), "{run}");
        // A main run that took more than the pods have leaves nothing.
        assert!(place(2, &[held("x", 0, 8, false)], 1, true).is_err());
        assert!(place(u32::MAX, &[held("x", 0, 1, false)], u32::MAX, true).is_err(), "no overflow");
    }
}
