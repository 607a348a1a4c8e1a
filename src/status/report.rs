//! The `trainerStatus` object: parsed from what a worker posts, bounded
//! to what Trainer's TrainJob schema accepts (progress 0-100, an int32
//! ETA >= 0, at most 256 metrics whose names and values are 1-64
//! characters), and merged with trainlet's own facts.

use serde::{Deserialize, Serialize};

/// Most metrics Trainer accepts in one status.
pub const MAX_METRICS: usize = 256;
/// Longest metric name or value Trainer accepts, in characters.
pub const MAX_TEXT: usize = 64;

/// One metric, as Trainer's API has it: both strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metric {
    /// `loss`, `trainlet.restarts`, ...
    pub name: String,
    /// Its value, as text.
    pub value: String,
}

/// A `trainerStatus` object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// How complete the job is, 0-100.
    #[serde(rename = "progressPercentage", skip_serializing_if = "Option::is_none")]
    pub progress: Option<u8>,
    /// Estimated seconds left.
    #[serde(rename = "estimatedRemainingSeconds", skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u32>,
    /// Named values.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metrics: Vec<Metric>,
    /// When this was observed (RFC 3339); Trainer requires it.
    #[serde(rename = "lastUpdatedTime", skip_serializing_if = "Option::is_none")]
    pub updated: Option<String>,
}

/// trainlet's own facts about the job, reported as `trainlet.*` metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// Job-wide restarts so far.
    pub restarts: u32,
    /// The current rendezvous round.
    pub round: u64,
    /// Workers in the current round.
    pub world_size: u32,
    /// The last failure, e.g. `rank 3 exit code 1`.
    pub last_failure: Option<String>,
    /// A job with spares: those waiting now, and the takeovers so far.
    pub spares: Option<(u64, u64)>,
    /// The ranks named stragglers now, e.g. `rank 3 (pod-1): the others
    /// wait for it 31% of the time` (None: none named yet).
    pub stragglers: Option<String>,
}

/// `text` cut to [`MAX_TEXT`] characters.
fn clip(text: &str) -> String {
    text.chars().take(MAX_TEXT).collect()
}

/// A metric value as text: strings as they are, numbers as JSON writes them.
fn value_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Parse a worker's POST body, `{"trainerStatus": {...}}`. Out-of-range
/// numbers are clamped, metrics without a usable name or value are
/// dropped, texts are cut to 64 characters and the list to 256.
pub fn parse(body: &[u8]) -> Result<Status, String> {
    let doc: serde_json::Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let ts = doc.get("trainerStatus").filter(|t| t.is_object()).ok_or("no trainerStatus object")?;
    let number = |key: &str| ts.get(key).and_then(serde_json::Value::as_f64).filter(|f| f.is_finite());
    let progress = number("progressPercentage").map(|p| {
        // Clamped to 0-100 first, so the cast cannot truncate.
        #[expect(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "clamped to 0..=100")]
        let p = p.clamp(0.0, 100.0) as u8;
        p
    });
    let remaining = number("estimatedRemainingSeconds").map(|r| {
        #[expect(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "clamped to the int32 range")]
        let r = r.clamp(0.0, f64::from(i32::MAX)) as u32;
        r
    });
    let mut metrics = Vec::new();
    for m in ts.get("metrics").and_then(serde_json::Value::as_array).into_iter().flatten() {
        let name = m.get("name").and_then(serde_json::Value::as_str).map(str::trim).unwrap_or_default();
        let value = m.get("value").and_then(value_text).unwrap_or_default();
        if name.is_empty() || value.is_empty() || metrics.len() == MAX_METRICS {
            continue;
        }
        metrics.push(Metric { name: clip(name), value: clip(&value) });
    }
    let updated = ts.get("lastUpdatedTime").and_then(serde_json::Value::as_str).map(clip);
    Ok(Status { progress, remaining, metrics, updated })
}

