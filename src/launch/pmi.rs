//! `--framework mpi`: each round's PMI service on this pod (issue 29).
//! The ranks' key-value space is the round's, on the job's store; the
//! mapping is the agents' block layout (`nproc` ranks on each pod, in
//! node-rank order). What the service tells about the ranks is the
//! attempt's (`crate::supervise::mpi`).

use crate::config::{Framework, Plan};
use crate::mpi::pmi::fence::StoreFence;
use crate::mpi::pmi::node::WorldInfo;
use crate::mpi::pmi::round::{Link, kvsname};
use crate::rendezvous::{Round, Session};

/// The PMI service as a feature of the job's rounds (`--framework mpi`):
/// one per round, given to its ranks, stopped when the round ends.
#[derive(Debug, Default)]
pub(super) struct Pmi {
    /// The round's service, or why this pod cannot start its ranks.
    link: Option<Result<Link, String>>,
}

impl super::feature::Feature for Pmi {
    fn round_starts<'a>(&'a mut self, at: super::feature::Starting<'a>) -> super::feature::Hook<'a, Result<(), i32>> {
        self.link = (at.plan.framework == Framework::Mpi).then(|| start(at.session, at.round, at.plan));
        Box::pin(std::future::ready(Ok(())))
    }

    fn gives<'a>(&'a self, gifts: &mut super::feature::Gifts<'a>) {
        match &self.link {
            Some(Ok(link)) => gifts.pmi = Some(link),
            Some(Err(why)) => gifts.unstartable = gifts.unstartable.or(Some(why.as_str())),
            None => {}
        }
    }

    fn round_ends(&mut self, _succeeded: bool) -> super::feature::Hook<'_, ()> {
        self.link = None;
        Box::pin(std::future::ready(()))
    }
}

/// Start the round's service: its link, or why this pod cannot start its
/// ranks (no descriptors left), which the attempt records for each rank.
fn start(session: &Session, round: &Round, plan: &Plan) -> Result<Link, String> {
    let job = WorldInfo {
        kvsname: kvsname(&plan.run_id, round.number),
        size: round.nnodes * plan.nproc,
        first_rank: round.group_rank * plan.nproc,
        local: plan.nproc as usize,
        mapping: format!("(vector,(0,{},{}))", round.nnodes, plan.nproc),
    };
    let fence = StoreFence {
        dial: session.dial(),
        client: None,
        keys: session.pmi_keys(round.number),
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
