//! Pre-flight GPU checks, run before any worker starts so a broken GPU
//! fails the pod with a documented exit code instead of hanging NCCL
//! (reference/gpu-pid1.md 6). Pure: the inputs are the sysfs inventory and
//! the NVML probe's report; table-tested.
//!
//! Two exit codes tell a bad node from a bad job ([`crate::exit`]):
//! [`crate::exit::GPU_FAULT`] (207) when the hardware is at fault (fewer GPUs
//! than the pod was given, uncorrected ECC errors, remapped rows pending or
//! failed, a pending MIG change, a lost GPU) and [`crate::exit::GPU_MISMATCH`]
//! (208) when the job asks for what the pod does not have (more workers than
//! GPUs, the wrong MIG mode).

use std::fmt;

use super::Gpu;
use super::nvml::{NvmlGpu, Report};
use crate::exit;

/// One pre-flight check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Check {
    /// GPU count equals `--expect-gpus`, and covers every local rank.
    Count,
    /// No GPU is lost or unreachable through NVML.
    Lost,
    /// No uncorrected (volatile) ECC error.
    Ecc,
    /// No row remapping pending or failed, no page retirement pending.
    Remap,
    /// MIG mode as requested, and no pending MIG change.
    Mig,
}

impl Check {
    /// Every check, in the order they run.
    pub const ALL: [Check; 5] = [Check::Count, Check::Lost, Check::Ecc, Check::Remap, Check::Mig];

    /// Its name in `--preflight`.
    pub fn name(self) -> &'static str {
        match self {
            Check::Count => "count",
            Check::Lost => "lost",
            Check::Ecc => "ecc",
            Check::Remap => "remap",
            Check::Mig => "mig",
        }
    }

    /// Parse `--preflight`: `all`, `none`, or a comma list of names.
    pub fn parse_list(v: &str) -> Result<Vec<Check>, String> {
        match v.trim() {
            "all" => return Ok(Self::ALL.to_vec()),
            "none" | "off" | "" => return Ok(Vec::new()),
            _ => {}
        }
        let mut out = Vec::new();
        for name in v.split(',').map(str::trim) {
            let c = Self::ALL.into_iter().find(|c| c.name() == name).ok_or_else(|| name.to_string())?;
            if !out.contains(&c) {
                out.push(c);
            }
        }
        out.sort();
        Ok(out)
    }

    /// Whether it needs NVML (only `count` works from sysfs alone).
    pub fn needs_nvml(self) -> bool {
        self != Check::Count
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the job asks of the pod's GPUs.
#[derive(Debug, Clone, Default)]
pub struct Expect {
    /// Local ranks.
    pub nproc: u32,
    /// Whether ranks are given GPUs (pin mode other than none).
    pub assign: bool,
    /// `--expect-gpus`.
    pub gpus: Option<u32>,
    /// `--mig on|off`.
    pub mig: Option<bool>,
}

/// How one check went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Passed.
    Pass(String),
    /// Not run, and why.
    Skip(String),
    /// Failed: exit code and message naming the GPU and the check.
    Fail(u8, String),
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The check.
    pub check: Check,
    /// Its result.
    pub status: Status,
}

/// `index 3 (0000:5d:00.0, GPU-...)`.
fn name(i: usize, g: &Gpu) -> String {
    match &g.uuid {
        Some(u) => format!("GPU {i} ({}, {u})", g.bus_id),
        None => format!("GPU {i} ({})", g.bus_id),
    }
}

/// Run `checks` over the visible GPUs `gpus` (CUDA order) with the NVML
/// report, if the probe worked (`nvml` is Err with the reason otherwise).
pub fn run(checks: &[Check], gpus: &[Gpu], want: &Expect, nvml: Result<&Report, &str>) -> Vec<Verdict> {
    checks
        .iter()
        .map(|&check| {
            let status = match (check, nvml) {
                (Check::Count, _) => count(gpus, want),
                (c, Err(why)) if c.needs_nvml() => Status::Skip(format!("NVML unavailable: {why}")),
                (_, Err(_)) => Status::Skip(String::new()),
                (c, Ok(report)) => per_gpu(c, gpus, want, report),
            };
            Verdict { check, status }
        })
        .collect()
}

fn count(gpus: &[Gpu], want: &Expect) -> Status {
    let n = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
    if let Some(e) = want.gpus
        && e != n
    {
        return Status::Fail(
            exit::GPU_FAULT,
            format!(
                "pre-flight check count failed: this pod was given {e} GPUs (--expect-gpus) but {n} are usable \
                 (/proc/driver/nvidia/gpus and /dev/nvidia*): a GPU is missing on this node"
            ),
        );
    }
    if want.assign && n > 0 && want.nproc > n {
        return Status::Fail(
            exit::GPU_MISMATCH,
            format!(
                "pre-flight check count failed: {} workers per node but only {n} GPUs are visible; \
                 set --nproc-per-node to at most {n} (or gpu), or ask for more GPUs",
                want.nproc
            ),
        );
    }
    Status::Pass(format!("{n} GPUs"))
}

