//! A real memory cgroup for the tests whose point is memory (cgroup v1's
//! `memory` hierarchy, else cgroup v2 with the memory controller; needs
//! root): a limit the kernel enforces with its OOM killer, the peak it
//! saw, and its kills. A process is started inside it through `/bin/sh`
//! (as `hardening.rs` does for its pids cgroup); whatever is left in it is
//! killed and the cgroup removed when it is dropped.

use std::path::{Path, PathBuf};

/// A memory cgroup of the tests.
pub(crate) struct MemCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemCgroup {
    /// A new cgroup `trainlet-test-<tag>-<pid>` whose processes may use
    /// `limit` bytes together.
    pub(crate) fn new(tag: &str, limit: u64) -> MemCgroup {
        let name = format!("trainlet-test-{tag}-{}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let v2 = Path::new("/sys/fs/cgroup");
        let cg = if v1.join("memory.limit_in_bytes").exists() {
            MemCgroup { dir: v1.join(name), v2: false }
        } else {
            let controllers = std::fs::read_to_string(v2.join("cgroup.controllers")).unwrap_or_default();
            assert!(
                controllers.split_whitespace().any(|c| c == "memory"),
                "this test needs the memory cgroup controller (v1 /sys/fs/cgroup/memory or v2) and root"
            );
            let _ = std::fs::write(v2.join("cgroup.subtree_control"), "+memory");
            MemCgroup { dir: v2.join(name), v2: true }
        };
        std::fs::create_dir_all(&cg.dir).expect("create a memory cgroup (needs root)");
        let (file, swap) = if cg.v2 { ("memory.max", "memory.swap.max") } else { ("memory.limit_in_bytes", "") };
        std::fs::write(cg.dir.join(file), limit.to_string()).expect("the memory limit");
        if !swap.is_empty() {
            // No swap either: the limit is the limit.
            let _ = std::fs::write(cg.dir.join(swap), "0");
        }
        cg
    }

    /// `cgroup.procs`, where a process writes its pid to join.
    pub(crate) fn procs(&self) -> String {
        self.dir.join("cgroup.procs").display().to_string()
    }

    /// The most its processes used at once since it was made or [`Self::reset_peak`].
    pub(crate) fn peak(&self) -> u64 {
        let file = if self.v2 { "memory.peak" } else { "memory.max_usage_in_bytes" };
        read_number(&self.dir.join(file))
    }

    /// Start the peak afresh (v2 kernels before 6.12 cannot: the peak then
    /// stays the cgroup's).
    pub(crate) fn reset_peak(&self) {
        let (file, value) = if self.v2 { ("memory.peak", "reset") } else { ("memory.max_usage_in_bytes", "0") };
        let _ = std::fs::write(self.dir.join(file), value);
    }

    /// How many processes the OOM killer killed in it.
    pub(crate) fn oom_kills(&self) -> u64 {
        let file = if self.v2 { "memory.events" } else { "memory.oom_control" };
        let text = std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
        text.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|n| n.trim().parse().ok()).unwrap_or(0)
    }

    /// `program args` as `/bin/sh` arguments that move the shell into this
    /// cgroup first, then exec it (the pid stays the program's).
    pub(crate) fn wrap(&self, program: &Path, args: &[&str]) -> Vec<String> {
        crate::util::cgroup_argv(&self.procs(), program, args)
    }
}

fn read_number(path: &Path) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.trim().parse().unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()))
}

/// The peak resident memory of process `pid` (VmHWM), in bytes.
pub(crate) fn vm_hwm(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        crate::util::remove_cgroup(&self.dir);
    }
}
