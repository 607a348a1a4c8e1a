//! trainlet's entry point: block signals, parse the CLI (as `trainlet` or,
//! through a symlink, as `torchrun`), set up tracing, run, map to an exit code.

use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;
use trainlet::cli::{Cli, RunArgs, StoreArgs, Sub, TorchrunCli};
use trainlet::config::{Env, Plan};
use trainlet::store::{StoreServer, bind_listener, error_chain};
use trainlet::supervise::signals::{self, SysEvent};
use trainlet::{exit, sys};

fn main() -> ExitCode {
    // First, before any thread exists, so every thread inherits the mask.
    if let Err(e) = sys::block_signals() {
        eprintln!("trainlet: error: cannot block signals: {e}");
        return ExitCode::from(exit::INTERNAL);
    }
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let as_torchrun = std::path::Path::new(&argv0).file_name().is_some_and(|n| n == "torchrun");
    let parsed = if as_torchrun {
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TRAINLET_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    std::panic::set_hook(Box::new(|info| tracing::error!(%info, "trainlet panicked")));
    ExitCode::from(match sub {
        Sub::Run(args) => run(&args),
        Sub::Doctor(args) => doctor(&args),
        Sub::Store(args) => store(&args),
    })
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
    let Some(rt) = runtime() else { return exit::INTERNAL };
    if let Err(e) = sys::become_subreaper() {
        tracing::warn!(error = %e, "cannot become a child subreaper; orphans of workers may escape");
    }
    let events = match signals::start() {
        Ok(rx) => rx,
        Err(e) => {
            eprintln!("trainlet: error: cannot start the signal thread: {e}");
            return exit::INTERNAL;
        }
    };
    let cancel = CancellationToken::new();
    let result = rt.block_on(trainlet::launch::run(plan, events, cancel.clone()));
    cancel.cancel();
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    // Anything still parented to us (orphans that left their worker's process
    // group) must not outlive the agent.
    for pid in sys::children_of(std::process::id()) {
        tracing::warn!(pid, "killing a leftover descendant of the workers");
        sys::signal_process(pid, libc::SIGKILL);
    }
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("trainlet: error: {}", error_chain(&e));
            u8::from(&e)
        }
    }
}

fn doctor(args: &RunArgs) -> u8 {
    match resolve(args, false) {
        Ok(plan) => {
            print!("{}", plan.describe());
            exit::SUCCESS
        }
        Err(code) => code,
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
        let server = match StoreServer::start(listener, cancel.child_token()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("trainlet: error: cannot serve the store: {e}");
                return exit::INTERNAL;
            }
        };
        // Tests and scripts read the port from this line.
        println!("trainlet store listening on {}", server.local_addr());
        let sig = loop {
            match events.recv().await {
                Some(SysEvent::Signal(s))
                    if [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT].contains(&s) =>
                {
                    break s;
                }
                Some(_) => {}
                None => break libc::SIGTERM,
            }
        };
        tracing::info!(signal = %sys::signal_name(sig), "store stopping");
        server.shutdown().await;
        exit::SUCCESS
    })
}