fn per_gpu(check: Check, gpus: &[Gpu], want: &Expect, report: &Report) -> Status {
    for (i, g) in gpus.iter().enumerate() {
        let who = name(i, g);
        let Some(n) = report.gpus.iter().find(|n| n.bus_id == g.bus_id) else {
            if check == Check::Lost {
                let unmatched: Vec<String> = report
                    .gpus
                    .iter()
                    .filter(|n| n.bus_id.is_empty())
                    .filter_map(|n| n.error.as_ref().map(|e| format!("NVML index {}: {e}", n.index)))
                    .collect();
                let detail = if unmatched.is_empty() {
                    format!("the driver lists {} GPUs, not this one", report.gpus.len())
                } else {
                    unmatched.join("; ")
                };
                return Status::Fail(
                    exit::GPU_FAULT,
                    format!("pre-flight check lost failed: {who}: not reachable through NVML ({detail})"),
                );
            }
            continue;
        };
        if let Some(fail) = gpu_fails(check, n, want) {
            let code = match (check, fail.1) {
                (Check::Mig, true) => exit::GPU_MISMATCH,
                _ => exit::GPU_FAULT,
            };
            return Status::Fail(code, format!("pre-flight check {check} failed: {who}: {}", fail.0));
        }
    }
    Status::Pass(format!("{} GPUs", gpus.len()))
}

/// Why `n` fails `check`, and whether the job (not the node) is at fault.
fn gpu_fails(check: Check, n: &NvmlGpu, want: &Expect) -> Option<(String, bool)> {
    match check {
        Check::Count => None,
        Check::Lost => n.error.as_ref().map(|e| (format!("NVML cannot use it: {e}"), false)),
        Check::Ecc => n
            .ecc_uncorrected
            .filter(|&c| c > 0)
            .map(|c| (format!("{c} uncorrected ECC errors since the driver loaded; drain the node"), false)),
        Check::Remap => {
            if n.remap_failed == Some(true) {
                Some(("row remapping failed: the GPU needs replacing".to_string(), false))
            } else if n.remap_pending == Some(true) {
                Some(("row remapping pending: reset the GPU before use".to_string(), false))
            } else if n.pages_pending == Some(true) {
                Some(("page retirement pending: reset the GPU before use".to_string(), false))
            } else {
                None
            }
        }
        Check::Mig => {
            let on = |b: bool| if b { "on" } else { "off" };
            match (n.mig_current, n.mig_pending) {
                (Some(c), Some(p)) if c != p => {
                    Some((format!("MIG mode change pending ({} now, {} after a GPU reset)", on(c), on(p)), false))
                }
                (Some(c), _) if want.mig.is_some_and(|w| w != c) => {
                    Some((format!("MIG is {} but the job asks for MIG {} (--mig)", on(c), on(!c)), true))
                }
                _ => None,
            }
        }
    }
}

