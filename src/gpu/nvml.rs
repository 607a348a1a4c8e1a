//! NVML, only ever in a child process (reference/gpu-pid1.md 2.3).
//!
//! trainlet is a static-glibc binary; dlopening libnvidia-ml.so.1 loads the
//! image's own libc next to it, which works when the versions match and
//! otherwise aborts or crashes inside the loader. So the agent never loads
//! NVML itself: it runs `/proc/self/exe nvml-probe` (hidden subcommand),
//! which loads NVML through nvml-wrapper and prints a JSON [`Report`] per
//! sample on stdout. A probe that crashes, hangs past its timeout or prints
//! garbage costs one warning; the launch goes on with sysfs data, and the
//! checks that need NVML are skipped.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use serde::{Deserialize, Serialize};

use crate::process::spawn::{Spawned, Spawner, WorkerSpec};

/// One GPU as NVML sees it. A field is None when the GPU or driver does not
/// support the query.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlGpu {
    /// NVML index.
    pub index: u32,
    /// PCI bus id, normalised (`dddd:bb:dd.f`); empty if NVML gave none.
    pub bus_id: String,
    /// `GPU-...`.
    pub uuid: Option<String>,
    /// Model name.
    pub name: Option<String>,
    /// Why NVML cannot use this GPU (lost, unreachable), if it cannot.
    pub error: Option<String>,
    /// Uncorrected ECC errors since the driver loaded.
    pub ecc_uncorrected: Option<u64>,
    /// Corrected ECC errors since the driver loaded.
    pub ecc_corrected: Option<u64>,
    /// A row remapping waits for a GPU reset.
    pub remap_pending: Option<bool>,
    /// A row remapping failed.
    pub remap_failed: Option<bool>,
    /// Pages wait for retirement (pre-Ampere).
    pub pages_pending: Option<bool>,
    /// MIG mode now.
    pub mig_current: Option<bool>,
    /// MIG mode after the next reset.
    pub mig_pending: Option<bool>,
    /// Framebuffer bytes in use.
    pub memory_used: Option<u64>,
    /// Framebuffer bytes in all.
    pub memory_total: Option<u64>,
    /// GPU utilisation, percent.
    pub utilization: Option<u32>,
    /// Core temperature, degrees Celsius.
    pub temperature: Option<u32>,
    /// NUMA node NVML gives.
    pub numa_node: Option<u32>,
    /// CPUs NVML says are close to it (a cpulist).
    pub cpus: Option<String>,
    /// SM clock now, MHz.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz: Option<u32>,
    /// Its maximum, MHz.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_max_mhz: Option<u32>,
    /// Why the clocks are held down now: NVML's clocks event (throttle)
    /// reasons, a bit mask (`super::clock_reasons` names them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_reasons: Option<u64>,
    /// PCIe replays since the driver loaded (a degrading link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_replays: Option<u32>,
}

/// What the probe prints: one JSON object per line.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Driver version.
    pub driver: Option<String>,
    /// Every GPU NVML lists, in NVML order.
    pub gpus: Vec<NvmlGpu>,
}

/// The probe itself (`trainlet nvml-probe`): load NVML (`lib`, else the
/// loader's search for libnvidia-ml.so.1), then print a report every
/// `every` (once when None). Runs in the child only.
pub fn probe_main(lib: Option<&Path>, every: Option<Duration>) -> Result<(), String> {
    let mut b = Nvml::builder();
    if let Some(l) = lib {
        b.lib_path(l.as_os_str());
    }
    let nvml = b.init().map_err(|e| format!("NVML init failed: {e}"))?;
    let out = std::io::stdout();
    loop {
        let report = sample(&nvml).map_err(|e| format!("NVML query failed: {e}"))?;
        let line = serde_json::to_string(&report).map_err(|e| e.to_string())?;
        {
            use std::io::Write;
            let mut o = out.lock();
            if writeln!(o, "{line}").and_then(|()| o.flush()).is_err() {
                return Ok(()); // the agent stopped listening
            }
        }
        match every {
            Some(d) => std::thread::sleep(d),
            None => return Ok(()),
        }
    }
}

