//! Prometheus metrics: the agent's own counters (always counted: an atomic
//! add each) and per-GPU gauges sampled through the NVML child, served as
//! text at `GET /metrics` on `--metrics-addr` (off by default).
//!
//! Families (the book lists them, `docs/src/metrics.md`): `trainlet_workers_started_total`,
//! `trainlet_worker_exits_total{code}`, `trainlet_restarts_total`,
//! `trainlet_spare`, `trainlet_spare_takeovers_total`,
//! `trainlet_rendezvous_duration_seconds`, `trainlet_store_connections_total`,
//! `trainlet_store_operations_total{op}`, `trainlet_gpu_nvml_up`, and per GPU
//! (`gpu` = CUDA index, `bus_id`, `uuid`): `trainlet_gpu_utilization_ratio`,
//! `trainlet_gpu_memory_used_bytes`, `trainlet_gpu_memory_total_bytes`,
//! `trainlet_gpu_temperature_celsius`, `trainlet_gpu_ecc_errors_total{type}`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::gpu::Gpu;
use crate::gpu::nvml::{Probe, Report};
use crate::process::spawn::Spawner;

/// Why metrics cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be bound.
    #[error("cannot serve metrics on {addr}")]
    Bind {
        /// `--metrics-addr`.
        addr: std::net::SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Every metric of the process.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Workers spawned.
    pub workers_started: IntCounter,
    /// Worker exits by trainlet's exit code for them.
    pub worker_exits: IntCounterVec,
    /// Job restarts.
    pub restarts: IntCounter,
    /// Time to form a round.
    pub rendezvous: Histogram,
    /// 1 while this pod waits as a spare.
    pub spare: IntGauge,
    /// Rounds this pod joined as a spare taking a lost pod's place.
    pub takeovers: IntCounter,
    /// On the store host: by rank, how much more of the time the other
    /// ranks wait in collectives than it does (`crate::stacks::straggle`).
    pub straggler_score: GaugeVec,
    nvml_up: IntGauge,
    utilization: GaugeVec,
    memory_used: GaugeVec,
    memory_total: GaugeVec,
    temperature: GaugeVec,
    sm_clock: GaugeVec,
    sm_clock_max: GaugeVec,
    clock_reasons: GaugeVec,
    pcie_replays: GaugeVec,
    ecc: IntCounterVec,
    ecc_seen: Mutex<HashMap<(String, &'static str), u64>>,
    /// The pod's GPUs that ran slow at the last sample, in words.
    gpu_note: Mutex<Option<String>>,
    init: Mutex<Option<InitGauges>>,
}

/// `trainlet init`'s figures, read from its counters at scrape time.
#[derive(Debug)]
struct InitGauges {
    progress: Arc<initializers::progress::Progress>,
    files_total: IntGauge,
    files_done: IntGauge,
    bytes_total: IntGauge,
    bytes_done: IntGauge,
    rate: prometheus::Gauge,
    eta: prometheus::Gauge,
    retries: IntCounter,
}

fn build() -> Result<Metrics, prometheus::Error> {
    let registry = Registry::new();
    let gpu_labels = ["gpu", "bus_id", "uuid"];
    let counter = |name: &str, help: &str| IntCounter::new(name, help);
    let gauge_vec = |name: &str, help: &str| GaugeVec::new(Opts::new(name, help), &gpu_labels);
    let m = Metrics {
        workers_started: counter("trainlet_workers_started_total", "Worker processes started.")?,
        worker_exits: IntCounterVec::new(
            Opts::new("trainlet_worker_exits_total", "Worker exits, by exit code (128+N for signal N)."),
            &["code"],
        )?,
        restarts: counter("trainlet_restarts_total", "Job restarts after a failure.")?,
        rendezvous: Histogram::with_opts(
            HistogramOpts::new("trainlet_rendezvous_duration_seconds", "Time this pod waited for a round to form.")
                .buckets(vec![0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0]),
        )?,
        spare: IntGauge::new("trainlet_spare", "1 while this pod waits as a spare, else 0.")?,
        takeovers: counter(
            "trainlet_spare_takeovers_total",
            "Rounds this pod joined as a spare, in the place of a pod that left.",
        )?,
        straggler_score: GaugeVec::new(
            Opts::new(
                "trainlet_straggler_score",
                "On the store host, by rank: the other ranks' median share of time waiting in collectives less its own (0-1); a straggler scores high.",
            ),
            &["rank"],
        )?,
        nvml_up: IntGauge::new("trainlet_gpu_nvml_up", "1 while the NVML sampling child reports, else 0.")?,
        utilization: gauge_vec("trainlet_gpu_utilization_ratio", "Fraction of the last sample period a kernel ran.")?,
        memory_used: gauge_vec("trainlet_gpu_memory_used_bytes", "GPU memory in use.")?,
        memory_total: gauge_vec("trainlet_gpu_memory_total_bytes", "GPU memory in all.")?,
        temperature: gauge_vec("trainlet_gpu_temperature_celsius", "GPU core temperature.")?,
        sm_clock: gauge_vec("trainlet_gpu_sm_clock_hertz", "SM clock now.")?,
        sm_clock_max: gauge_vec("trainlet_gpu_sm_clock_max_hertz", "SM clock at most.")?,
        clock_reasons: gauge_vec(
            "trainlet_gpu_clock_event_reasons",
            "Why the clocks are held down now: NVML's clocks event (throttle) reasons bit mask (0x4 power cap, 0x8 HW slowdown, 0x20/0x40 thermal, 0x80 power brake; 0x1 idle).",
        )?,
        pcie_replays: gauge_vec("trainlet_gpu_pcie_replays", "PCIe replays since the driver loaded.")?,
        ecc: IntCounterVec::new(
            Opts::new("trainlet_gpu_ecc_errors_total", "ECC errors since the driver loaded, by type."),
            &["gpu", "bus_id", "uuid", "type"],
        )?,
        ecc_seen: Mutex::new(HashMap::new()),
        gpu_note: Mutex::new(None),
        init: Mutex::new(None),
        registry,
    };
    let r = &m.registry;
    r.register(Box::new(m.workers_started.clone()))?;
    r.register(Box::new(m.worker_exits.clone()))?;
    r.register(Box::new(m.restarts.clone()))?;
    r.register(Box::new(m.rendezvous.clone()))?;
    r.register(Box::new(m.spare.clone()))?;
    r.register(Box::new(m.takeovers.clone()))?;
    let store = crate::store::counters();
    r.register(Box::new(store.connections.clone()))?;
    r.register(Box::new(store.operations.clone()))?;
    let progress = crate::status::gauges();
    r.register(Box::new(progress.percent.clone()))?;
    r.register(Box::new(progress.remaining.clone()))?;
    r.register(Box::new(progress.reports.clone()))?;
    r.register(Box::new(progress.posts.clone()))?;
    r.register(Box::new(progress.post_failures.clone()))?;
    r.register(Box::new(m.straggler_score.clone()))?;
    r.register(Box::new(m.nvml_up.clone()))?;
    for g in [
        &m.utilization,
        &m.memory_used,
        &m.memory_total,
        &m.temperature,
        &m.sm_clock,
        &m.sm_clock_max,
        &m.clock_reasons,
        &m.pcie_replays,
    ] {
        r.register(Box::new(g.clone()))?;
    }
    r.register(Box::new(m.ecc.clone()))?;
    Ok(m)
}

/// The process's metrics (created on first use).
pub fn global() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    // The names and labels above are constants that prometheus accepts; a
    // failure here is a programming error caught by every test.
    M.get_or_init(|| build().expect("valid metric definitions"))
}

