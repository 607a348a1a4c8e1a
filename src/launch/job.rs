//! One pod's job as phases ([`Job`]): [`Job::start`] (pre-flight checks,
//! metrics, the zygote, the log root, the JobSet's barrier, hosting the
//! store, joining), then for each round [`Job::next_round`],
//! [`Job::run_round`] and [`Job::settle`], and at the end
//! [`Job::finish`]. [`run`] drives them. The features
//! (`super::feature_list::list`) hear of each round's start and end and of the
//! job's end; serve mode (`crate::serve::pod`) is the loop's mode: it decides
//! what each round runs and keeps the pod past a run's verdict.

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::feature::{Feature, Gifts, Leaving, Starting};
use super::feature_list::Setup;
use super::finish::{Story, fail_code, forget_logs, record, report};
use super::round::{RoundPods, reconnect, stop_sync};
use super::wait::until_stop;
use super::{Error, Result, health, hosting, inplace, replicas, start};
use crate::config::{Env, Plan};
use crate::exit;
use crate::process::signals::SysEvent;
use crate::process::spawn::Spawner;
use crate::rendezvous::{self, Joined, Known, Round, Session};
use crate::serve::board::State as RunState;
use crate::serve::pod;
use crate::supervise::attempt::run_attempt;
use crate::supervise::carry::Carry;
use crate::supervise::policy::{Outcome, Verdict, backoff, verdict};
use crate::supervise::report::{Failure, root_cause};
use crate::supervise::round_end::RoundEnd;
use crate::supervise::worker::WorldView;
use crate::sys;

/// Bound on a last store write made while exiting.
const PUBLISH_WAIT: Duration = Duration::from_secs(2);
/// How long the store host waits for the other pods to read the outcome.
const LEAVE_WAIT: Duration = Duration::from_secs(10);
/// Most time between two restarts, whatever --restart-backoff says.
const BACKOFF_CAP: Duration = Duration::from_secs(300);
/// How often the GPUs are sampled for metrics.
const METRICS_EVERY: Duration = Duration::from_secs(5);

/// What a phase tells the loop.
enum Flow<T> {
    /// Go on with this.
    Go(T),
    /// On to the next round.
    Again,
    /// The job ends on this pod with this exit code.
    Exit(u8),
}

/// Run one phase: its value, or on to the next round, or out of the loop.
macro_rules! phase {
    ($e:expr) => {
        match $e {
            Flow::Go(v) => v,
            Flow::Again => continue,
            Flow::Exit(code) => break code,
        }
    };
}

/// The value of a phase's step, or return from the phase with its flow.
macro_rules! go {
    ($e:expr) => {
        match $e {
            Flow::Go(v) => v,
            Flow::Again => return Flow::Again,
            Flow::Exit(code) => return Flow::Exit(code),
        }
    };
}

/// Run the job described by `plan` on this pod; returns trainlet's exit
/// code. `in_place`: the pod's JobSet in-place restart agent, whose
/// barrier comes before the rendezvous; `evictor`: what asks this pod to
/// leave as a straggler's (`--evict-stragglers`).
pub(super) async fn run(
    plan: Plan,
    events: UnboundedReceiver<SysEvent>,
    helpers: (Option<&mut crate::inplace::InPlaceAgent>, Option<super::evict::Evictor>),
    cancel: CancellationToken,
) -> Result<u8> {
    let mut job = match Job::start(plan, events, helpers, cancel).await? {
        Ok(job) => job,
        Err(code) => return Ok(code),
    };
    let code = loop {
        let round = phase!(job.next_round().await);
        let ran = phase!(job.run_round(&round).await);
        phase!(job.settle(&round, ran).await);
    };
    job.finish(code).await
}

/// What one round did on this pod.
struct Ran {
    /// The round's plan (a served run's, in serve mode).
    plan: Plan,
    /// Restarts used, counted from the run's start.
    restarts: u32,
    /// The restarts used before the run started (serve mode).
    base_restarts: u32,
    outcome: Outcome,
    failures: Vec<Failure>,
}

