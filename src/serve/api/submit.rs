//! `POST /v1/runs` and `POST /v1/actors`: a submission checked, placed
//! on the pods' worker slots (the main run, or a lane beside it:
//! `crate::serve::lane`), its files stored and the run published; what
//! the run before it left in the store let go.

use std::sync::Arc;

use super::{Answer, Api, KEEP_LOGS, fail, stop, wait_over};
use crate::http::{Request, Status};
use crate::serve::board::{Board, State};
use crate::serve::lane::host::Lanes;
use crate::serve::spec::{Run, check, check_archive};
use crate::serve::{Link, files, intake, kind, logs};
use crate::store::Dial;

pub(super) async fn submit(api: &Api, req: &Request, actor: bool, bodies: &intake::Bodies) -> Answer {
    // JSON whatever the client called it (curl -d says form-urlencoded),
    // or the files as a tar(.gz) body with the JSON in X-Trainlet-Run.
    let kind = req.header("content-type").unwrap_or("");
    let archive = kind.contains("gzip") || kind.contains("tar");
    if kind.contains("multipart") {
        return fail(Status::MEDIA, "send JSON, or a tar.gz body with the JSON in X-Trainlet-Run");
    }
    // What the body inflates or decodes to (its files) is held only as the
    // body budget grants it, until the answer: a small gzip body cannot
    // grow past what every body held at once may take.
    let mut grown: Option<tokio::sync::SemaphorePermit<'_>> = None;
    let mut short = false;
    let mut room = |n: usize| match bodies.reserve(n) {
        Ok(p) => {
            match grown.as_mut() {
                Some(g) => g.merge(p),
                None => grown = Some(p),
            }
            Ok(())
        }
        Err(why) => {
            short = true;
            Err(why)
        }
    };
    let checked = match (archive, req.header("x-trainlet-run")) {
        (true, Some(json)) => check_archive(json, &req.body, &mut room),
        (true, None) => Err("a tar.gz body needs the run's JSON in the X-Trainlet-Run header".into()),
        (false, _) => check(&req.body, &mut room),
    };
    let checked = match checked {
        Ok(c) if let Some(why) = crate::serve::spec::misrouted(&c, actor, api.conf.calls.is_some()) => {
            return fail(Status::BAD, why);
        }
        Ok(c) => c,
        Err(why) if short => return fail(Status::UNAVAILABLE, &why),
        Err(why) => return fail(Status::BAD, &why),
    };
    let _one = api.submit.lock().await;
    if api.board.is_shut() {
        return fail(Status::UNAVAILABLE, "the pods are shutting down (idle timeout); submit to a new job");
    }
    let want = checked.nproc.unwrap_or(api.conf.pod_nproc);
    if let Some((seq, id, _)) = api.board.active().filter(|_| checked.replace) {
        if let Err(refused) = replaceable(api, &id, want, checked.actor.is_some()).await {
            return refused;
        }
        if let Err(e) = stop(api, seq).await {
            return fail(Status::UNAVAILABLE, &format!("cannot stop run {id}: {e}"));
        }
        if !wait_over(&api.board, seq, api.conf.stop_limit).await {
            return fail(Status::UNAVAILABLE, &format!("run {id} is still stopping; try again"));
        }
    }
    let (first_slot, lane) = match placed(api, want, checked.actor.is_some()).await {
        Ok(crate::serve::lane::Place::Main(first)) => (first, None),
        Ok(crate::serve::lane::Place::Lane(first)) => match &api.conf.lanes {
            Some(lanes) => (first, Some(Arc::clone(lanes))),
            None => return fail(Status::CONFLICT, "the main run is not over, and this control API opens no lanes"),
        },
        Err(why) => return fail(Status::CONFLICT, &why),
    };
    let token = match crate::serve::read_token(&api.conf.token_file) {
        Ok(t) => t,
        Err(e) => return fail(Status::UNAVAILABLE, &format!("cannot read the control token to sign the run: {e}")),
    };
    let seq = api.board.next_seq();
    let id = format!("run-{seq}-{:06x}", crate::sys::random_u64() & 0xff_ffff);
    let scope = &api.conf.scope;
    let mut link = api.link.lock().await;
    let mut visible = false;
    let published: Result<(Run, u64, Option<Run>), crate::serve::Error> = async {
        let base_restarts =
            std::str::from_utf8(&link.get(&crate::keys::JobKeys::under(&api.conf.base).restarts()).await?)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0);
        let sent = files::put(&mut link, &checked.blobs).await?;
        let run = Run {
            id: id.clone(),
            seq,
            command: checked.command,
            env: checked.env,
            nproc: if lane.is_some() { Some(want) } else { checked.nproc },
            max_restarts: checked.max_restarts.unwrap_or(api.conf.max_restarts),
            // A lane counts its restarts in rounds of its own, from 0.
            base_restarts: if lane.is_some() { 0 } else { base_restarts },
            files: checked.files,
            actor: checked.actor,
            first_slot,
            lane: lane.is_some(),
        };
        if let Some(lanes) = &lane {
            lanes.open(&mut link, &token, scope, &run).await?;
            return Ok((run, sent, None));
        }
        let previous = link.newest(&token, scope).await?.and_then(Result::ok);
        let json = serde_json::to_vec(&run).map_err(|e| crate::serve::Error::Corrupt(e.to_string()))?;
        let (run_key, go_key) = (link.keys.run(), link.keys.go(seq));
        link.set(&run_key, &crate::serve::seal(&token, scope, kind::RUN, 0, &json)).await?;
        visible = true;
        link.set(&go_key, b"run").await?;
        Ok((run, sent, previous))
    }
    .await;
    match published {
        Ok((run, sent, previous)) => {
            api.board.submitted(&run, sent);
            drop(link);
            tracing::info!(run = %run.id, command = ?run.command, files = run.files.len(), sent_bytes = sent, "run submitted");
            // What earlier runs left in the store and this one does not use,
            // on a connection of its own: a submission never waits for it.
            let place = (api.conf.dial.clone(), api.conf.base.clone(), api.conf.lanes.clone());
            let held = (Arc::clone(&api.board), Arc::clone(&api.submit));
            tokio::spawn(cleanup(place, held, previous, run.clone()));
            let body = serde_json::json!({ "id": run.id, "seq": run.seq, "state": State::Starting });
            (Status::CREATED, body.to_string())
        }
        Err(e) => {
            let why = crate::error::error_chain(&e);
            tracing::error!(run = %id, error = %why, "cannot publish a run; nothing was started");
            if visible {
                // The run is in the store without its wake-up: take it back,
                // so that no pod finds it in a later round.
                let key = link.keys.run();
                if let Err(e) = link.delete(&key).await {
                    tracing::warn!(run = %id, error = %crate::error::error_chain(&e), "cannot take back a run the pods were not told of");
                }
            }
            fail(Status::UNAVAILABLE, &format!("cannot publish the run to the pods: {why}"))
        }
    }
}

