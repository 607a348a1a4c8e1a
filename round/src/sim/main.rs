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
mod forming;
mod leave;
mod phase;
mod round_end;
mod run;
mod store;
mod world;

use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Run the schedules on every CPU (at most 8 threads): schedule i runs on
/// thread i mod T, each thread's in order, and a thread stops past the
/// first violation found; so the first violation (the smallest i) is the
/// same whatever the number of threads. The ticks run, and that violation.
fn run_all(a: &Args) -> (u64, Option<(u64, run::Outcome)>) {
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get).min(8) as u64;
    let first = AtomicU64::new(u64::MAX);
    let ticks = AtomicU64::new(0);
    let found: Mutex<Option<(u64, run::Outcome)>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for k in 0..threads {
            let (first, ticks, found) = (&first, &ticks, &found);
            scope.spawn(move || {
                mutant::set(a.mutant);
                let mut i = k;
                while i < a.schedules && i < first.load(Ordering::Relaxed) {
                    let out = run::run(a.seed.wrapping_add(i));
                    ticks.fetch_add(out.ticks, Ordering::Relaxed);
                    if out.violation.is_some() {
                        first.fetch_min(i, Ordering::Relaxed);
                        let mut f = found.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        if f.as_ref().is_none_or(|(j, _)| i < *j) {
                            *f = Some((i, out));
                        }
                        return;
                    }
                    i += threads;
                }
            });
        }
    });
    let found = found.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    (ticks.into_inner(), found)
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
    let started = std::time::Instant::now();
    let (ticks, found) = run_all(&a);
    if let Some((i, out)) = found {
        let seed = a.seed.wrapping_add(i);
        let (violation, trace) = out.violation.unwrap_or_default();
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
    println!("{ticks} ticks in {:.1} s", started.elapsed().as_secs_f64());
    println!("{} schedules, 0 violations", a.schedules);
    ExitCode::SUCCESS
}
