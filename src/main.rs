//! trainlet's entry point: block signals, dispatch on argv[0] (`torchrun`,
//! `ssh`, `sshd`, `mpirun`/`mpiexec`, `python`/`python3` through links) and the subcommand, set
//! up tracing, run the mode (`trainlet::cmd`), exit with its code.

use std::process::ExitCode;

use clap::Parser;
use trainlet::cli::{Cli, Sub, TorchrunCli};
use trainlet::cmd::{self, finish};
use trainlet::exit;

fn main() -> ExitCode {
    // The `python` links of the JAX/XGBoost images exec the interpreter or
    // `trainlet run` in place: before the signal mask, which exec keeps.
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let name = std::path::Path::new(&argv0).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if name == "python" || name == "python3" {
        let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
        return ExitCode::from(cmd::python::main(&name, &args));
    }
    // First, before any thread exists, so every thread inherits the mask.
    if let Err(e) = trainlet::sys::block_signals() {
        eprintln!("trainlet: error: cannot block signals: {e}");
        return ExitCode::from(exit::INTERNAL);
    }
    ExitCode::from(main_exec())
}

fn main_exec() -> u8 {
    let argv0 = std::env::args_os().next().unwrap_or_default();
    let name = std::path::Path::new(&argv0).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let args: Vec<String> = std::env::args().skip(1).collect();
    // ssh(1) and sshd(8) argv are not clap's: dispatch before parsing.
    if name == "ssh" {
        return cmd::ssh::main(&args);
    }
    if args.first().is_some_and(|a| a == "ssh") {
        return cmd::ssh::main(&args[1..]);
    }
    // Through a link at /usr/sbin/sshd, Trainer's MPI runtimes
    // (`/usr/sbin/sshd -De -f ~/.sshd_config`) run trainlet's server unchanged.
    if name == "sshd" {
        let sshd = cmd::sshd::args_from_sshd(&args).map_err(cmd::Error::from);
        return finish(
            "trainlet",
            sshd.and_then(|a| {
                cmd::init_tracing("info");
                cmd::sshd::main(a)
            }),
        );
    }
    let parsed = if name == "mpirun" || name == "mpiexec" {
        // Through a link named mpirun/mpiexec before the real one on PATH, a
        // TrainJob's own `mpirun ...` runs as `trainlet mpi -- mpirun ...`.
        let Some(real) = trainlet::mpi::hosts::real_launcher(&name) else {
            let why = format!("no real {name} on PATH besides trainlet (set TRAINLET_MPIRUN)");
            return finish("trainlet", Err(cmd::Error::Usage(why)));
        };
        let head = ["trainlet".into(), "mpi".into(), "--".into(), real.display().to_string()];
        Cli::try_parse_from(head.into_iter().chain(args)).map(|c| c.command)
    } else if name == "torchrun" {
        TorchrunCli::try_parse().map(|t| Sub::Run(t.run))
    } else {
        Cli::try_parse().map(|c| c.command)
    };
    let sub = match parsed {
        Ok(s) => s,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { exit::CONFIG } else { exit::SUCCESS };
        }
    };
    cmd::init_tracing("info");
    match sub {
        Sub::Run(args) => finish("trainlet", cmd::run::main(&args)),
        Sub::Doctor(args) => finish("trainlet", cmd::doctor::main(&args)),
        Sub::Store(args) => finish("trainlet", cmd::store::main(&args)),
        Sub::Sshd(args) => finish("trainlet", cmd::sshd::main(args)),
        Sub::Mpi(args) => finish("trainlet", cmd::mpi::main(args)),
        Sub::Keygen(args) => finish("trainlet", cmd::keygen::main(&args)),
        Sub::Ssh { args } => cmd::ssh::main(&args),
        Sub::NvmlProbe { every } => cmd::nvml_probe::main(every),
        Sub::Init(args) => finish("trainlet init", cmd::init::main(&args)),
        Sub::Stop { timeout } => cmd::stop::stop(timeout),
        Sub::Stacks { json } => cmd::stacks::main(json),
        Sub::Event(args) => finish("trainlet", cmd::event::main(args)),
    }
}
