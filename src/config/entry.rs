//! What workers run: the script with python (`-u`, `-m`, `--run-path`),
//! or a program (`--no-python`), the interpreter found the way torchrun
//! finds it, the start method check, and OMP_NUM_THREADS's default.

use super::Entrypoint;
use super::framework::Framework;
use super::setting::{Settings, flag_or_env, invalid, lookup};
use super::{Error, Source};
use crate::cli::RunArgs;
use crate::env::{self, Env};

/// Resolve the entry point; `need_command` is false for `doctor`.
pub(super) fn resolve(
    args: &RunArgs,
    s: &mut Settings<'_>,
    nproc: u32,
    need_command: bool,
    fw: Framework,
) -> Result<(Entrypoint, Option<String>), Error> {
    let env = s.env;
    let l = lookup(args.start_method.as_deref(), "--start-method", env, &[env::PET_START_METHOD]);
    if let Some(v) = l.value.filter(|v| !matches!(*v, "spawn" | "fork" | "forkserver")) {
        return Err(invalid(&l.origin(), v, "spawn, fork or forkserver"));
    }

    // Entrypoint.
    let (module, _) = flag_or_env(args.module, "--module", env, env::PET_MODULE)?;
    let (no_python, _) = flag_or_env(args.no_python, "--no-python", env, env::PET_NO_PYTHON)?;
    let (run_path, _) = flag_or_env(args.run_path, "--run-path", env, env::PET_RUN_PATH)?;
    if no_python && module {
        return Err(Error::Usage("--no-python and -m/--module cannot be combined".into()));
    }
    if run_path && (module || no_python) {
        return Err(Error::Usage("--run-path cannot be combined with -m/--module or --no-python".into()));
    }
    if let Some(first) = args.command.first().filter(|f| f.starts_with('-') && f.len() > 1) {
        return Err(Error::Usage(format!(
            "unknown option {first} (options go before the script; see trainlet run --help)"
        )));
    }
    let entry = match args.command.split_first() {
        None if need_command => {
            return Err(Error::Usage("missing the training script: trainlet run [options] SCRIPT [ARGS]...".into()));
        }
        None => Entrypoint {
            program: String::new(),
            args: Vec::new(),
            script: String::new(),
            python: None,
            cwd: None,
            env: Vec::new(),
        },
        Some((script, rest)) if no_python => {
            // XGBoost's tracker runs in python even when the workers do not.
            let python = match fw {
                Framework::Xgboost => {
                    let (python, src) = resolve_python(args, env)?;
                    s.prov.push(("python", python.clone(), src));
                    Some(python)
                }
                Framework::Torch | Framework::Jax | Framework::Mpi => None,
            };
            Entrypoint {
                program: script.clone(),
                args: rest.to_vec(),
                script: script.clone(),
                python,
                cwd: None,
                env: Vec::new(),
            }
        }
        Some((script, rest)) => {
            let (python, src) = resolve_python(args, env)?;
            s.prov.push(("python", python.clone(), src));
            let mut a = vec!["-u".to_string()];
            if module {
                a.push("-m".into());
            } else if run_path {
                a.extend(["-c".to_string(), RUN_PATH.to_string()]);
            }
            a.push(script.clone());
            a.extend(rest.iter().cloned());
            Entrypoint {
                program: python.clone(),
                args: a,
                script: script.clone(),
                python: Some(python),
                cwd: None,
                env: Vec::new(),
            }
        }
    };

    let omp_default = (nproc > 1 && env.get(env::OMP_NUM_THREADS).is_none()).then(|| "1".to_string());

    Ok((entry, omp_default))
}

pub(super) fn resolve_python(args: &RunArgs, env: &Env) -> Result<(String, Source), Error> {
    let l = lookup(args.python.as_deref(), "--python", env, &[env::TRAINLET_PYTHON, env::PYTHON_EXEC]);
    if let Some(v) = l.value {
        return Ok((v.to_string(), l.source));
    }
    for name in ["python", "python3"] {
        if let Some(p) = env.which(name) {
            return Ok((p.display().to_string(), Source::Derived(format!("{name} on PATH"))));
        }
    }
    Err(Error::Usage(
        "no python interpreter: neither python nor python3 is on PATH; pass --python PATH or set TRAINLET_PYTHON"
            .into(),
    ))
}

/// Python snippet for `--run-path`: run the script via runpy, as torchrun does.
const RUN_PATH: &str = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')";
