//! The store host's part of `trainlet run`: the agents' store, the
//! rounds' worker stores and the liveness monitor.

use std::net::IpAddr;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::{Error, Result};
use crate::config::Plan;
use crate::rendezvous::host;
use crate::rendezvous::{self, Timing};
use crate::store::{Endpoint, StoreLoop};
use crate::sys;

/// The store as this pod reaches it, and what it serves when it hosts it.
pub(super) struct Hosted {
    /// Serve mode's control token file (None without `--serve`).
    pub token_file: Option<std::path::PathBuf>,
    /// What every connection to the agents' store must prove (serve mode).
    pub guard: Option<crate::store::Guard>,
    /// The agents' store, when this pod hosts it.
    pub control: Option<crate::store::StoreServer>,
    /// The endpoint this pod dials.
    pub endpoint: Endpoint,
    /// The store host's own dial of its store (loopback).
    pub host_dial: Option<crate::store::Dial>,
    /// The round service for rendezvous opened later (serve mode's lanes), on the store host.
    pub rounds: Option<host::Rounds>,
}

/// The store of the job: serve mode's control token (the agents' store
/// asks every connection for it), and, when this pod hosts it, the
/// agents' store with the rounds' worker stores and liveness monitor.
pub(super) fn store(plan: &Plan, timing: Timing, cancel: &CancellationToken) -> Result<Hosted> {
    let token_file = crate::serve::pod::token_file(plan)?;
    let guard = token_file.as_deref().map(crate::store::Guard::new);
    let (control, endpoint, rounds) = host_store(plan, guard.as_ref(), timing, cancel)?;
    let host_dial = control.as_ref().map(|_| crate::store::Dial {
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], endpoint.port)),
        guard: guard.clone(),
    });
    Ok(Hosted { token_file, guard, control, endpoint, host_dial, rounds })
}

/// Serve the agents' store when this pod hosts it, with the rounds' worker
/// stores and liveness monitor; the server, and the endpoint this pod
/// dials (the host dials its own store on loopback: its own DNS record may
/// not be published yet, as headless services publish late).
fn host_store(
    plan: &Plan,
    guard: Option<&crate::store::Guard>,
    timing: Timing,
    cancel: &CancellationToken,
) -> Result<(Option<crate::store::StoreServer>, Endpoint, Option<host::Rounds>)> {
    if !plan.serve_store {
        return Ok((None, plan.endpoint.clone(), None));
    }
    let bind_ip: Option<IpAddr> = plan.standalone.then_some(IpAddr::from([127, 0, 0, 1]));
    let lp = Arc::new(StoreLoop::start().map_err(Error::Os)?);
    // One memory budget for the agents' store and every worker store;
    // serve mode's guarded store has one of its own, so that a client of
    // an (open) worker store cannot fill the store the control API writes.
    let budget = Arc::new(crate::store::Budget::new(plan.store_memory));
    let agents_budget =
        if guard.is_some() { Arc::new(crate::store::Budget::new(plan.store_memory)) } else { Arc::clone(&budget) };
    sys::raise_nofile();
    let server = lp.serve_guarded(bind_ip, plan.endpoint.port, agents_budget, guard.cloned(), cancel.child_token())?;
    // A pod whose agent dies is seen at once: its heartbeat key reads
    // `lost` when its connection closes without a `bye`.
    server.state().tie(crate::keys::heartbeat_tie);
    tracing::info!(addr = %server.local_addr(), memory_budget = budget.limit(), "serving the rendezvous store");
    let port = server.local_addr().port();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let dial = crate::store::Dial { addr, guard: guard.cloned() };
    let make: host::MakeStore = Arc::new(move |token| lp.serve(bind_ip, 0, Arc::clone(&budget), token));
    let rounds = host::Rounds::new(dial, timing, make, Some(server.state().losses()));
    // Replica groups each meet on their own keys; this pod serves them all.
    let ids: Vec<String> = match &plan.groups {
        Some(g) => (0..g.count).map(|i| crate::config::group_rdzv_id(&plan.run_id, i)).collect(),
        None => vec![plan.run_id.clone()],
    };
    for id in ids {
        rounds.serve(rendezvous::job_base(&id, plan.jobset_attempt), cancel.child_token());
    }
    Ok((Some(server), Endpoint { host: "127.0.0.1".into(), port }, Some(rounds)))
}
