//! argv[0] `python`/`python3`: the Kubeflow SDK's JAX and XGBoost jobs
//! under trainlet, unchanged.
//!
//! The SDK's `CustomTrainer` always sets the TrainJob's `command`, which
//! replaces the image's ENTRYPOINT. For a runtime with `mlPolicy.torch` the
//! command ends in `torchrun "file.py"`, which reaches trainlet through the
//! image's `torchrun` link. For every other policy but MPI (JAX, XGBoost)
//! it is `bash -c "<pip install ...>; read -r -d '' SCRIPT << EOM ... EOM;
//! printf ... > "file.py"; python "file.py"` (kubeflow 0.5,
//! `kubeflow.trainer.constants.DEFAULT_COMMAND`), so without more the job
//! runs unsupervised (JAX) or fails for want of a tracker (XGBoost).
//!
//! trainlet's JAX and XGBoost images therefore put a directory first on
//! PATH (`/usr/local/lib/trainlet/python`, images/*-runtime.Dockerfile)
//! holding links `python` and `python3` to trainlet. Invoked so, trainlet
//! decides ([`decide`], a pure function of argv and the environment):
//!
//! - **the job's entry** (`python FILE.py [ARGS]`: a `.py` file first, no
//!   interpreter option before it, in a container that Trainer's JAX or
//!   XGBoost policy made: `JAX_*`/`DMLC_*` set, or `TRAINLET_FRAMEWORK`
//!   jax/xgboost; and not inside an agent's worker) runs as
//!   `trainlet run --python REAL FILE.py [ARGS]`, exec'd in place, so the
//!   pod gets exactly what a `trainlet run` user gets and `trainlet stop`
//!   finds it;
//! - **everything else** (`python -m pip install ...`, `python -c ...`,
//!   `python -m ensurepip`, an interactive `python`, any call from a worker
//!   (`TORCHELASTIC_RUN_ID` is set there, by trainlet as by torchrun), any
//!   call in a container without Trainer's JAX/XGBoost env: initializers,
//!   torch jobs) is exec'd as the real interpreter, with the same argv.
//!
//! The real interpreter is the first `python` (then `python3`) on PATH that
//! is not trainlet itself, exec'd by its path as found (not resolved), with
//! that path as argv[0], so a virtualenv's interpreter still finds its
//! `pyvenv.cfg` and `sys.executable` is the interpreter, not the link. The
//! workers of the run get it through `--python`, so they never pass through
//! the link at all. Nothing is written at run time: links in the image, an
//! exec, works as any uid on a read-only root filesystem.
//!
//! Considered and not taken: a runtime `command` naming trainlet (the SDK
//! overwrites `command`); `args` (the SDK's `bash -c SCRIPT` takes extra
//! words as `$0`, `$1`: ignored); a bash function in `BASH_ENV` (it would
//! follow every bash a worker starts, and shadows `python` for pip too
//! unless it re-implements this decision in shell); a `sitecustomize` or
//! `.pth` hook in the interpreter (runs in every python, pip included,
//! before argv is final, and would need the image's site-packages); a link
//! named `python` in `/usr/local/bin` (that is where python:3 images keep
//! the real one).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use crate::env::{self, Env};

/// Where the images keep the links (first on their PATH).
pub const LINK_DIR: &str = "/usr/local/lib/trainlet/python";

/// What a `python` invocation becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// The job's entry: `trainlet run FILE.py ARGS` for this framework.
    Supervise {
        /// `jax` or `xgboost`.
        framework: &'static str,
    },
    /// The real interpreter, same arguments.
    Plain,
}

