//! A served run begins on this pod: nothing of an earlier run left
//! running, its files unpacked, its log shipper started, the setup steps
//! this pod has not applied applied (or why its workers cannot start here).

use std::path::PathBuf;

use tokio::sync::mpsc::UnboundedReceiver;

use super::{Current, Served, Work};
use crate::config::Plan;
use crate::process::signals::SysEvent;
use crate::rendezvous::{Round, Session};
use crate::serve::logs::Shipper;
use crate::serve::setup::Dirs;
use crate::serve::spec::{Run, shown};
use crate::serve::{Link, files};
use crate::supervise::carry::Carry;
use crate::supervise::policy::Outcome;

impl Served {
    /// A new run: its files, its log shipper, the setup steps this pod has
    /// not applied yet; Some when a stop signal came meanwhile.
    pub(super) async fn begin(
        &mut self,
        run: Run,
        plan: &Plan,
        carry: &mut Carry,
        (events, session, round): (&mut UnboundedReceiver<SysEvent>, &Session, &Round),
    ) -> Option<Work> {
        // Nothing of an earlier run may rewrite this one's files once they
        // are checked: its kept workers and what they started are gone.
        carry.keep_only(run.seq);
        crate::process::sweep::between_rounds("before a run's files land");
        // Begun before and cut short in its setup: its files and shipper stay.
        let (dir, unstartable, shipper) = match self.current.take().filter(|c| c.run.seq == run.seq) {
            Some(c) => (c.dir, c.unstartable, c.shipper),
            None => {
                let (dir, unstartable) = self.unpack(&run).await;
                let command: Vec<String> = run.command.iter().map(|w| shown(w)).collect();
                tracing::info!(run = %run.id, command = %command.join(" "), "starting a served run");
                (dir, unstartable, Shipper::start(Link::new(self.dial.clone(), &self.base), run.seq))
            }
        };
        let spawner = self.spawner.clone();
        let pod = super::setup::Pod { plan, spawner: &spawner, tap: Some(shipper.tap()) };
        let end = session.watch_end(round.number);
        let mut end: super::setup::EndWatch =
            Box::pin(async move { end.await.map_or_else(|| "the store was lost".to_string(), |e| e.to_string()) });
        let unstartable = match self.setup(&pod, (events, &mut end)).await {
            Err(super::setup::Stop::Signal(s)) => return Some(Work::Idle(Outcome::Stopped(s))),
            // Not ready: the next round begins it again, if it is not over.
            // It stays current, so that this pod judges the round by the
            // run's restarts like the pods whose workers ran.
            Err(super::setup::Stop::Ended(why)) => {
                tracing::info!(run = %run.id, end = %why, "the run's setup was cut short by the end of the round");
                self.current = Some(Current { run, dir, unstartable, shipper, bridge: None, ready: false });
                return Some(Work::Idle(Outcome::Regroup));
            }
            Err(super::setup::Stop::Failed(why)) => {
                tracing::error!(run = %run.id, "{why}");
                unstartable.or(Some(why))
            }
            Ok(()) => unstartable,
        };
        let (bridge, unstartable) = match self.bridge(&run) {
            Ok(b) => (b, unstartable),
            Err(why) => {
                tracing::error!(run = %run.id, "{why}");
                (None, unstartable.or(Some(why)))
            }
        };
        self.current = Some(Current { run, dir, unstartable, shipper, bridge, ready: true });
        None
    }

    /// The run's files in place under the serve directory (or why not).
    async fn unpack(&mut self, run: &Run) -> (Option<PathBuf>, Option<String>) {
        let started = std::time::Instant::now();
        match files::materialize(&mut self.link, &self.conf.dir, run).await {
            Ok((dir, fetched)) => {
                tracing::info!(run = %run.id, dir = %dir.display(), files = run.files.len(), fetched_bytes = fetched, took_ms = started.elapsed().as_millis(), "run's files in place");
                (Some(dir), None)
            }
            Err(e) => {
                let why = format!("cannot unpack the run's files: {}", crate::error::error_chain(&e));
                tracing::error!(run = %run.id, "{why}");
                (None, Some(why))
            }
        }
    }

    /// Apply the declared setup steps this pod has not applied.
    async fn setup(
        &mut self,
        pod: &super::setup::Pod<'_>,
        round: (&mut UnboundedReceiver<SysEvent>, &mut super::setup::EndWatch),
    ) -> Result<(), super::setup::Stop> {
        let Some(scope) = &self.scope else { return Ok(()) };
        let token = crate::serve::read_token(&self.token_file).unwrap_or_default();
        self.steps = match self.link.setup(&token, scope).await {
            Ok(Some(Ok(steps))) => steps,
            Ok(None) => Vec::new(),
            Ok(Some(Err(why))) => {
                self.refuse("the setup steps", &why);
                Vec::new()
            }
            Err(e) => {
                let why = format!("cannot read the setup steps from the store: {}", crate::error::error_chain(&e));
                return Err(super::setup::Stop::Failed(why));
            }
        };
        super::setup::apply(&self.steps, (&Dirs::new(&self.conf.dir), &mut self.applied), pod, round).await
    }
}