/// One view of the job from every rank's newest report of the current
/// round: global rank 0's (the rank transformers reports from, and the one
/// a user reads first) when it has one, else the least advanced rank's
/// (the lowest progress; reports without a progress only when none has
/// one), ties to the lowest rank. Never a mix of two reports: progress, ETA
/// and metrics come from one worker.
pub fn job_view<'a>(ranks: impl IntoIterator<Item = (u32, &'a Status)>) -> Option<&'a Status> {
    let ranks: std::collections::BTreeMap<u32, &Status> = ranks.into_iter().collect();
    if let Some(zero) = ranks.get(&0) {
        return Some(zero);
    }
    let with_progress = ranks.values().filter(|s| s.progress.is_some()).min_by_key(|s| s.progress);
    with_progress.or_else(|| ranks.values().next()).copied()
}

/// What trainlet posts: the workers' latest status (if any), its metrics
/// other than `trainlet.*` ones, then trainlet's facts, observed now.
pub fn merge(latest: Option<&Status>, facts: &Facts, now_us: u64) -> Status {
    let mut own = vec![
        Metric { name: "trainlet.restarts".into(), value: facts.restarts.to_string() },
        Metric { name: "trainlet.round".into(), value: facts.round.to_string() },
        Metric { name: "trainlet.world_size".into(), value: facts.world_size.to_string() },
    ];
    if let Some(f) = &facts.last_failure {
        own.push(Metric { name: "trainlet.last_failure".into(), value: clip(f) });
    }
    if let Some(s) = &facts.stragglers {
        own.push(Metric { name: "trainlet.stragglers".into(), value: clip(s) });
    }
    if let Some((waiting, takeovers)) = facts.spares {
        own.push(Metric { name: "trainlet.spares_waiting".into(), value: waiting.to_string() });
        own.push(Metric { name: "trainlet.spare_takeovers".into(), value: takeovers.to_string() });
    }
    let mut metrics: Vec<Metric> = latest
        .map(|s| s.metrics.iter().filter(|m| !m.name.starts_with("trainlet.")).cloned().collect())
        .unwrap_or_default();
    metrics.truncate(MAX_METRICS - own.len());
    metrics.extend(own);
    Status {
        progress: latest.and_then(|s| s.progress),
        remaining: latest.and_then(|s| s.remaining),
        metrics,
        updated: Some(crate::clock::rfc3339(now_us)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transformers_body_parses() {
        let body = br#"{"trainerStatus": {"lastUpdatedTime": "2026-11-23T10:00:00+00:00", "progressPercentage": 42,
            "estimatedRemainingSeconds": 17, "metrics": [{"name": "loss", "value": "0.5"}, {"name": "current_step", "value": "21"}]}}"#;
        let s = parse(body).expect("parse");
        assert_eq!((s.progress, s.remaining), (Some(42), Some(17)));
        assert_eq!(s.metrics[0], Metric { name: "loss".into(), value: "0.5".into() });
        assert_eq!(s.updated.as_deref(), Some("2026-11-23T10:00:00+00:00"));
    }

    #[test]
    fn hostile_values_are_bounded() {
        let long = "x".repeat(500);
        let many: Vec<String> = (0..400).map(|i| format!(r#"{{"name": "m{i}", "value": {i}}}"#)).collect();
        let body = format!(
            r#"{{"trainerStatus": {{"progressPercentage": 1e9, "estimatedRemainingSeconds": -5,
            "metrics": [{{"name": "{long}", "value": "{long}"}}, {{"name": "", "value": "1"}}, {{"name": "n", "value": null}}, {}]}}}}"#,
            many.join(",")
        );
        let s = parse(body.as_bytes()).expect("parse");
        assert_eq!((s.progress, s.remaining), (Some(100), Some(0)));
        assert_eq!(s.metrics.len(), MAX_METRICS);
        assert_eq!(s.metrics[0].name.chars().count(), MAX_TEXT);
        assert!(s.metrics.iter().all(|m| !m.name.is_empty() && !m.value.is_empty()));
        assert!(parse(b"[]").is_err() && parse(b"{\"trainerStatus\": 3}").is_err() && parse(b"\xff").is_err());
    }

    fn at(p: Option<u8>, tag: &str) -> Status {
        Status { progress: p, metrics: vec![Metric { name: "from".into(), value: tag.into() }], ..Status::default() }
    }

    #[test_case::test_case(&[], None; "no reports")]
    #[test_case::test_case(&[(0, Some(8), "r0"), (1, Some(50), "r1"), (3, Some(4), "r3")], Some("r0"); "rank 0 speaks for the job")]
    #[test_case::test_case(&[(0, None, "r0"), (1, Some(50), "r1")], Some("r0"); "rank 0 even without progress")]
    #[test_case::test_case(&[(2, Some(50), "r2"), (1, Some(40), "r1"), (3, Some(60), "r3")], Some("r1"); "else the least advanced")]
    #[test_case::test_case(&[(2, Some(40), "r2"), (1, Some(40), "r1")], Some("r1"); "ties to the lowest rank")]
    #[test_case::test_case(&[(1, None, "r1"), (2, Some(90), "r2")], Some("r2"); "a progress beats none")]
    #[test_case::test_case(&[(3, None, "r3"), (2, None, "r2")], Some("r2"); "none has progress: the lowest rank")]
    fn the_job_view(reports: &[(u32, Option<u8>, &str)], want: Option<&str>) {
        let statuses: Vec<(u32, Status)> = reports.iter().map(|(r, p, t)| (*r, at(*p, t))).collect();
        let view = job_view(statuses.iter().map(|(r, s)| (*r, s)));
        assert_eq!(view.map(|s| s.metrics[0].value.as_str()), want);
    }

    #[test]
    fn merging_keeps_the_workers_view_and_adds_trainlets_facts_last() {
        let worker = Status {
            progress: Some(50),
            remaining: Some(9),
            metrics: (0..MAX_METRICS)
                .map(|i| Metric {
                    name: if i == 0 { "trainlet.restarts".into() } else { format!("m{i}") },
                    value: "1".into(),
                })
                .collect(),
            updated: None,
        };
        let facts = Facts {
            restarts: 2,
            round: 3,
            world_size: 8,
            last_failure: Some("rank 1 exit code 3".into()),
            spares: None,
            stragglers: None,
        };
        let s = merge(Some(&worker), &facts, 1_795_369_936_000_000);
        assert_eq!((s.progress, s.remaining), (Some(50), Some(9)));
        assert_eq!(s.metrics.len(), MAX_METRICS);
        let restarts: Vec<&Metric> = s.metrics.iter().filter(|m| m.name == "trainlet.restarts").collect();
        assert_eq!(restarts.len(), 1, "a worker cannot forge trainlet's facts");
        assert_eq!(restarts[0].value, "2");
        assert_eq!(s.metrics.last().map(|m| m.value.as_str()), Some("rank 1 exit code 3"));
        assert_eq!(s.updated.as_deref(), Some("2026-11-22T17:52:16Z"));
        let slow = Facts { stragglers: Some("rank 3 (pod-1): 31%".into()), ..Facts::default() };
        let named = merge(None, &slow, 0);
        assert!(named.metrics.iter().any(|m| m.name == "trainlet.stragglers" && m.value == "rank 3 (pod-1): 31%"));
        let alone = merge(None, &Facts::default(), 0);
        assert_eq!((alone.progress, alone.metrics.len()), (None, 3));
        let spares = merge(None, &Facts { spares: Some((1, 2)), ..Facts::default() }, 0);
        let named: Vec<(&str, &str)> = spares.metrics.iter().map(|m| (m.name.as_str(), m.value.as_str())).collect();
        assert_eq!(&named[3..], [("trainlet.spares_waiting", "1"), ("trainlet.spare_takeovers", "2")]);
    }
}
