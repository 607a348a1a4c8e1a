//! trainlet's entry point: block signals, parse the CLI (as `trainlet` or,
//! through a symlink, as `torchrun`), set up tracing, run, map to an exit code.

use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;
use trainlet::cli::{Cli, RunArgs, StoreArgs, Sub, TorchrunCli};
use trainlet::config::{Env, Plan};
use trainlet::error::error_chain;
use trainlet::process::signals::{self, SysEvent};
use trainlet::store::{StoreServer, bind_listener};
use trainlet::{exit, sys};

fn main() -> ExitCode {
    // First, before any thread exists, so every thread inherits the mask.
    if let Err(e) = sys::block_signals() {
        eprintln!("trainlet: error: cannot block signals: {e}");
        return ExitCode::from(exit::INTERNAL);
    }
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let name = std::path::Path::new(&argv0).file_name().map(std::ffi::OsStr::to_owned).unwrap_or_default();
    // ssh(1) argv is not clap's: dispatch before parsing (argv[0] `ssh`, or `trainlet ssh`).
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut args_for_mpi = None;
    if name == "ssh" {
        return ExitCode::from(ssh(&args));
    }
    if args.first().is_some_and(|a| a == "ssh") {
        return ExitCode::from(ssh(&args[1..]));
    }
    // Through a symlink at /usr/sbin/sshd, Trainer's MPI runtimes
    // (`/usr/sbin/sshd -De -f ~/.sshd_config`) run trainlet's server unchanged.
    if name == "sshd" {
        return ExitCode::from(match trainlet::sshd::args_from_sshd(&args) {
            Ok(sshd_args) => {
                init_tracing("info");
                supervised(|events, cancel| trainlet::sshd::run(sshd_args, events, cancel))
            }
            Err(e) => {
                eprintln!("trainlet: error: {e}");
                exit::CONFIG
            }
        });
    }
    // Through a symlink named mpirun/mpiexec placed before the real one on
    // PATH, a TrainJob's own `mpirun ...` command runs as `trainlet mpi -- mpirun ...`.
    if name == "mpirun" || name == "mpiexec" {
        let name = name.to_string_lossy().into_owned();
        let Some(real) = trainlet::mpi::real_launcher(&name) else {
            eprintln!("trainlet: error: no real {name} on PATH besides trainlet (set TRAINLET_MPIRUN)");
            return ExitCode::from(exit::CONFIG);
        };
        let argv = ["trainlet".into(), "mpi".into(), "--".into(), real.display().to_string()].into_iter().chain(args);
        args_for_mpi = Some(argv.collect::<Vec<String>>());
    }
    let as_torchrun = name == "torchrun";
    let parsed = if let Some(argv) = args_for_mpi {
        Cli::try_parse_from(argv).map(|c| c.command)
    } else if as_torchrun {
        TorchrunCli::try_parse().map(|t| Sub::Run(t.run))
    } else {
        Cli::try_parse().map(|c| c.command)
    };
    let sub = match parsed {
        Ok(s) => s,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { exit::CONFIG } else { exit::SUCCESS });
        }
    };
    init_tracing("info");
    ExitCode::from(match sub {
        Sub::Run(args) => run(&args),
        Sub::Doctor(args) => doctor(&args),
        Sub::Store(args) => store(&args),
        Sub::Sshd(args) => supervised(|events, cancel| trainlet::sshd::run(args, events, cancel)),
        Sub::Mpi(args) => supervised(|events, cancel| trainlet::mpi::run(args, events, cancel)),
        Sub::Keygen(args) => keygen(&args),
        Sub::Ssh { args } => ssh(&args),
        Sub::NvmlProbe { every } => nvml_probe(every),
        Sub::Init(args) => init(&args),
        Sub::Stop { timeout } => trainlet::stop::stop(timeout),
    })
}

/// Logs on stderr (`TRAINLET_LOG`, else `default`), panics through tracing.
fn init_tracing(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TRAINLET_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    std::panic::set_hook(Box::new(|info| tracing::error!(%info, "trainlet panicked")));
}

/// `trainlet ssh`: signals keep their default action (a killed client drops
/// the connection, and the server then kills the remote command); quiet
/// logs unless -v, so mpirun's output stays clean.
fn ssh(args: &[String]) -> u8 {
    use trainlet::env as names;
    use trainlet::ssh::{argv, client};
    let _ = sys::unblock_signals();
    let parsed = match argv::parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "trainlet ssh: {e}\nusage: ssh [-46nqTtvx] [-i identity_file] [-l login_name] [-o option] [-p port] [user@]host command ..."
            );
            return client::FAILED;
        }
    };
    let level = match parsed.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    init_tracing(level);
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let retry = env(names::TRAINLET_SSH_RETRY)
        .and_then(|v| trainlet::cli::seconds(&v).ok())
        .unwrap_or(std::time::Duration::from_secs(60));
    let check = env(names::TRAINLET_SSH_HOST_KEY_CHECKING).map(|v| argv::HostKeyCheck::from_setting(&v));
    let client_env = client::ClientEnv {
        key_dir: trainlet::ssh::keys::key_dir(
            env(names::TRAINLET_SSH_DIR).as_deref().map(std::path::Path::new),
            env("HOME").as_deref(),
        ),
        default_port: env(names::TRAINLET_SSH_PORT).and_then(|p| p.parse().ok()).unwrap_or(2222),
        retry,
        check,
        local_user: trainlet::ssh::local::local_account().0,
    };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("trainlet ssh: cannot start the async runtime: {e}");
            return client::FAILED;
        }
    };
    let code = rt.block_on(client::run(parsed, client_env));
    // stdin may be a pipe that never closes: do not wait for its reader.
    rt.shutdown_background();
    code
}