impl Metrics {
    /// Count a worker exit: its code, or 128+N for signal N.
    pub fn worker_exited(&self, exit: crate::sys::Exit) {
        let code = match exit {
            crate::sys::Exit::Code(c) => c.to_string(),
            crate::sys::Exit::Signal(s) => (128 + s).to_string(),
        };
        self.worker_exits.with_label_values(&[&code]).inc();
    }

    /// Serve `trainlet init`'s progress too: `trainlet_init_files_total`,
    /// `trainlet_init_files_done`, `trainlet_init_bytes_total`,
    /// `trainlet_init_bytes_done`, `trainlet_init_rate_bytes_per_second`,
    /// `trainlet_init_eta_seconds`, `trainlet_init_retries_total`.
    pub fn watch_init(&self, progress: Arc<initializers::progress::Progress>) -> Result<(), prometheus::Error> {
        let g = |n: &str, h: &str| IntGauge::new(n, h);
        let gauges = InitGauges {
            progress,
            files_total: g("trainlet_init_files_total", "Files the initializer puts in place.")?,
            files_done: g("trainlet_init_files_done", "Files verified and in place.")?,
            bytes_total: g("trainlet_init_bytes_total", "Bytes of all files.")?,
            bytes_done: g("trainlet_init_bytes_done", "Bytes in place (published, resumed or received).")?,
            rate: prometheus::Gauge::new("trainlet_init_rate_bytes_per_second", "Receive rate of this run.")?,
            eta: prometheus::Gauge::new(
                "trainlet_init_eta_seconds",
                "Seconds left at the current rate (-1: unknown).",
            )?,
            retries: IntCounter::new("trainlet_init_retries_total", "Reads retried after a transient failure.")?,
        };
        let r = &self.registry;
        for c in [&gauges.files_total, &gauges.files_done, &gauges.bytes_total, &gauges.bytes_done] {
            r.register(Box::new(c.clone()))?;
        }
        r.register(Box::new(gauges.rate.clone()))?;
        r.register(Box::new(gauges.eta.clone()))?;
        r.register(Box::new(gauges.retries.clone()))?;
        *self.init.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(gauges);
        Ok(())
    }