/// What the pods decided about a round.
struct Decided<'a> {
    verdict: Verdict,
    /// A stop of the run (serve mode) ended the round.
    stopped: bool,
    /// Every pod's failures in the round.
    failures: &'a [Failure],
    /// The restarts used before the run started (serve mode).
    base_restarts: u32,
}

/// One pod's job between its start and its end.
struct Job {
    plan: Plan,
    events: UnboundedReceiver<SysEvent>,
    cancel: CancellationToken,
    spawner: Spawner,
    env: Env,
    log_root: PathBuf,
    /// Worker log files can be written.
    files_ok: bool,
    zygote: Option<std::sync::Arc<crate::supervise::zygote::Zygote>>,
    /// The agents' store, when this pod hosts it.
    control: Option<crate::store::StoreServer>,
    master_addr: String,
    session: Session,
    known: Known,
    features: Vec<Box<dyn Feature>>,
    served: Option<pod::Served>,
    story: Story,
    /// An actor's workers kept from one round to the next (survivors mode).
    carry: Carry,
    /// What ended the job on this pod, when not a code of its own: a stop
    /// signal (the pod is going away) or an error of the rendezvous.
    stop_sig: Option<i32>,
    failed: Option<Error>,
    /// The GPUs were checked since the pre-flight (rounds after the first check them again).
    checked: bool,
    /// Samples the GPUs for metrics until the job ends.
    _sampler: Option<crate::metrics::GpuSampler>,
}

impl Job {
    /// Everything before the first round: the pod's checks and helpers,
    /// the JobSet's barrier, the store (on its host), the rendezvous, and
    /// the features. Err(exit code) when the job ends before it joined.
    async fn start(
        mut plan: Plan,
        mut events: UnboundedReceiver<SysEvent>,
        (in_place, evictor): (Option<&mut crate::inplace::InPlaceAgent>, Option<super::evict::Evictor>),
        cancel: CancellationToken,
    ) -> Result<std::result::Result<Job, u8>> {
        let spawner = Spawner::start().map_err(Error::Os)?;
        tokio::spawn(crate::supervise::hang_read::serve_door(cancel.child_token()));
        if let Some(addr) = plan.gpu.metrics_addr {
            crate::metrics::serve(addr, cancel.child_token())
                .await
                .map_err(|e| Error::Config(crate::config::Error::Usage(crate::error::error_chain(&e))))?;
        }
        if let Some(code) = start::preflight(&mut plan, &spawner).await {
            return Ok(Err(code));
        }
        // The imports overlap the rendezvous: started before the pod joins.
        let zygote = match &plan.preload {
            Some(p) => Some(crate::supervise::zygote::Zygote::start(&spawner, &p.python, &p.modules).await),
            None => None,
        };
        // Stopped (its NVML child killed) when the job ends.
        let sampler = start::gpu_sampler(&plan, &spawner, METRICS_EVERY);
        crate::process::oom::warn_if_group_kill(&plan.gpu.root);
        let (log_root, files_ok) = start::log_files(&plan)?;
        // JobSet's barrier: every pod wrote the same in-place restart attempt.
        if let Some(code) = inplace::barrier(in_place, &mut events, &plan).await? {
            return Ok(Err(code));
        }
        let timing = start::timing(&plan);
        // Serve mode's control token; the agents' store (and the rounds' worker stores), when this pod hosts it.
        let hosting::Hosted { token_file, guard, control, endpoint, host_dial, rounds } =
            hosting::store(&plan, timing, &cancel)?;
        let mut replicas = replicas::Replicas::start(&plan, &spawner, host_dial, &cancel);
        let master_addr = if plan.standalone { endpoint.host.clone() } else { plan.endpoint.host.clone() };
        let mut session = match start::join(&plan, (&endpoint, guard), timing, &mut events, &cancel).await {
            Ok(s) => s,
            Err(out) => {
                replicas.stop().await;
                return out.map(Err);
            }
        };
        if let Err(out) = replicas.joined(&plan, (&session.dial(), &endpoint), &mut events).await {
            session.bye().await;
            replicas.stop().await;
            return out.map(Err);
        }
        let setup = Setup { plan: &plan, dial: session.dial(), log_root: &log_root, cancel: &cancel, evictor };
        let features = super::feature_list::list(setup, replicas).await;
        let served = pod::Served::start(&plan, (session.dial(), &spawner), (token_file, rounds), &cancel).await?;
        Ok(Ok(Job {
            env: Env::from_process(),
            plan,
            events,
            cancel,
            spawner,
            log_root,
            files_ok,
            zygote,
            control,
            master_addr,
            session,
            known: Known::default(),
            features,
            served,
            story: Story::default(),
            carry: Carry::default(),
            stop_sig: None,
            failed: None,
            checked: false,
            _sampler: sampler,
        }))
    }

