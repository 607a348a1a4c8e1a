//! `--framework mpi`: each round's PMI service on this pod (issue 29).
//! The ranks' key-value space is the round's, on the job's store; the
//! mapping is the agents' block layout (`nproc` ranks on each pod, in
//! node-rank order). What the service tells about the ranks is the
//! attempt's (`crate::supervise::mpi`).

use crate::config::Plan;
use crate::pmi::fence::StoreFence;
use crate::pmi::node::Job;
use crate::pmi::round::{Link, kvsname};
use crate::rendezvous::{Round, Session};

/// Start the round's service: its link, or why this pod cannot start its
/// ranks (no descriptors left), which the attempt records for each rank.
pub(super) fn start(session: &Session, round: &Round, plan: &Plan) -> Result<Link, String> {
    let job = Job {
        kvsname: kvsname(&plan.run_id, round.number),
        size: round.nnodes * plan.nproc,
        first_rank: round.group_rank * plan.nproc,
        local: plan.nproc as usize,
        mapping: format!("(vector,(0,{},{}))", round.nnodes, plan.nproc),
    };
    let fence = StoreFence {
        dial: session.dial(),
        client: None,
        prefix: session.pmi_prefix(round.number),
        node: round.group_rank as usize,
        nnodes: round.nnodes as usize,
    };
    let link = Link::start(job, fence).map_err(|e| format!("cannot make the ranks' PMI sockets: {e}"))?;
    tracing::info!(
        round = round.number,
        kvsname = link.kvsname(),
        ranks = plan.nproc,
        first_rank = round.group_rank * plan.nproc,
        "serving PMI to this pod's MPI ranks on their PMI_FD"
    );
    Ok(link)
}