    fn refresh_init(&self) {
        let guard = self.init.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(g) = guard.as_ref() else { return };
        let s = g.progress.snapshot();
        let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        g.files_total.set(int(s.files_total));
        g.files_done.set(int(s.files_done));
        g.bytes_total.set(int(s.bytes_total));
        g.bytes_done.set(int(s.bytes_done));
        g.rate.set(s.rate);
        g.eta.set(s.eta.unwrap_or(-1.0));
        g.retries.inc_by(s.retries.saturating_sub(g.retries.get()));
    }

    /// The text exposition of everything.
    pub fn render(&self) -> String {
        self.refresh_init();
        let mut buf = Vec::new();
        // Encoding into a Vec only fails on invalid metric data, which the
        // constants above rule out; an empty page is the safe answer.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }

    /// Record one NVML report for the pod's GPUs (CUDA order).
    /// What the pod's GPUs said at the last sample that slows a rank: each
    /// GPU whose clocks are held down (NVML's reasons, idle aside) or whose
    /// SM clock is under 90% of its maximum while busy, and PCIe replays;
    /// None when none does (or no GPU is sampled). The straggler verdict
    /// quotes it.
    pub fn gpu_note(&self) -> Option<String> {
        self.gpu_note.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn record(&self, gpus: &[Gpu], report: &Report) {
        let notes: Vec<String> = gpus
            .iter()
            .enumerate()
            .filter_map(|(i, g)| slow_gpu(i, report.gpus.iter().find(|n| n.bus_id == g.bus_id)?))
            .collect();
        *self.gpu_note.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            (!notes.is_empty()).then(|| notes.join("; "));
        for (i, g) in gpus.iter().enumerate() {
            let Some(n) = report.gpus.iter().find(|n| n.bus_id == g.bus_id) else { continue };
            let idx = i.to_string();
            let uuid = g.uuid.clone().or_else(|| n.uuid.clone()).unwrap_or_default();
            let labels = [idx.as_str(), g.bus_id.as_str(), uuid.as_str()];
            let set = |v: &GaugeVec, x: Option<f64>| {
                if let Some(x) = x {
                    v.with_label_values(&labels).set(x);
                }
            };
            set(&self.utilization, n.utilization.map(|u| f64::from(u) / 100.0));
            set(&self.memory_used, n.memory_used.map(|b| b as f64));
            set(&self.memory_total, n.memory_total.map(|b| b as f64));
            set(&self.temperature, n.temperature.map(f64::from));
            set(&self.sm_clock, n.sm_clock_mhz.map(|c| f64::from(c) * 1e6));
            set(&self.sm_clock_max, n.sm_clock_max_mhz.map(|c| f64::from(c) * 1e6));
            set(&self.clock_reasons, n.clock_reasons.map(|b| b as f64));
            set(&self.pcie_replays, n.pcie_replays.map(f64::from));
            let mut seen = self.ecc_seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (kind, value) in [("corrected", n.ecc_corrected), ("uncorrected", n.ecc_uncorrected)] {
                let Some(v) = value else { continue };
                let last = seen.entry((g.bus_id.clone(), kind)).or_insert(0);
                let c = self.ecc.with_label_values(&[labels[0], labels[1], labels[2], kind]);
                // NVML's count is cumulative; a drop means the driver reloaded.
                c.inc_by(v.saturating_sub(*last));
                *last = v;
            }
        }
    }
}

/// GPU `i` in words when it runs slow (see [`Metrics::gpu_note`]).
fn slow_gpu(i: usize, n: &crate::gpu::nvml::NvmlGpu) -> Option<String> {
    let reasons = n.clock_reasons.map(crate::gpu::clock_reasons).unwrap_or_default();
    let busy = n.utilization.is_some_and(|u| u > 0);
    let clocks = match (n.sm_clock_mhz, n.sm_clock_max_mhz) {
        (Some(c), Some(m)) if m > 0 => Some((c, m, u64::from(c) * 10 < u64::from(m) * 9)),
        _ => None,
    };
    let replays = n.pcie_replays.filter(|r| *r > 0);
    let low = clocks.is_some_and(|(_, _, low)| low && busy);
    if reasons.is_empty() && !low && replays.is_none() {
        return None;
    }
    let mut s = format!("GPU {i}");
    if let Some((c, m, _)) = clocks {
        s.push_str(&format!(" SM at {c} of {m} MHz"));
    }
    if !reasons.is_empty() {
        s.push_str(&format!(" ({})", reasons.join(", ")));
    }
    if let Some(r) = replays {
        s.push_str(&format!(", {r} PCIe replay{}", if r == 1 { "" } else { "s" }));
    }
    Some(s)
}

/// Serve `GET /metrics` on `addr` until `cancel`.
pub async fn serve(
    addr: std::net::SocketAddr,
    cancel: CancellationToken,
) -> Result<std::net::SocketAddr, MetricsError> {
    let listener = TcpListener::bind(addr).await.map_err(|source| MetricsError::Bind { addr, source })?;
    let local = listener.local_addr().map_err(|source| MetricsError::Bind { addr, source })?;
    tracing::info!(addr = %local, "serving Prometheus metrics at /metrics");
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = tokio::select! {
                () = cancel.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(s) => s,
                    Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue; }
                },
            };
            tokio::spawn(async move {
                let mut req = Vec::with_capacity(512);
                let mut chunk = [0u8; 1024];
                let read = async {
                    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => req.extend_from_slice(&chunk[..n]),
                        }
                    }
                };
                if tokio::time::timeout(Duration::from_secs(5), read).await.is_err() {
                    return;
                }
                let line = String::from_utf8_lossy(&req);
                let target = line.split_whitespace().nth(1).unwrap_or("");
                let (status, kind, body) =
                    if line.starts_with("GET ") && (target == "/metrics" || target.starts_with("/metrics?")) {
                        ("200 OK", "text/plain; version=0.0.4; charset=utf-8", global().render())
                    } else {
                        ("404 Not Found", "text/plain", "try /metrics\n".to_string())
                    };
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(body.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(local)
}

/// The GPU sampler; dropping it stops the NVML child and waits (1 s at
/// most) until it is gone, so the agent leaves nothing behind.
#[derive(Debug)]
pub struct GpuSampler {
    cancel: CancellationToken,
    pid: Arc<AtomicI32>,
}

impl Drop for GpuSampler {
    fn drop(&mut self) {
        self.cancel.cancel();
        let pid = self.pid.load(Ordering::SeqCst);
        if pid > 0 {
            crate::sys::signal_group(pid, libc::SIGKILL);
            let until = std::time::Instant::now() + Duration::from_secs(1);
            while crate::sys::group_alive(pid) && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Sample the GPUs through a long-lived NVML child every `every` until the
/// returned sampler is dropped; a child that dies or stalls is restarted
/// with backoff, and `trainlet_gpu_nvml_up` says whether samples flow.
pub fn sample_gpus(spawner: Spawner, gpus: Vec<Gpu>, every: Duration, stall: Duration) -> GpuSampler {
    let m = global();
    let cancel = CancellationToken::new();
    let pid = Arc::new(AtomicI32::new(0));
    let sampler = GpuSampler { cancel: cancel.clone(), pid: Arc::clone(&pid) };
    let spawned = std::thread::Builder::new().name("trainlet-gpu-metrics".into()).spawn(move || {
        let mut backoff = Duration::from_secs(1);
        let mut warned = false;
        while !cancel.is_cancelled() {
            let probe = Probe::start(&spawner, Some(every));
            pid.store(probe.as_ref().map_or(0, |p| p.pid), Ordering::SeqCst);
            if cancel.is_cancelled() {
                if let Ok(p) = &probe {
                    p.kill();
                }
                return;
            }
            let err = match &probe {
                Ok(p) => loop {
                    if cancel.is_cancelled() {
                        p.kill();
                        return;
                    }
                    match p.next(every + stall) {
                        Ok(r) => {
                            m.nvml_up.set(1);
                            m.record(&gpus, &r);
                            backoff = Duration::from_secs(1);
                        }
                        Err(e) => break e,
                    }
                },
                Err(e) => e.clone(),
            };
            m.nvml_up.set(0);
            if !warned {
                tracing::warn!(error = %err, "GPU metrics: the NVML sampler stopped; restarting it with backoff");
                warned = true;
            }
            if let Ok(p) = &probe {
                p.kill();
            }
            let until = std::time::Instant::now() + backoff;
            while std::time::Instant::now() < until && !cancel.is_cancelled() {
                std::thread::sleep(Duration::from_millis(100));
            }
            backoff = (backoff * 2).min(Duration::from_secs(60));
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the GPU metrics thread");
    }
    sampler
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU's part of a straggler's verdict: only a held-down clock (a
    /// reason other than idle, or an SM under 90% of its maximum while
    /// busy) or PCIe replays make one.
    #[test_case::test_case(None, None, None, Some(50), None, None; "nothing known")]
    #[test_case::test_case(Some(1980), Some(1980), Some(0x1), Some(90), None, None; "full speed, idle reason")]
    #[test_case::test_case(Some(1200), Some(1980), Some(0x1), Some(0), None, None; "low clock while idle")]
    #[test_case::test_case(Some(1200), Some(1980), Some(0x1), Some(80), None, Some("GPU 2 SM at 1200 of 1980 MHz"); "low clock while busy")]
    #[test_case::test_case(Some(1200), Some(1980), Some(0x40), Some(80), None, Some("GPU 2 SM at 1200 of 1980 MHz (hardware thermal slowdown)"); "thermal")]
    #[test_case::test_case(Some(1980), Some(1980), Some(0x4), Some(80), Some(3), Some("GPU 2 SM at 1980 of 1980 MHz (software power cap), 3 PCIe replays"); "power cap and replays")]
    #[test_case::test_case(None, None, None, None, Some(1), Some("GPU 2, 1 PCIe replay"); "a replay alone")]
    #[test_case::test_case(Some(1900), Some(0), Some(0x1), Some(80), None, None; "no maximum")]
    fn a_gpus_note(
        sm: Option<u32>,
        max: Option<u32>,
        reasons: Option<u64>,
        busy: Option<u32>,
        replays: Option<u32>,
        want: Option<&str>,
    ) {
        let g = crate::gpu::nvml::NvmlGpu {
            sm_clock_mhz: sm,
            sm_clock_max_mhz: max,
            clock_reasons: reasons,
            utilization: busy,
            pcie_replays: replays,
            ..Default::default()
        };
        assert_eq!(slow_gpu(2, &g).as_deref(), want);
    }

    #[test]
    fn every_family_is_declared_and_store_ops_match_the_store() {
        let m = global();
        m.workers_started.inc();
        m.worker_exited(crate::sys::Exit::Code(0));
        crate::store::counters().op(1);
        let text = m.render();
        for family in [
            "trainlet_workers_started_total",
            "trainlet_worker_exits_total{code=\"0\"}",
            "trainlet_restarts_total",
            "trainlet_rendezvous_duration_seconds_bucket",
            "trainlet_spare ",
            "trainlet_spare_takeovers_total",
            "trainlet_store_connections_total",
            "trainlet_store_operations_total{op=\"SET\"}",
            "trainlet_gpu_nvml_up",
        ] {
            assert!(text.contains(family), "{family} missing:\n{text}");
        }
    }
}
