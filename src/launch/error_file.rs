//! The launcher's own `TORCHELASTIC_ERROR_FILE`: when it is set in the
//! agent's environment (a scheduler built on torchelastic set it, as for
//! torchrun), a failed or stopped job leaves its root cause there in the
//! JSON torchrun's `@record` writes (`torch/distributed/elastic/
//! multiprocessing/errors`, reference/torch.md 3.5):
//!
//! - the root cause's worker wrote an error file on this pod: that JSON,
//!   with `message.errorCode` set to the worker's exit code (negative for a
//!   signal), as torchrun's `dump_error_file` copies it;
//! - it wrote one on another pod: its message and traceback (every pod
//!   shares them through the store) in the same shape;
//! - no worker error file (no `@record`, a signal, a hang, a stop, a launch
//!   error): trainlet's reason in that shape. torchrun writes nothing when
//!   the root cause has no error file; a scheduler reading the file is
//!   better told why.
//!
//! A worker's file is read at most `report::ERROR_FILE_MAX` bytes, as
//! every reading of it is: a worker cannot make PID 1 read without end.

use std::path::Path;

use serde_json::{Value, json};

use crate::supervise::report::{ERROR_FILE_MAX, Failure, read_error_file};
use crate::sys::Exit;

/// A worker's error file as JSON, when it is a torch error record (an
/// object with `message`) of at most `ERROR_FILE_MAX` bytes.
fn read_worker_file(path: &Path) -> Option<Value> {
    let Ok(text) = read_error_file(path)? else {
        tracing::warn!(path = %path.display(), max = ERROR_FILE_MAX, "a worker's error file is too large to copy");
        return None;
    };
    let value: Value = serde_json::from_slice(&text).ok()?;
    value.get("message").is_some().then_some(value)
}

/// The worker's exit code as torchrun's `ProcessFailure.exitcode`: the
/// code, or minus the signal.
fn torch_exit_code(f: &Failure) -> i64 {
    match f.exit() {
        Exit::Code(c) => i64::from(c),
        Exit::Signal(s) => -i64::from(s),
    }
}

/// torchrun's record: `{"message": {"message", "extraInfo": {"py_callstack",
/// "timestamp"}, "errorCode"?}}`.
fn record(message: &str, callstack: &str, at_s: u64, code: Option<i64>) -> Value {
    let mut m = json!({
        "message": message,
        "extraInfo": {"py_callstack": callstack, "timestamp": at_s.to_string()},
    });
    if let Some(code) = code {
        m["errorCode"] = json!(code);
    }
    json!({ "message": m })
}

/// The record for a failed or stopped job: from the root cause's own error
/// file when it is on this pod (`node_rank`), else from what every pod
/// knows of it, else from `reason`.
pub(super) fn for_job(root: Option<&Failure>, node_rank: u32, reason: &str, now_s: u64) -> Value {
    let Some(f) = root else {
        return record(reason, "", now_s, None);
    };
    let code = torch_exit_code(f);
    let local =
        f.error_file.as_deref().filter(|_| f.node_rank == node_rank).and_then(|p| read_worker_file(Path::new(p)));
    if let Some(mut v) = local {
        // As torch's override_error_code_in_rootcause_data: only an object
        // message takes the code, and a code of 0 is not written.
        if code != 0
            && let Some(m) = v.get_mut("message").and_then(Value::as_object_mut)
        {
            m.insert("errorCode".into(), json!(code));
        }
        return v;
    }
    let at_s = f.at_us / 1_000_000;
    let message = f.message.clone().unwrap_or_else(|| reason.to_string());
    record(&message, f.traceback.as_deref().unwrap_or(""), at_s, Some(code))
}

/// The record for a launch that failed before it had a job outcome (bad
/// flags, a rendezvous timeout): trainlet's error, as torchrun's `@record`
/// records the exception its main raised.
pub fn for_error(message: &str, now_s: u64) -> Value {
    record(message, "", now_s, None)
}