/// Decide what `python ARGS` is, from ARGS and the environment alone.
pub fn decide(args: &[String], env: &Env) -> Entry {
    // A worker of an agent (trainlet's or torchrun's): never a second agent.
    if env.get(env::TORCHELASTIC_RUN_ID).is_some() {
        return Entry::Plain;
    }
    let is_script = args.first().is_some_and(|a| !a.starts_with('-') && a.ends_with(".py"));
    if !is_script {
        return Entry::Plain;
    }
    let framework = match env.get(env::TRAINLET_FRAMEWORK).map(str::trim) {
        Some("jax") => Some("jax"),
        Some("xgboost") => Some("xgboost"),
        Some(_) => None,
        // Trainer's torch policy (PET_*) runs `torchrun`, not python; only
        // the JAX and XGBoost policies' env makes a python entry a job.
        None if [env::PET_NNODES, env::PET_NODE_RANK, env::PET_MASTER_ADDR].iter().any(|n| env.get(n).is_some()) => {
            None
        }
        None if [env::JAX_COORDINATOR_ADDRESS, env::JAX_NUM_PROCESSES].iter().any(|n| env.get(n).is_some()) => {
            Some("jax")
        }
        None if [env::DMLC_TRACKER_URI, env::DMLC_NUM_WORKER].iter().any(|n| env.get(n).is_some()) => Some("xgboost"),
        None => None,
    };
    framework.map_or(Entry::Plain, |framework| Entry::Supervise { framework })
}

/// The real interpreter for the name trainlet was called by: that name on
/// PATH, skipping trainlet itself, then `python3` for `python` (Debian-based
/// images have only `python3`). `TRAINLET_PYTHON` wins when set.
pub fn real_python(name: &str, env: &Env, me: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = env.get(env::TRAINLET_PYTHON) {
        // A name is looked up as the others; a path that is the link itself is refused (a loop).
        return if p.contains('/') {
            Some(PathBuf::from(p)).filter(|p| me.is_none() || std::fs::canonicalize(p).ok().as_deref() != me)
        } else {
            on_path_but(p, env, me)
        };
    }
    let names: &[&str] = if name == "python3" { &["python3"] } else { &[name, "python3"] };
    names.iter().find_map(|n| on_path_but(n, env, me))
}

/// The first executable `name` on PATH that is not `me` (links resolved).
fn on_path_but(name: &str, env: &Env, me: Option<&Path>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    env.get("PATH")?.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(name)).find(|p| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            && std::fs::canonicalize(p).ok().as_deref() != me
    })
}

