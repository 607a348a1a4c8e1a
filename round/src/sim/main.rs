//! `trainlet-sim`: the round's protocol under seeded schedules
//! (`bash tests/sim.sh`). Each schedule draws a job (1 to 64 pods, static
//! or elastic, spares, a served job's runs and stops, an in-place
//! restart) and its faults from its seed, runs the agents' decisions
//! (`round::*`) against a simulated store, and checks the invariants; the
//! first violation prints its seed, its trace and the command that
//! replays it, and exits 1.
//!
//! Usage: `trainlet-sim [--schedules N] [--seed S] [--mutant NAME]
//! [--list-mutants]`. Schedule i of a run has seed S + i, so a violation's
//! seed alone (`--seed SEED --schedules 1`) replays it.

mod agent;
mod leave;
mod phase;
mod round_end;
mod run;
mod store;
mod world;

use std::process::ExitCode;

use round::mutant::{self, Mutant};

/// Schedules of a run without `--schedules`.
const DEFAULT_SCHEDULES: u64 = 60_000;
/// The first seed of a run without `--seed`.
const DEFAULT_SEED: u64 = 1;

/// The command line.
#[derive(Debug)]
struct Args {
    schedules: u64,
    seed: u64,
    mutant: Option<Mutant>,
    list: bool,
}

fn parse(args: &[String]) -> Result<Args, String> {
    let mut a = Args { schedules: DEFAULT_SCHEDULES, seed: DEFAULT_SEED, mutant: None, list: false };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--schedules" => {
                let v = value("--schedules")?;
                a.schedules = v.parse().map_err(|_| format!("--schedules takes a number, not {v:?}"))?;
            }
            "--seed" => {
                let v = value("--seed")?;
                a.seed = v.parse().map_err(|_| format!("--seed takes a number, not {v:?}"))?;
            }
            "--mutant" => {
                let v = value("--mutant")?;
                let names: Vec<&str> = Mutant::ALL.iter().map(|m| m.name()).collect();
                a.mutant = Some(
                    Mutant::parse(&v)
                        .ok_or_else(|| format!("no mutant {v:?}; the mutants are {}", names.join(", ")))?,
                );
            }
            "--list-mutants" => a.list = true,
            "-h" | "--help" => {
                return Err("usage: trainlet-sim [--schedules N] [--seed S] [--mutant NAME] [--list-mutants]".into());
            }
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let a = match parse(&args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("trainlet-sim: {e}");
            return ExitCode::from(2);
        }
    };
    if a.list {
        for m in Mutant::ALL {
            println!("{} {}: {}", m.name(), m.commit(), m.what());
        }
        return ExitCode::SUCCESS;
    }
    mutant::set(a.mutant);
    let started = std::time::Instant::now();
    let mut ticks = 0u64;
    for i in 0..a.schedules {
        let seed = a.seed.wrapping_add(i);
        let out = run::run(seed);
        ticks += out.ticks;
        if let Some((violation, trace)) = out.violation {
            println!("violation in schedule {i}, seed {seed}: {violation}");
            println!("schedule: {}", out.cfg);
            if let Some(m) = a.mutant {
                println!("mutant: {} ({}, {})", m.name(), m.commit(), m.what());
            }
            println!("trace (last {} steps):", trace.len());
            for line in trace {
                println!("  {line}");
            }
            let mutant = a.mutant.map(|m| format!(" --mutant {}", m.name())).unwrap_or_default();
            println!("replay: bash tests/sim.sh --seed {seed} --schedules 1{mutant}");
            println!("{} schedules, 1 violations", i + 1);
            return ExitCode::from(1);
        }
    }
    println!("{ticks} steps in {:.1} s", started.elapsed().as_secs_f64());
    println!("{} schedules, 0 violations", a.schedules);
    ExitCode::SUCCESS
}
