//! How much memory a store may hold for its clients.
//!
//! The default is a quarter of the container's memory limit (cgroup v2
//! `memory.max`, or v1 `memory.limit_in_bytes`), or of the machine's memory
//! when the container has no limit, and never less than [`MIN_BUDGET`].
//! `--store-memory` (env `TRAINLET_STORE_MEMORY`) sets it.

use std::path::Path;

/// The smallest budget: room for any job's rendezvous and worker keys.
pub const MIN_BUDGET: u64 = 64 * 1024 * 1024;

/// The default budget, reading `/` (tests pass another root).
pub fn default_budget(root: &Path) -> u64 {
    let limit = cgroup_limit(root).or_else(|| mem_total(root)).unwrap_or(4 * 1024 * 1024 * 1024);
    (limit / 4).max(MIN_BUDGET)
}

/// The memory limit of this process's cgroup, if it has one.
fn cgroup_limit(root: &Path) -> Option<u64> {
    let cgroups = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let unified = cgroups.lines().find_map(|l| l.strip_prefix("0::"));
    let v1 = cgroups.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == "memory").then_some(path)
    });
    let read = |file: &Path| -> Option<u64> { std::fs::read_to_string(file).ok()?.trim().parse().ok() };
    let v2 = unified.and_then(|rel| {
        let dir = root.join("sys/fs/cgroup").join(rel.trim().trim_start_matches('/'));
        read(&dir.join("memory.max")).or_else(|| read(&root.join("sys/fs/cgroup/memory.max")))
    });
    let v1 = || {
        let rel = v1?.trim().trim_start_matches('/');
        let base = root.join("sys/fs/cgroup/memory");
        read(&base.join(rel).join("memory.limit_in_bytes")).or_else(|| read(&base.join("memory.limit_in_bytes")))
    };
    // v1 reports "no limit" as a huge page-rounded number.
    v2.or_else(v1).filter(|l| *l < (1 << 60))
}

fn mem_total(root: &Path) -> Option<u64> {
    let info = std::fs::read_to_string(root.join("proc/meminfo")).ok()?;
    let kib: u64 =
        info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// A byte count as a user writes it: `1073741824`, `512M`, `2G`, `2Gi`,
/// `64KiB` (binary multiples; case-insensitive).
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(digits);
    let n: u64 = n.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "ki" | "kib" | "kb" => 10,
        "m" | "mi" | "mib" | "mb" => 20,
        "g" | "gi" | "gib" | "gb" => 30,
        "t" | "ti" | "tib" | "tb" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn tree(cgroup: &str, files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(d.path().join("proc/self")).expect("mkdir");
        std::fs::write(d.path().join("proc/self/cgroup"), cgroup).expect("write");
        std::fs::write(d.path().join("proc/meminfo"), "MemTotal:       16384000 kB\n").expect("write");
        for (path, content) in files {
            let p = d.path().join(path);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, content).expect("write");
        }
        d
    }

    #[test]
    fn a_quarter_of_the_cgroup_v2_limit() {
        let t = tree("0::/kubepods/pod1/ctr\n", &[("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "8589934592\n")]);
        assert_eq!(default_budget(t.path()), 2 * 1024 * 1024 * 1024);
    }

    #[test]
    fn a_quarter_of_the_cgroup_v1_limit() {
        let t = tree(
            "12:cpu,cpuacct:/x\n4:memory:/kubepods/pod1\n",
            &[("sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes", "1073741824\n")],
        );
        assert_eq!(default_budget(t.path()), 256 * 1024 * 1024);
    }

    #[test]
    fn no_limit_means_a_quarter_of_the_machine() {
        let t = tree("0::/user.slice\n", &[("sys/fs/cgroup/user.slice/memory.max", "max\n")]);
        assert_eq!(default_budget(t.path()), 16_384_000 * 1024 / 4);
    }

    #[test]
    fn never_below_the_minimum() {
        let t = tree("0::/small\n", &[("sys/fs/cgroup/small/memory.max", "100000000\n")]);
        assert_eq!(default_budget(t.path()), MIN_BUDGET);
    }

    #[test_case("1048576", Some(1 << 20); "plain")]
    #[test_case("512M", Some(512 << 20); "mega")]
    #[test_case("2Gi", Some(2 << 30); "gibi")]
    #[test_case("64KiB", Some(64 << 10); "kibibytes")]
    #[test_case("1.5G", None; "fractions are refused")]
    #[test_case("-1", None; "negative")]
    #[test_case("99999999999T", None; "overflow")]
    #[test_case("", None; "empty")]
    fn sizes(s: &str, want: Option<u64>) {
        assert_eq!(parse_size(s), want);
    }
}