/// Run as `name ARGS` (`name` is `python` or `python3`): exec the real
/// interpreter or `trainlet run`; returns only when that fails, with the
/// exit code (127 as a shell's "not found", 126 as "cannot execute").
pub fn main(name: &str, raw: &[std::ffi::OsString]) -> u8 {
    // Decided on text; exec'd with the arguments as given (a non-UTF-8
    // argument reaches the interpreter intact).
    let args: Vec<String> = raw.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let env = Env::from_process();
    let me = crate::sys::own_exe();
    let Some(real) = real_python(name, &env, me.as_deref()) else {
        eprintln!(
            "trainlet (as {name}): no {name} or python3 on PATH besides trainlet's link; set TRAINLET_PYTHON to the interpreter"
        );
        return crate::exit::WORKER_NOT_FOUND;
    };
    let err = match decide(&args, &env) {
        Entry::Plain => std::process::Command::new(&real).arg0(&real).args(raw).exec(),
        Entry::Supervise { framework } => {
            let Some(me) = me else {
                eprintln!("trainlet (as {name}): cannot find its own binary (/proc/self/exe)");
                return crate::exit::INTERNAL;
            };
            eprintln!(
                "trainlet: {name} {} is this {framework} pod's entry: running it as trainlet run (interpreter {})",
                args.join(" "),
                real.display()
            );
            std::process::Command::new(me).arg0("trainlet").arg("run").arg("--python").arg(&real).args(raw).exec()
        }
    };
    eprintln!("trainlet (as {name}): cannot execute {}: {err}", real.display());
    if err.kind() == std::io::ErrorKind::NotFound {
        crate::exit::WORKER_NOT_FOUND
    } else {
        crate::exit::WORKER_NOT_EXECUTABLE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    const JAX: &[(&str, &str)] = &[("JAX_COORDINATOR_ADDRESS", "j-node-0-0.j:29500"), ("JAX_PROCESS_ID", "1")];
    const XGB: &[(&str, &str)] = &[("DMLC_TRACKER_URI", "x-node-0-0.x"), ("DMLC_NUM_WORKER", "4")];
    const TORCH: &[(&str, &str)] = &[("PET_NNODES", "2"), ("DMLC_TRACKER_URI", "x")];
    const NONE: &[(&str, &str)] = &[];

    fn sup(framework: &'static str) -> Entry {
        Entry::Supervise { framework }
    }

    #[test_case("python funcs.py", JAX, sup("jax"); "the sdk's jax entry")]
    #[test_case("python funcs.py", XGB, sup("xgboost"); "the sdk's xgboost entry")]
    #[test_case("python train.py --lr 0.1", XGB, sup("xgboost"); "a script with its arguments")]
    #[test_case("python /home/u/ipykernel_9/123.py", JAX, sup("jax"); "a path")]
    #[test_case("python -m pip install --user numpy", JAX, Entry::Plain; "pip")]
    #[test_case("python -m ensurepip", XGB, Entry::Plain; "ensurepip")]
    #[test_case("python -c print(1)", JAX, Entry::Plain; "a program string")]
    #[test_case("python -u funcs.py", JAX, Entry::Plain; "an option first is a plain call")]
    #[test_case("python", JAX, Entry::Plain; "interactive")]
    #[test_case("python setup", JAX, Entry::Plain; "not a .py file")]
    #[test_case("python funcs.py", NONE, Entry::Plain; "not a trainer pod")]
    #[test_case("python funcs.py", TORCH, Entry::Plain; "a torch pod runs torchrun")]
    fn decided(argv: &str, env: &[(&str, &str)], want: Entry) {
        let args: Vec<String> = argv.split(' ').skip(1).map(String::from).collect();
        assert_eq!(decide(&args, &Env::from_pairs(env.iter().copied())), want);
    }

    #[test]
    fn a_worker_and_trainlet_framework_are_honoured() {
        let args = vec!["funcs.py".to_string()];
        let worker = Env::from_pairs(JAX.iter().copied().chain([("TORCHELASTIC_RUN_ID", "job")]));
        assert_eq!(decide(&args, &worker), Entry::Plain, "a worker's python never nests an agent");
        let pinned = Env::from_pairs([("TRAINLET_FRAMEWORK", "xgboost")]);
        assert_eq!(decide(&args, &pinned), sup("xgboost"));
        let torch = Env::from_pairs(XGB.iter().copied().chain([("TRAINLET_FRAMEWORK", "torch")]));
        assert_eq!(decide(&args, &torch), Entry::Plain);
    }

    #[test]
    fn the_real_interpreter_is_found_past_the_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let (links, bin) = (dir.path().join("links"), dir.path().join("bin"));
        for d in [&links, &bin] {
            std::fs::create_dir(d).expect("mkdir");
        }
        let me = dir.path().join("trainlet");
        std::fs::write(&me, "").expect("write");
        std::fs::set_permissions(&me, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        for n in ["python", "python3"] {
            std::os::unix::fs::symlink(&me, links.join(n)).expect("link");
        }
        let py3 = bin.join("python3");
        std::fs::write(&py3, "").expect("write");
        std::fs::set_permissions(&py3, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let path = format!("{}:{}", links.display(), bin.display());
        let env = Env::from_pairs([("PATH", path.as_str())]);
        let me = std::fs::canonicalize(&me).expect("canon");
        // Only python3 exists besides the links: `python` falls back to it.
        assert_eq!(real_python("python", &env, Some(&me)), Some(py3.clone()));
        assert_eq!(real_python("python3", &env, Some(&me)), Some(py3));
        let pinned = Env::from_pairs([("PATH", path.as_str()), ("TRAINLET_PYTHON", "/opt/py/bin/python")]);
        assert_eq!(real_python("python", &pinned, Some(&me)), Some(PathBuf::from("/opt/py/bin/python")));
        let only_links = Env::from_pairs([("PATH", links.to_str().expect("utf8"))]);
        assert_eq!(real_python("python", &only_links, Some(&me)), None);
    }
}
