//! The agents' store stays the same size over any number of rounds: the
//! store host deletes the keys of past rounds (issue 53, finding 4). A
//! served job (tests/it/serve.rs's pods) runs one round per run; the keys
//! are read with trainlet's own client, the control token proven.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::serve::{Served, start};
use crate::serve_store::{submit, wait_over};

/// A run as small as a run gets: one worker per pod that exits 0.
const TRUE: &str = r#"{"command": ["true"], "nproc_per_node": 1}"#;

/// Every key of the store on 127.0.0.1:`port`, sorted (with `token`'s
/// handshake when the store asks for one).
pub(crate) fn store_keys(port: u16, token: Option<&Path>) -> Vec<String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let guard = token.map(trainlet::store::Guard::new);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let mut c = trainlet::store::Client::connect_guarded(addr, guard.as_ref()).await.expect("store client");
        let mut keys = c.list_keys().await.expect("LIST_KEYS");
        keys.sort();
        keys
    })
}

/// The keys with the numbers in them (rounds, runs, uids) blanked: what
/// kinds of keys the store holds, and how many of each.
pub(crate) fn shapes(keys: &[String]) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for k in keys {
        let shape: String = k
            .split('/')
            .map(|part| {
                if part.contains('#') {
                    "<uid>".to_string()
                } else if part.trim_start_matches('r').chars().all(|c| c.is_ascii_digit()) && !part.is_empty() {
                    if part.starts_with('r') { "r<N>".into() } else { "<N>".into() }
                } else {
                    part.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("/");
        *out.entry(shape).or_insert(0) += 1;
    }
    out
}

/// Run `n` runs one after the other; the store's keys once the pods wait
/// for the next.
fn runs(s: &Served, n: u32) {
    for _ in 0..n {
        let id = submit(s, TRUE);
        assert_eq!(wait_over(s, &id), "succeeded", "{}", s.pods[0].stderr());
    }
}

/// The store's keys once they stop changing (the pods are idle, the
/// store host has deleted what the new round lets go).
fn settled(s: &Served) -> Vec<String> {
    let mut last = store_keys(s.store_port, Some(&s.token_file));
    let start = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = store_keys(s.store_port, Some(&s.token_file));
        if now == last || start.elapsed() > Duration::from_secs(20) {
            return now;
        }
        last = now;
    }
}

/// Runs of a served job, each a round: the key count after the last run
/// is the one after the second (`TRAINLET_TEST_RUNS` runs, 200 by default).
#[test]
fn the_store_holds_as_many_keys_after_many_rounds_as_after_the_second() {
    let n: u32 = std::env::var("TRAINLET_TEST_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let s = start(2, &[]);
    runs(&s, 2);
    let early = settled(&s);
    let started = Instant::now();
    runs(&s, n - 2);
    let took = started.elapsed();
    let late = settled(&s);
    let rounds = late.iter().filter(|k| k.ends_with("/round")).count();
    eprintln!(
        "after run 2: {} keys; after run {n}: {} keys ({rounds} round counters; {} runs in {:.1} s, {:.0} ms a run)",
        early.len(),
        late.len(),
        n - 2,
        took.as_secs_f64(),
        took.as_secs_f64() * 1000.0 / f64::from(n - 2)
    );
    assert_eq!(
        late.len(),
        early.len(),
        "the store grew over {n} rounds:\nafter run 2: {:#?}\nafter run {n}: {:#?}",
        shapes(&early),
        shapes(&late)
    );
}