/// A mode that owns processes: subreaper, signal/reaper thread, runtime,
/// and no descendant left behind when it returns.
fn supervised<F, Fut>(body: F) -> u8
where
    F: FnOnce(tokio::sync::mpsc::UnboundedReceiver<SysEvent>, CancellationToken) -> Fut,
    Fut: std::future::Future<Output = u8>,
{
    let Some(rt) = runtime() else { return exit::INTERNAL };
    if let Err(e) = sys::become_subreaper() {
        tracing::warn!(error = %e, "cannot become a child subreaper; orphans may escape");
    }
    let events = match signals::start() {
        Ok(rx) => rx,
        Err(e) => {
            eprintln!("trainlet: error: cannot start the signal thread: {e}");
            return exit::INTERNAL;
        }
    };
    let cancel = CancellationToken::new();
    let code = rt.block_on(body(events, cancel.clone()));
    cancel.cancel();
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    kill_leftovers();
    code
}

/// SIGTERM every descendant still alive (orphans re-parented to the
/// subreaper, daemons that left their process group), give them a moment,
/// then SIGKILL until none is left (bounded).
fn kill_leftovers() {
    let swept =
        trainlet::process::sweep::terminate_all(std::time::Duration::from_secs(2), std::time::Duration::from_secs(5));
    trainlet::process::sweep::log(&swept, "exit");
}

fn keygen(args: &trainlet::cli::KeygenArgs) -> u8 {
    match trainlet::ssh::keygen::generate(
        &args.name,
        args.namespace.as_deref(),
        args.kind,
        args.split,
        args.out.as_deref(),
    ) {
        Ok(g) => {
            print!("{}", g.manifest);
            for f in g.files {
                eprintln!("wrote {}", f.display());
            }
            exit::SUCCESS
        }
        Err(e) => {
            eprintln!("trainlet: error: {}", error_chain(&e));
            exit::INTERNAL
        }
    }
}

fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => Some(rt),
        Err(e) => {
            eprintln!("trainlet: error: cannot start the async runtime: {e}");
            None
        }
    }
}

fn resolve(args: &RunArgs, need_command: bool) -> Result<Plan, u8> {
    Plan::resolve(args, &Env::from_process(), need_command).map_err(|e| {
        eprintln!("trainlet: error: {e}");
        exit::CONFIG
    })
}

fn run(args: &RunArgs) -> u8 {
    let plan = match resolve(args, true) {
        Ok(p) => p,
        Err(code) => return code,
    };
    supervised(|events, cancel| async move {
        match trainlet::launch::run(plan, events, cancel).await {
            Ok(code) => code,
            Err(e) => {
                eprintln!("trainlet: error: {}", error_chain(&e));
                u8::from(&e)
            }
        }
    })
}

fn doctor(args: &RunArgs) -> u8 {
    use trainlet::gpu::{preflight, setup};
    let plan = match resolve(args, false) {
        Ok(plan) => plan,
        Err(code) => return code,
    };
    print!("{}", plan.describe());
    let spawner = match trainlet::process::spawn::Spawner::start() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("trainlet: error: cannot start the spawner thread: {e}");
            return exit::INTERNAL;
        }
    };
    let (verdicts, report) = setup::preflight(&plan.gpu, &spawner);
    let (placed, topo) = setup::placements(&plan.gpu, plan.nproc);
    print!("{}", setup::describe(&plan.gpu, &placed, topo.as_ref(), &verdicts, &report));
    preflight::first_failure(&verdicts).map_or(exit::SUCCESS, |(code, _)| code)
}