    /// Wait for the next round: it formed, or the job ended, or the store went (wait for it to
    /// come back), or a stop signal came; a spare checks its health again on its way.
    async fn next_round(&mut self) -> Flow<Round> {
        let gpus = std::mem::replace(&mut self.checked, true);
        if let Some(code) = health::before_round(&self.plan, &self.spawner, gpus).await {
            self.carry.stop(self.plan.grace).await;
            self.session.bye().await;
            return Flow::Exit(code);
        }
        let deadline = Instant::now() + self.plan.join_timeout;
        let waited = Instant::now();
        let next = self.session.next_round(&mut self.known, deadline);
        let next = pod::kept_until(next, &mut self.carry, self.served.as_mut(), self.plan.grace);
        match until_stop(&mut self.events, &self.plan, next).await {
            Ok(Ok(Joined::Round(r))) => {
                crate::metrics::global().rendezvous.observe(waited.elapsed().as_secs_f64());
                Flow::Go(r)
            }
            Ok(Ok(Joined::Spare)) => Flow::Again,
            Ok(Ok(Joined::JobEnded(v)))
                if self.plan.in_place.is_some() && self.known.round.is_none() && v != Verdict::Success =>
            {
                let (s, p, e, c) = (&mut self.session, &self.plan, &mut self.events, &self.cancel);
                match inplace::outwait_stale_store(s, p, v, e, c).await {
                    Ok(()) => Flow::Again,
                    Err(code) => Flow::Exit(code),
                }
            }
            Ok(Ok(Joined::JobEnded(v))) => {
                tracing::info!(verdict = %v, "the job ended while this pod waited as a spare");
                Flow::Exit(if v == Verdict::Success { exit::SUCCESS } else { exit::PEER_LOST })
            }
            Ok(Err(rendezvous::Error::Lost { source, .. })) => {
                self.reconnect(&crate::error::error_chain(&source)).await
            }
            Ok(Err(e @ rendezvous::Error::Mismatch(_))) => {
                // Every member reads the same assignment; the store host lingers so that all of them can.
                if self.plan.serve_store {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Flow::Exit(self.fail(e))
            }
            Ok(Err(e)) => {
                self.session.bye().await;
                Flow::Exit(self.fail(e))
            }
            Err(sig) => {
                self.announce_stop(sig).await;
                self.session.withdraw().await;
                self.session.bye().await;
                self.stop_sig = Some(sig);
                Flow::Exit(exit::for_signal(sig))
            }
        }
    }

    /// The rendezvous failed this way: its exit code.
    fn fail(&mut self, e: rendezvous::Error) -> u8 {
        let code = e.exit_code();
        self.failed = Some(e.into());
        code
    }

    /// The store went away (`cause`): wait for it to come back, then on to the next round.
    async fn reconnect<T>(&mut self, cause: &str) -> Flow<T> {
        let before_any_round = self.plan.in_place.is_some() && self.known.round.is_none();
        match reconnect(&mut self.session, &self.plan, &mut self.events, &self.cancel, (cause, before_any_round)).await
        {
            Ok(()) => Flow::Again,
            Err(code) => Flow::Exit(code),
        }
    }

    /// This pod is stopped by `sig`: the store host tells the other pods (and every feature its own) why.
    async fn announce_stop(&mut self, sig: i32) {
        if !self.plan.serve_store {
            return;
        }
        let why = format!("stopped by {}", sys::signal_name(sig));
        self.session.announce_leaving(&why).await;
        for f in &mut self.features {
            f.stopping(&self.plan, &why).await;
        }
    }

    /// Run this pod's part of `round`: in serve mode the current run, or
    /// an idle wait for one; otherwise the job's workers.
    async fn run_round(&mut self, round: &Round) -> Flow<Ran> {
        let (plan, idle) = match self.served.as_mut() {
            Some(sv) => match sv.work((&self.session, round), &mut self.events, &mut self.carry, &self.plan).await {
                pod::Work::Run => (sv.plan_for(&self.plan), None),
                pod::Work::Idle(o) => (sv.idle_plan(&self.plan), Some(o)),
                pod::Work::Shutdown => {
                    let _ = self.session.leave(round, self.plan.serve_store, LEAVE_WAIT).await;
                    self.session.bye().await;
                    return Flow::Exit(exit::SUCCESS);
                }
            },
            None => (self.plan.clone(), None),
        };
        let base_restarts = self.served.as_ref().map_or(0, pod::Served::base_restarts);
        let restarts = round.restarts.saturating_sub(base_restarts);
        let (outcome, failures) = match idle {
            Some(o) => {
                self.carry.kill("the pods are idle");
                crate::process::sweep::between_rounds("the pods are idle");
                (o, Vec::new())
            }
            None => go!(self.workers(round, &plan, restarts).await),
        };
        for f in &mut self.features {
            f.round_ends(outcome == Outcome::Succeeded).await;
        }
        if let Some(sv) = &self.served {
            sv.flush().await;
        }
        tracing::info!(round = round.number, ?outcome, local_failures = failures.len(), "round over on this pod");
        Flow::Go(Ran { plan, restarts, base_restarts, outcome, failures })
    }

    /// Start this pod's workers for `round` and supervise them to the end.
    async fn workers(&mut self, round: &Round, plan: &Plan, restarts: u32) -> Flow<(Outcome, Vec<Failure>)> {
        tracing::info!(
            round = round.number,
            group_rank = round.group_rank,
            nnodes = round.nnodes,
            world_size = round.nnodes * plan.nproc,
            restarts_used = restarts,
            restarts_left = plan.max_restarts.saturating_sub(restarts),
            master_addr = %self.master_addr,
            master_port = round.worker_port,
            "starting workers"
        );
        for f in &mut self.features {
            let at =
                Starting { plan, round, session: &mut self.session, spawner: &self.spawner, events: &mut self.events };
            if let Err(sig) = f.round_starts(at).await {
                let _ = tokio::time::timeout(PUBLISH_WAIT, self.session.publish_abort(round.number, sig)).await;
                self.session.bye().await;
                self.stop_sig = Some(sig);
                return Flow::Exit(exit::for_signal(sig));
            }
        }
        let served = self.served.as_ref();
        if let Some(sv) = served {
            sv.started(round, restarts, plan.nproc);
        }
        let mut gifts = Gifts::default();
        for f in &self.features {
            f.gives(&mut gifts);
        }
        let world = WorldView {
            plan,
            master_addr: &self.master_addr,
            master_port: round.worker_port,
            aux_port: round.aux_port,
            restarts,
            status: gifts.status,
            tap: served.and_then(pod::Served::tap),
            unstartable: served.and_then(pod::Served::unstartable).or(gifts.unstartable),
            zygote: self.zygote.as_ref(),
            survivors: served.and_then(pod::Served::survivors),
            lighthouse: gifts.lighthouse,
            pmi: gifts.pmi,
            group_rank: round.group_rank,
            nnodes: round.nnodes,
        };
        let attempt_dir = self.log_root.join(format!("attempt_{}", round.number));
        let job = &mut RoundPods { session: &mut self.session, round };
        let run = (&self.spawner, &mut self.carry);
        Flow::Go(run_attempt(&world, (&attempt_dir, self.files_ok), run, &self.env, &mut self.events, job).await)
    }

    /// The pods agree on what the round's end was and decide what comes
    /// next: success, a restart, a new round with other pods, or failure.
    async fn settle(&mut self, round: &Round, ran: Ran) -> Flow<()> {
        let Ran { plan, restarts, base_restarts, outcome, failures } = ran;
        if let Outcome::Stopped(sig) = outcome {
            return Flow::Exit(self.stopped_in(round, &plan, sig, failures).await);
        }
        let synced = if outcome == Outcome::Lost {
            Err(None)
        } else {
            stop_sync(&mut self.session, round, (&plan, restarts), &failures).await.map_err(Some)
        };
        let (facts, all_failures, end, stalled) = match synced {
            Ok(x) => x,
            Err(e) => {
                let cause = e.map_or_else(
                    || "the store connection broke while the workers ran".into(),
                    |e| crate::error::error_chain(&e),
                );
                if let Some(sv) = &self.served {
                    sv.round_over(round.number, &failures, &cause, false);
                }
                self.story.rounds.push(record(round, "store lost", "regroup"));
                self.story.failures.extend(failures);
                return self.reconnect(&cause).await;
            }
        };
        self.story.failures.extend(all_failures.iter().cloned());
        self.story.stalled = stalled.or(self.story.stalled.take());
        let shown = end.as_ref().map(RoundEnd::to_string).unwrap_or_default();
        let stopped = end.as_ref().is_some_and(RoundEnd::is_stop);
        if let Some(sv) = &self.served {
            sv.round_over(round.number, &all_failures, &shown, stopped);
        }
        let agreed = match self.session.decide(round.number, verdict(&facts)).await {
            Ok(v) => v,
            Err(e) => return self.reconnect(&crate::error::error_chain(&e)).await,
        };
        // Kept workers go on only into a restart or regroup of their run.
        if !matches!(agreed, Verdict::Restart(_) | Verdict::Regroup) || stopped {
            self.carry.stop(plan.grace).await;
            if self.served.is_some() {
                crate::process::sweep::between_rounds("after the run's kept workers stopped");
            }
        }
        self.story.rounds.push(record(round, &shown, &agreed.to_string()));
        let root = root_cause(&all_failures);
        for f in &mut self.features {
            f.decided(root);
        }
        tracing::info!(
            round = round.number,
            end = %shown,
            verdict = %agreed,
            dead = facts.dead,
            all_stopped = facts.all_stopped,
            failed_rank = root.map(|f| f.rank),
            restarts_used = facts.restarts,
            restarts_left = plan.max_restarts.saturating_sub(facts.restarts),
            "round decided"
        );
        let decided = Decided { verdict: agreed, stopped, failures: &all_failures, base_restarts };
        self.follow(round, &plan, decided).await
    }

    /// A stop signal ended this pod's round: tell the others (they regroup at once), report, leave; the exit code.
    async fn stopped_in(&mut self, round: &Round, plan: &Plan, sig: i32, failures: Vec<Failure>) -> u8 {
        self.stop_sig = Some(sig);
        self.announce_stop(sig).await;
        // The store host keeps the store up a moment for the others.
        let _ = tokio::time::timeout(PUBLISH_WAIT, self.session.report_stopped(round, &failures)).await;
        if plan.serve_store {
            let _ = self.session.wait_stopped(round, Duration::from_secs(3)).await;
        }
        self.story.failures.extend(failures);
        self.story.rounds.push(record(round, "stopped by signal", "exit"));
        self.session.bye().await;
        let code = exit::for_signal(sig);
        if !self.story.failures.is_empty() {
            let why = format!("trainlet received {}", sys::signal_name(sig));
            report(plan, &self.log_root, (code, why, None), &self.story);
        }
        code
    }

    /// Carry out what the pods decided about `round`.
    async fn follow(&mut self, round: &Round, plan: &Plan, d: Decided<'_>) -> Flow<()> {
        let world = round.nnodes * plan.nproc;
        match d.verdict {
            // A serving pod outlives every run's verdict, whatever phase it
            // was in when the round ended (a setup step cut short, idle):
            // only the control API or the idle timeout ends it.
            Verdict::Success if self.served.is_some() => {
                if let Some(sv) = self.served.as_mut() {
                    sv.run_over(RunState::Succeeded, world, d.failures, None).await;
                }
                self.story = Story::default();
                let _ = self.session.finish_round(round.number).await;
            }
            Verdict::Success => {
                let _ = self.session.leave(round, plan.serve_store, LEAVE_WAIT).await;
                self.session.bye().await;
                return Flow::Exit(exit::SUCCESS);
            }
            Verdict::Regroup => {
                if d.stopped
                    && let Some(sv) = self.served.as_mut()
                {
                    sv.run_over(RunState::Stopped, world, d.failures, None).await;
                    self.story = Story::default();
                }
                if self.session.finish_round(round.number).await.is_err() {
                    tracing::warn!("lost the store while moving to the next round");
                }
            }
            Verdict::Restart(n) => return self.restart(round, plan, n, d).await,
            Verdict::Fail(kind) => {
                let failed = fail_code(kind, d.failures);
                let code = failed.0;
                let written = report(plan, &self.log_root, failed, &self.story);
                if let Some(sv) = self.served.as_mut() {
                    sv.run_over(RunState::Failed, world, d.failures, Some(&written)).await;
                    self.story = Story::default();
                    let _ = self.session.finish_round(round.number).await;
                    return Flow::Go(());
                }
                let _ = self.session.leave(round, plan.serve_store, LEAVE_WAIT).await;
                self.session.bye().await;
                return Flow::Exit(code);
            }
        }
        Flow::Go(())
    }

    /// Restart `n` of the run: on to the next round after the backoff.
    async fn restart(&mut self, round: &Round, plan: &Plan, n: u32, d: Decided<'_>) -> Flow<()> {
        self.known.restarts = n + d.base_restarts;
        crate::metrics::global().restarts.inc();
        let wait = backoff(plan.restart_backoff, n, BACKOFF_CAP);
        let left = plan.max_restarts.saturating_sub(n);
        let failed_rank = root_cause(d.failures).map(|f| f.rank);
        let replica_group = plan.groups.as_ref().filter(|g| g.count > 1).map(|g| g.group);
        let what = match replica_group {
            Some(_) => "restarting this replica group's workers; the other groups go on",
            None => "restarting every pod's workers",
        };
        tracing::warn!(
            restart = n,
            restarts_left = left,
            backoff_s = wait.as_secs_f64(),
            failed_rank,
            replica_group,
            "{what}"
        );
        super::finish::restarted(plan, what, root_cause(d.failures));
        let _ = self.session.finish_round(round.number).await;
        if !wait.is_zero()
            && let Err(sig) = until_stop(&mut self.events, plan, tokio::time::sleep(wait)).await
        {
            self.session.bye().await;
            self.stop_sig = Some(sig);
            return Flow::Exit(exit::for_signal(sig));
        }
        Flow::Go(())
    }

    /// The job leaves this pod with `code`: kept workers stop, every feature ends (the store
    /// host of replica groups may outlast the other groups first), the store closes.
    async fn finish(mut self, code: u8) -> Result<u8> {
        if let Some(s) = &self.served {
            s.leaving();
        }
        self.carry.stop(self.plan.grace).await;
        if let Some(s) = self.served.as_mut() {
            s.finish().await;
        }
        let mut code = code;
        let stopped = self.stop_sig.is_some();
        for f in &mut self.features {
            let at = Leaving { plan: &self.plan, stopped, events: &mut self.events };
            if let Err(sig) = f.leaving(at).await {
                code = exit::for_signal(sig);
            }
        }
        if let Some(s) = self.control.take() {
            s.shutdown().await;
        }
        forget_logs(&self.plan, &self.log_root, code);
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(code),
        }
    }
}