fn sample(nvml: &Nvml) -> Result<Report, NvmlError> {
    let driver = nvml.sys_driver_version().ok();
    let count = nvml.device_count()?;
    // Affinity mask words: enough for every CPU this process may use, and
    // at least glibc's 1024.
    let words = crate::sys::allowed_cpus().last().map_or(1, |c| *c as usize / 64 + 1).max(16);
    let mut gpus = Vec::new();
    for index in 0..count {
        let dev = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                gpus.push(NvmlGpu { index, error: Some(e.to_string()), ..Default::default() });
                continue;
            }
        };
        let mut g = NvmlGpu { index, ..Default::default() };
        match dev.pci_info() {
            Ok(p) => g.bus_id = super::normalize_bus_id(&p.bus_id).unwrap_or(p.bus_id),
            Err(e) => g.error = Some(e.to_string()),
        }
        // A GPU that fell off the bus answers GpuLost to anything.
        let mut gone: Option<String> = None;
        let mut lost = |r: &NvmlError| {
            if matches!(r, NvmlError::GpuLost | NvmlError::Unknown) && gone.is_none() {
                gone = Some(r.to_string());
            }
        };
        g.uuid = ok(dev.uuid(), &mut lost);
        g.name = ok(dev.name(), &mut lost);
        g.ecc_uncorrected = ok(dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile), &mut lost);
        g.ecc_corrected = ok(dev.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile), &mut lost);
        if let Some((_, _, pending, failed)) = ok(crate::sys::nvml_remapped_rows(nvml, &dev), &mut lost) {
            g.remap_pending = Some(pending);
            g.remap_failed = Some(failed);
        }
        g.pages_pending = ok(dev.are_pages_pending_retired(), &mut lost);
        if let Some(m) = ok(dev.mig_mode(), &mut lost) {
            g.mig_current = Some(m.current != 0);
            g.mig_pending = Some(m.pending != 0);
        }
        if let Some(m) = ok(dev.memory_info(), &mut lost) {
            g.memory_used = Some(m.used);
            g.memory_total = Some(m.total);
        }
        g.utilization = ok(dev.utilization_rates(), &mut lost).map(|u| u.gpu);
        g.temperature = ok(dev.temperature(TemperatureSensor::Gpu), &mut lost);
        g.numa_node = ok(dev.numa_node_id(), &mut lost);
        g.sm_clock_mhz = ok(dev.clock_info(Clock::SM), &mut lost);
        g.sm_clock_max_mhz = ok(dev.max_clock_info(Clock::SM), &mut lost);
        g.clock_reasons = ok(dev.current_throttle_reasons(), &mut lost).map(|r| r.bits());
        g.pcie_replays = ok(dev.pcie_replay_counter(), &mut lost);
        g.cpus = ok(dev.cpu_affinity(words), &mut lost)
            .map(|mask| super::CpuSet::of(crate::sys::mask_ids(&mask)).to_string());
        g.error = g.error.or(gone);
        gpus.push(g);
    }
    Ok(Report { driver, gpus })
}

/// The value, or None after noting the error.
fn ok<T>(r: Result<T, NvmlError>, lost: &mut dyn FnMut(&NvmlError)) -> Option<T> {
    r.inspect_err(|e| lost(e)).ok()
}

/// A running probe: its reports arrive on `lines`.
#[derive(Debug)]
pub struct Probe {
    /// Its pid (and process group).
    pub pid: i32,
    /// One parsed report (or why a line was not one) per line.
    pub lines: std::sync::mpsc::Receiver<Result<Report, String>>,
    /// The last lines of its stderr once it has ended.
    stderr: std::sync::mpsc::Receiver<String>,
}

impl Probe {
    /// Start `trainlet nvml-probe` (with `--every` for a sampling child)
    /// through the one spawner, so the one reaper collects it.
    pub fn start(spawner: &Spawner, every: Option<Duration>) -> Result<Self, String> {
        let exe = std::env::current_exe()
            .ok()
            .filter(|p| p.exists())
            .map_or_else(|| "/proc/self/exe".to_string(), |p| p.display().to_string());
        let mut args = vec!["nvml-probe".to_string()];
        if let Some(d) = every {
            args.extend(["--every".to_string(), format!("{}", d.as_secs_f64())]);
        }
        // The agent's own helper: round-end sweeps spare it from its fork on.
        let spec = WorkerSpec { helper: true, ..WorkerSpec::piped(exe, args, Vec::new()) };
        let sp = spawner.spawn_blocking(spec).map_err(|e| format!("cannot start the NVML probe: {e}"))?;
        Ok(Self::attach(sp))
    }

    fn attach(sp: Spawned) -> Self {
        let (tx, lines) = std::sync::mpsc::channel();
        if let Some(out) = sp.stdout {
            std::thread::spawn(move || {
                for line in BufReader::new(std::fs::File::from(out)).lines() {
                    let Ok(line) = line else { break };
                    let parsed = serde_json::from_str::<Report>(&line)
                        .map_err(|e| format!("the NVML probe printed something else than a report ({e})"));
                    if tx.send(parsed).is_err() {
                        break;
                    }
                }
            });
        }
        let (etx, stderr) = std::sync::mpsc::channel();
        if let Some(err) = sp.stderr {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = std::fs::File::from(err).take(64 * 1024).read_to_string(&mut text);
                let tail: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
                let _ = etx.send(tail[tail.len().saturating_sub(3)..].join(" | "));
            });
        }
        Self { pid: sp.pid, lines, stderr }
    }

    /// The next report, within `timeout`. On a timeout the probe is killed;
    /// on any failure the error says what happened, with its stderr.
    pub fn next(&self, timeout: Duration) -> Result<Report, String> {
        match self.lines.recv_timeout(timeout) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                self.kill();
                Err(format!("the NVML probe did not answer within {timeout:?} and was killed (a hung driver?)"))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let why = self.stderr.recv_timeout(Duration::from_secs(1)).unwrap_or_default();
                Err(if why.is_empty() {
                    "the NVML probe ended without a report (it crashed or was killed)".to_string()
                } else {
                    format!("the NVML probe ended without a report: {why}")
                })
            }
        }
    }

    /// SIGKILL its process group.
    pub fn kill(&self) {
        crate::sys::signal_group(self.pid, libc::SIGKILL);
        crate::process::sweep::release(self.pid);
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        crate::process::sweep::release(self.pid);
    }
}

/// One report from a fresh probe, bounded by `timeout`.
pub fn probe(spawner: &Spawner, timeout: Duration) -> Result<Report, String> {
    let p = Probe::start(spawner, None)?;
    let r = p.next(timeout);
    p.kill();
    r
}
