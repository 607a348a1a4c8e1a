//! `trainlet init dataset|model`: Kubeflow Trainer's initializers
//! ([`initializers`]), with SIGTERM/SIGINT as the stop request and an
//! optional `/metrics` endpoint for their progress.

use std::sync::Arc;

use super::Error;
use crate::cli::{InitArgs, InitKind, InitVerify};
use crate::process::signals::{self, SysEvent};
use initializers::{Config, Kind, Outcome};

/// SIGTERM or SIGINT, collected by the one signal thread
/// ([`signals::start`]), become the run's stop request. The forwarding
/// thread holds nothing and is not joined: the process exits when the run
/// is over.
fn stop_on_signals(ctl: &initializers::Control) -> std::io::Result<()> {
    let mut events = signals::start()?;
    let stop = Arc::clone(&ctl.stop);
    std::thread::Builder::new().name("trainlet-init-stop".into()).spawn(move || {
        while let Some(ev) = events.blocking_recv() {
            if let SysEvent::Signal(sig @ (libc::SIGTERM | libc::SIGINT)) = ev {
                stop.store(sig, std::sync::atomic::Ordering::SeqCst);
                return;
            }
        }
    })?;
    Ok(())
}

/// Stops the metrics thread of `trainlet init` when dropped.
#[derive(Debug)]
struct Metrics {
    cancel: tokio_util::sync::CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Metrics {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serve `progress` at `addr` from a small runtime of its own.
fn serve_metrics(
    addr: std::net::SocketAddr,
    progress: &Arc<initializers::progress::Progress>,
) -> Result<Metrics, Error> {
    let usage = |what: String| Error::Usage(format!("cannot serve metrics on {addr}: {what}"));
    crate::metrics::global().watch_init(Arc::clone(progress)).map_err(|e| usage(e.to_string()))?;
    let rt = crate::process::event_loop()?;
    let cancel = tokio_util::sync::CancellationToken::new();
    rt.block_on(crate::metrics::serve(addr, cancel.clone())).map_err(|e| usage(crate::error::error_chain(&e)))?;
    let c = cancel.clone();
    let thread = std::thread::Builder::new()
        .name("trainlet-metrics".into())
        .spawn(move || rt.block_on(c.cancelled()))
        .map_err(|e| usage(e.to_string()))?;
    Ok(Metrics { cancel, thread: Some(thread) })
}

/// Fetch the source into the output, once per volume.
pub fn main(args: &InitArgs) -> Result<u8, Error> {
    let kind = match args.kind {
        InitKind::Dataset => Kind::Dataset,
        InitKind::Model => Kind::Model,
    };
    let cfg = Config::resolve(kind, args.storage_uri.as_deref(), args.output.clone(), |k| std::env::var(k).ok())
        .and_then(|c| c.with_revision(args.revision.as_deref()))?
        .with_host(crate::sys::hostname());
    let opts = initializers::fetch::Options {
        concurrency: usize::from(args.concurrency),
        chunk: u64::from(args.chunk_mib) << 20,
        retries: args.retries,
        stall: args.stall,
        progress_every: args.progress_every,
        verify_content: args.verify == InitVerify::Full,
    };
    let ctl = initializers::Control::default();
    let _metrics = args.metrics_addr.map(|addr| serve_metrics(addr, &ctl.progress)).transpose()?;
    stop_on_signals(&ctl).map_err(|source| Error::Thread { what: "signal", source })?;
    match initializers::run(&cfg, &opts, &ctl)? {
        Outcome::Fetched { files, bytes } => {
            tracing::info!(uri = %cfg.uri, output = %cfg.output.display(), files, bytes, "initializer done");
        }
        Outcome::AlreadyDone => {
            tracing::info!(uri = %cfg.uri, output = %cfg.output.display(), "already in place (completion marker); nothing to do");
        }
    }
    Ok(initializers::exit::SUCCESS)
}