/// SIGTERM or SIGINT, collected by the one signal thread
/// ([`signals::start`]), become the run's stop request. The forwarding
/// thread holds nothing and is not joined: the process exits when the run
/// is over.
fn stop_init_on_signals(ctl: &initializers::Control) -> std::io::Result<()> {
    let mut events = signals::start()?;
    let stop = std::sync::Arc::clone(&ctl.stop);
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
struct InitMetrics {
    cancel: tokio_util::sync::CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for InitMetrics {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serve `progress` at `addr` from a small runtime of its own.
fn init_metrics(
    addr: std::net::SocketAddr,
    progress: &std::sync::Arc<initializers::progress::Progress>,
) -> Result<InitMetrics, String> {
    trainlet::metrics::global().watch_init(std::sync::Arc::clone(progress)).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let cancel = tokio_util::sync::CancellationToken::new();
    rt.block_on(trainlet::metrics::serve(addr, cancel.clone())).map_err(|e| error_chain(&e))?;
    let c = cancel.clone();
    let thread = std::thread::Builder::new()
        .name("trainlet-metrics".into())
        .spawn(move || rt.block_on(c.cancelled()))
        .map_err(|e| e.to_string())?;
    Ok(InitMetrics { cancel, thread: Some(thread) })
}

/// `trainlet init dataset|model`.
fn init(args: &trainlet::cli::InitArgs) -> u8 {
    use initializers::{Config, Kind, Outcome};
    let kind = match args.kind {
        trainlet::cli::InitKind::Dataset => Kind::Dataset,
        trainlet::cli::InitKind::Model => Kind::Model,
    };
    let cfg = match Config::resolve(kind, args.storage_uri.as_deref(), args.output.clone(), |k| std::env::var(k).ok())
        .and_then(|c| c.with_revision(args.revision.as_deref()))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("trainlet init: error: {}", error_chain(&e));
            return e.exit_code();
        }
    };
    let opts = initializers::fetch::Options {
        concurrency: usize::from(args.concurrency),
        chunk: u64::from(args.chunk_mib) << 20,
        retries: args.retries,
        stall: args.stall,
        progress_every: args.progress_every,
        verify_content: args.verify == trainlet::cli::InitVerify::Full,
    };
    let ctl = initializers::Control::default();
    let _metrics = match args.metrics_addr.map(|addr| init_metrics(addr, &ctl.progress)).transpose() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("trainlet init: error: {e}");
            return exit::CONFIG;
        }
    };
    if let Err(e) = stop_init_on_signals(&ctl) {
        eprintln!("trainlet init: error: cannot start the signal thread: {e}");
        return exit::INTERNAL;
    }
    match initializers::run(&cfg, &opts, &ctl) {
        Ok(Outcome::Fetched { files, bytes }) => {
            tracing::info!(uri = %cfg.uri, output = %cfg.output.display(), files, bytes, "initializer done");
            initializers::exit::SUCCESS
        }
        Ok(Outcome::AlreadyDone) => {
            tracing::info!(uri = %cfg.uri, output = %cfg.output.display(), "already in place (completion marker); nothing to do");
            initializers::exit::SUCCESS
        }
        Err(e) => {
            eprintln!("trainlet init: error: {}", error_chain(&e));
            e.exit_code()
        }
    }
}

/// The NVML child (reference/gpu-pid1.md 2.3): whatever happens in here,
/// the agent only sees a report, an error line, or a dead child.
fn nvml_probe(every: Option<std::time::Duration>) -> u8 {
    let lib = std::env::var_os(trainlet::env::TRAINLET_NVML_LIB).map(std::path::PathBuf::from);
    match trainlet::gpu::nvml::probe_main(lib.as_deref(), every) {
        Ok(()) => exit::SUCCESS,
        Err(e) => {
            eprintln!("trainlet nvml-probe: {e}");
            1
        }
    }
}

fn store(args: &StoreArgs) -> u8 {
    // One event loop, as torch's libuv server and the agent's StoreLoop.
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("trainlet: error: cannot start the async runtime: {e}");
            return exit::INTERNAL;
        }
    };
    let mut events = match signals::start() {
        Ok(rx) => rx,
        Err(e) => {
            eprintln!("trainlet: error: cannot start the signal thread: {e}");
            return exit::INTERNAL;
        }
    };
    rt.block_on(async {
        let cancel = CancellationToken::new();
        let listener = match bind_listener(args.host, args.port) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("trainlet: error: {}", error_chain(&e));
                return exit::CONFIG;
            }
        };
        let from_env = std::env::var(trainlet::env::TRAINLET_STORE_MEMORY).ok();
        let memory = match args.store_memory.as_deref().or(from_env.as_deref()) {
            None => trainlet::store::default_budget(std::path::Path::new("/")),
            Some(v) => match trainlet::store::parse_size(v).filter(|n| *n >= trainlet::store::MIN_BUDGET) {
                Some(n) => n,
                None => {
                    eprintln!(
                        "trainlet: error: invalid store memory {v:?} (--store-memory or TRAINLET_STORE_MEMORY): \
                         expected a size of at least 64M, e.g. 512M or 2G"
                    );
                    return exit::CONFIG;
                }
            },
        };
        let budget = std::sync::Arc::new(trainlet::store::Budget::new(memory));
        let server = match StoreServer::start(listener, budget, cancel.child_token()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("trainlet: error: cannot serve the store: {e}");
                return exit::INTERNAL;
            }
        };
        // Tests and scripts read the port from this line.
        println!("trainlet store listening on {}", server.local_addr());
        tracing::info!(addr = %server.local_addr(), memory_budget = memory, "store serving");
        let sig = loop {
            match events.recv().await {
                Some(SysEvent::Signal(s)) if signals::STOP.contains(&s) => break s,
                Some(_) => {}
                None => break libc::SIGTERM,
            }
        };
        tracing::info!(signal = %sys::signal_name(sig), "store stopping");
        server.shutdown().await;
        exit::SUCCESS
    })
}