/// Whether a replace of the main run `id` by `want` workers per pod fits
/// once that run is over, decided before anything is stopped (a 4xx
/// changes nothing): a replace that would not fit is refused; one that fits
/// only once what is being stopped is over waits for that first (at most
/// the stop limit), and is refused, still with nothing changed, if it is
/// not over by then.
async fn replaceable(api: &Api, id: &str, want: u32, actor: bool) -> Result<(), Answer> {
    let until = tokio::time::Instant::now() + api.conf.stop_limit;
    let mut w = api.board.watch();
    loop {
        let held: Vec<_> = api.board.held(api.conf.pod_nproc).into_iter().filter(|h| h.id != id).collect();
        let settled: Vec<_> = held.iter().filter(|h| !h.stopping).cloned().collect();
        let (now, then) = (
            crate::serve::lane::place(api.conf.pod_nproc, &held, want, actor),
            crate::serve::lane::place(api.conf.pod_nproc, &settled, want, actor),
        );
        match (now, then) {
            (Ok(_), _) => break,
            (Err(why), Err(_)) => return Err(fail(Status::CONFLICT, &format!("{why}; run {id} was not stopped"))),
            (Err(why), Ok(_)) if tokio::time::Instant::now() >= until => {
                return Err(fail(
                    Status::UNAVAILABLE,
                    &format!("{why}: what is being stopped is not over yet; run {id} was not stopped; try again"),
                ));
            }
            (Err(_), Ok(_)) => {
                if tokio::time::timeout_at(until, w.changed()).await.is_ok_and(|r| r.is_err()) {
                    return Err(fail(Status::UNAVAILABLE, "the control API is stopping"));
                }
            }
        }
    }
    Ok(())
}

/// Where a submission of `want` workers per pod goes
/// ([`crate::serve::lane::place`]); while it does not fit and a run that holds
/// slots is being stopped, its end is waited for (at most the stop limit).
async fn placed(api: &Api, want: u32, actor: bool) -> Result<crate::serve::lane::Place, String> {
    let until = tokio::time::Instant::now() + api.conf.stop_limit;
    let mut w = api.board.watch();
    loop {
        let held = api.board.held(api.conf.pod_nproc);
        match crate::serve::lane::place(api.conf.pod_nproc, &held, want, actor) {
            Err(_) if held.iter().any(|h| h.stopping) && tokio::time::Instant::now() < until => {
                if tokio::time::timeout_at(until, w.changed()).await.is_ok_and(|r| r.is_err()) {
                    return Err("the control API is stopping".into());
                }
            }
            placed => return placed,
        }
    }
}

/// Remove what `previous` left in the store and neither `run` nor an open
/// lane uses (its files), and the lines of runs that are over and older
/// than the last [`KEEP_LOGS`]; between two submissions (under the
/// submission lock: a submission that finds a blob stored counts on it).
async fn cleanup(
    (dial, base, lanes): (Dial, String, Option<Arc<Lanes>>),
    (board, submit): (Arc<Board>, Arc<tokio::sync::Mutex<()>>),
    previous: Option<Run>,
    run: Run,
) {
    let _one = submit.lock().await;
    let mut link = Link::new(dial, &base);
    let done: Result<(), crate::serve::Error> = async {
        if let Some(prev) = previous {
            let mut keep = run.files.clone();
            if let Some(l) = &lanes {
                keep.extend(l.files().await);
            }
            files::forget(&mut link, &prev.files, &keep).await?;
        }
        if run.seq > KEEP_LOGS {
            for seq in board.logs_to_forget(run.seq - KEEP_LOGS + 1) {
                let keys = link.keys.clone();
                logs::forget(&mut link, &keys, seq).await?;
                board.logs_forgotten(seq);
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = done {
        tracing::warn!(run = %run.id, error = %crate::error::error_chain(&e), "cannot remove earlier runs' files or lines from the store");
    }
}