/// The first failure: its exit code and message.
pub fn first_failure(verdicts: &[Verdict]) -> Option<(u8, &str)> {
    verdicts.iter().find_map(|v| match &v.status {
        Status::Fail(code, msg) => Some((*code, msg.as_str())),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn gpus(n: u32) -> Vec<Gpu> {
        crate::gpu::test_gpus(n, 0x18, "")
    }

    fn report(n: u32, fault: impl Fn(&mut NvmlGpu)) -> Report {
        let mut r = Report {
            driver: Some("580.95.05".into()),
            gpus: gpus(n)
                .into_iter()
                .map(|g| NvmlGpu {
                    index: g.ordinal,
                    bus_id: g.bus_id,
                    uuid: g.uuid,
                    ecc_uncorrected: Some(0),
                    remap_pending: Some(false),
                    remap_failed: Some(false),
                    mig_current: Some(false),
                    mig_pending: Some(false),
                    ..Default::default()
                })
                .collect(),
        };
        if let Some(g) = r.gpus.get_mut(2) {
            fault(g);
        }
        r
    }

    fn want(nproc: u32) -> Expect {
        Expect { nproc, assign: true, gpus: None, mig: None }
    }

    #[test_case(|g| g.ecc_uncorrected = Some(3), Check::Ecc, exit::GPU_FAULT, "3 uncorrected ECC errors"; "ecc")]
    #[test_case(|g| g.remap_pending = Some(true), Check::Remap, exit::GPU_FAULT, "row remapping pending"; "remap pending")]
    #[test_case(|g| g.remap_failed = Some(true), Check::Remap, exit::GPU_FAULT, "row remapping failed"; "remap failed")]
    #[test_case(|g| g.pages_pending = Some(true), Check::Remap, exit::GPU_FAULT, "page retirement pending"; "pages")]
    #[test_case(|g| g.error = Some("GPU is lost".into()), Check::Lost, exit::GPU_FAULT, "NVML cannot use it: GPU is lost"; "lost")]
    #[test_case(|g| { g.bus_id.clear(); g.error = Some("GPU is lost".into()) }, Check::Lost, exit::GPU_FAULT, "not reachable through NVML (NVML index 2: GPU is lost)"; "lost before its bus id")]
    #[test_case(|g| g.bus_id = "0000:99:00.0".into(), Check::Lost, exit::GPU_FAULT, "not reachable through NVML (the driver lists 4 GPUs, not this one)"; "missing from nvml")]
    #[test_case(|g| g.mig_pending = Some(true), Check::Mig, exit::GPU_FAULT, "MIG mode change pending (off now, on after a GPU reset)"; "mig pending")]
    fn each_fault_names_its_check_and_gpu(fault: fn(&mut NvmlGpu), check: Check, code: u8, what: &str) {
        let r = report(4, fault);
        let v = run(&Check::ALL, &gpus(4), &want(4), Ok(&r));
        let (got, msg) = first_failure(&v).expect("a failure");
        assert_eq!(got, code, "{msg}");
        assert!(msg.starts_with(&format!("pre-flight check {check} failed: GPU 2 (0000:1a:00.0, GPU-2): ")), "{msg}");
        assert!(msg.contains(what), "{msg}");
        // Without that check, everything passes.
        let rest: Vec<Check> = Check::ALL.into_iter().filter(|c| *c != check).collect();
        assert_eq!(first_failure(&run(&rest, &gpus(4), &want(4), Ok(&r))), None);
    }

    #[test]
    fn healthy_gpus_pass_and_mig_follows_the_request() {
        let r = report(4, |_| {});
        assert!(run(&Check::ALL, &gpus(4), &want(4), Ok(&r)).iter().all(|v| matches!(v.status, Status::Pass(_))));
        let on = Expect { mig: Some(true), ..want(4) };
        let (code, msg) =
            first_failure(&run(&Check::ALL, &gpus(4), &on, Ok(&r))).map(|(c, m)| (c, m.to_string())).expect("mig");
        assert_eq!(code, exit::GPU_MISMATCH);
        assert!(msg.contains("GPU 0 (0000:18:00.0, GPU-0): MIG is off but the job asks for MIG on"), "{msg}");
    }

    #[test]
    fn counts() {
        let v = run(&[Check::Count], &gpus(7), &Expect { gpus: Some(8), ..want(7) }, Err("x"));
        let (c, m) = first_failure(&v).expect("fault");
        assert_eq!(c, exit::GPU_FAULT);
        assert!(m.contains("given 8 GPUs (--expect-gpus) but 7 are usable"), "{m}");
        let v = run(&[Check::Count], &gpus(2), &want(4), Err("x"));
        let (c, m) = first_failure(&v).expect("mismatch");
        assert_eq!(c, exit::GPU_MISMATCH);
        assert!(m.contains("4 workers per node but only 2 GPUs"), "{m}");
        // A CPU job on a machine without GPUs, or ranks not given GPUs, passes.
        assert_eq!(first_failure(&run(&[Check::Count], &[], &want(4), Err("x"))), None);
        assert_eq!(
            first_failure(&run(&[Check::Count], &gpus(2), &Expect { assign: false, ..want(4) }, Err("x"))),
            None
        );
    }

    #[test]
    fn without_nvml_the_health_checks_are_skipped_not_failed() {
        let v = run(&Check::ALL, &gpus(2), &want(2), Err("libnvidia-ml.so.1: cannot open shared object file"));
        assert_eq!(first_failure(&v), None);
        assert!(matches!(&v[1].status, Status::Skip(why) if why.contains("cannot open shared object")));
    }

    #[test]
    fn lists() {
        assert_eq!(Check::parse_list("all"), Ok(Check::ALL.to_vec()));
        assert_eq!(Check::parse_list("none"), Ok(vec![]));
        assert_eq!(Check::parse_list("mig, ecc,ecc"), Ok(vec![Check::Ecc, Check::Mig]));
        assert_eq!(Check::parse_list("ecc,temp"), Err("temp".to_string()));
    }
}