/// Write `record` to `path`, replacing what is there (as torch does);
/// a failure is logged, never fatal.
pub fn write(path: &Path, record: &Value) {
    let done = serde_json::to_vec(record).map_err(std::io::Error::other).and_then(|bytes| {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, bytes)
    });
    match done {
        Ok(()) => {
            tracing::info!(path = %path.display(), "the root cause written to the launcher's TORCHELASTIC_ERROR_FILE")
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the launcher's TORCHELASTIC_ERROR_FILE")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(node_rank: u32, error_file: Option<String>) -> Failure {
        let mut f = crate::supervise::report::tests::failure(1, 1_795_369_936_000_000);
        f.local_rank = 1;
        f.node_rank = node_rank;
        f.error_file = error_file;
        f.message = Some("ValueError: boom".into());
        f.traceback = Some("Traceback ...".into());
        f
    }

    #[test]
    fn a_local_worker_file_is_copied_with_the_exit_code() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("error.json");
        let worker = r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback", "timestamp": "17"}}}"#;
        std::fs::write(&path, worker).expect("write");
        let f = failure(0, Some(path.display().to_string()));
        let v = for_job(Some(&f), 0, "reason", 99);
        assert_eq!(v["message"]["errorCode"], 3);
        assert_eq!(v["message"]["extraInfo"]["timestamp"], "17");
        assert_eq!(v["message"]["message"], "ValueError: boom");
    }

    #[test]
    fn a_signal_is_a_negative_code_as_torchrun_gives_it() {
        let mut f = failure(1, None);
        f.exit_code = None;
        f.signal = Some(9);
        let v = for_job(Some(&f), 0, "reason", 99);
        assert_eq!(v["message"]["errorCode"], -9);
    }

    /// Every pod's worker files have the same path in containers (the
    /// same run id, pid 1): another pod's root cause is never read from
    /// this pod's file of the same local rank.
    #[test]
    fn another_pods_root_cause_comes_from_the_shared_record_not_a_local_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("error.json");
        std::fs::write(&path, r#"{"message": {"message": "this pod's own"}}"#).expect("write");
        let f = failure(1, Some(path.display().to_string()));
        let v = for_job(Some(&f), 0, "reason", 99);
        assert_eq!(v["message"]["message"], "ValueError: boom");
        assert_eq!(v["message"]["extraInfo"]["py_callstack"], "Traceback ...");
        assert_eq!(v["message"]["extraInfo"]["timestamp"], "1795369936");
        assert_eq!(v["message"]["errorCode"], 3);
    }

    #[test]
    fn an_oversized_or_foreign_worker_file_is_not_copied() {
        let dir = tempfile::tempdir().expect("tmp");
        let big = dir.path().join("big.json");
        let huge = format!(r#"{{"message": "{}"}}"#, "x".repeat(1 << 20));
        std::fs::write(&big, huge).expect("write");
        let v = for_job(Some(&failure(0, Some(big.display().to_string()))), 0, "reason", 99);
        assert_eq!(v["message"]["message"], "ValueError: boom");
        let odd = dir.path().join("odd.json");
        std::fs::write(&odd, "[1, 2]").expect("write");
        let v = for_job(Some(&failure(0, Some(odd.display().to_string()))), 0, "reason", 99);
        assert_eq!(v["message"]["message"], "ValueError: boom");
    }

    #[test]
    fn without_a_root_cause_the_reason_is_recorded() {
        let v = for_job(None, 0, "stopped by SIGTERM", 99);
        assert_eq!(v["message"]["message"], "stopped by SIGTERM");
        assert_eq!(v["message"]["extraInfo"]["timestamp"], "99");
        assert!(v["message"].get("errorCode").is_none());
        let e = for_error("--nnodes value \"x\"", 5);
        assert_eq!(e["message"]["message"], "--nnodes value \"x\"");
    }
}
