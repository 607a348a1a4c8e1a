//! A pod's health before every round: its GPUs through NVML (the
//! pre-flight's checks: lost, ECC, remapped rows and retired pages, MIG;
//! from the second round on, the first is the pre-flight's), the
//! checkpoint directory writable (`--checkpoint-dir`), /dev/shm as large
//! as `--min-shm`. A pod that fails one leaves the job with 207 instead of
//! joining: its GPU or node is at fault, and it is replaced (the
//! runtimes' `podFailurePolicy` counts 207 as a node fault), or a spare
//! takes its place.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::config::Plan;
use crate::process::spawn::Spawner;

/// Most time the checkpoint directory may take to take a file (a hung
/// network mount fails the check rather than hang the pod).
const DIR_LIMIT: Duration = Duration::from_secs(10);

/// The pod's health before it joins a round (`gpus`: its GPUs' too): the
/// exit code it leaves the job with when a check fails (207: it is
/// replaced, or a spare takes its place), said in the log.
pub(super) async fn before_round(plan: &Plan, spawner: &Spawner, gpus: bool) -> Option<u8> {
    match check(plan, spawner, gpus).await {
        Ok(took) => {
            tracing::debug!(took_ms = took.as_secs_f64() * 1e3, "the pod is healthy");
            None
        }
        Err((code, why)) => {
            tracing::error!(
                code,
                "this pod is not healthy: {why}; it leaves the job instead of joining the next round"
            );
            let text = format!("this pod is not healthy (exit {code}): {why}");
            super::finish::left_unhealthy(&text);
            super::finish::termination_message(plan, &text);
            Some(code)
        }
    }
}

/// The pod's checks before a round (`gpus`: with its GPUs'); the exit
/// code and the reason of the first that failed.
async fn check(plan: &Plan, spawner: &Spawner, gpus: bool) -> Result<Duration, (u8, String)> {
    let started = Instant::now();
    let fault = |why: String| (crate::exit::GPU_FAULT, why);
    if let Some(min) = plan.health.min_shm {
        let shm = Path::new("/dev/shm");
        match crate::sys::fs_size(shm) {
            Ok(size) if size < min => {
                return Err(fault(format!(
                    "/dev/shm is {} (--min-shm asks for {}): give the pod a larger memory-backed emptyDir at /dev/shm",
                    bytes(size),
                    bytes(min)
                )));
            }
            Ok(_) => {}
            Err(e) => return Err(fault(format!("cannot measure /dev/shm ({e}) for --min-shm"))),
        }
    }
    if let Some(dir) = plan.health.checkpoint_dir.clone() {
        let shown = dir.display().to_string();
        match tokio::time::timeout(DIR_LIMIT, tokio::task::spawn_blocking(move || writable(&dir))).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => return Err(fault(format!("the checkpoint directory {shown} is not writable: {e}"))),
            Ok(Err(e)) => return Err((crate::exit::INTERNAL, format!("the checkpoint directory's check failed: {e}"))),
            Err(_) => {
                return Err(fault(format!(
                    "the checkpoint directory {shown} took more than {}s to take a file",
                    DIR_LIMIT.as_secs()
                )));
            }
        }
    }
    if gpus && !plan.gpu.gpus.is_empty() {
        let (g, sp) = (plan.gpu.clone(), spawner.clone());
        match tokio::task::spawn_blocking(move || crate::gpu::prepare::health(&g, &sp)).await {
            Ok(None) => {}
            Ok(Some(failed)) => return Err(failed),
            Err(e) => return Err((crate::exit::INTERNAL, format!("the GPUs' health check failed: {e}"))),
        }
    }
    Ok(started.elapsed())
}

/// Make `dir` if missing, then write, sync and remove a file in it.
fn writable(dir: &Path) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let probe: PathBuf = dir.join(format!(".trainlet-health-{}", std::process::id()));
    let mut f = std::fs::File::create(&probe)?;
    let written = f.write_all(b"trainlet").and_then(|()| f.sync_all());
    let removed = std::fs::remove_file(&probe);
    written.and(removed)
}

/// `n` bytes, in the largest binary unit it fills.
fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / f64::from(1u32 << 30)),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / f64::from(1u32 << 20)),
        n => format!("{n} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_made_and_written_and_a_path_under_a_file_is_not() {
        let d = tempfile::tempdir().expect("tmp");
        writable(&d.path().join("a/b")).expect("made and written");
        assert_eq!(std::fs::read_dir(d.path().join("a/b")).expect("dir").count(), 0, "the probe file is removed");
        std::fs::write(d.path().join("file"), b"x").expect("file");
        assert!(writable(&d.path().join("file/ckpt")).is_err());
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(bytes(64 << 20), "64.0 MiB");
        assert_eq!(bytes(12), "12 bytes");
    }
}
