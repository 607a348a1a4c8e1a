//! The GPU settings: `--pin` (or torchrun's `--numa-binding`),
//! `--gpu-visibility`, the pre-flight checks and what they expect, the
//! NVML timeout, `--metrics-addr` and `--nic-hint`, over the GPUs
//! [`super::machine::Machine`] found.

use std::path::PathBuf;
use std::time::Duration;

use super::Error;
use super::setting::{Settings, flag_or_env, invalid, lookup, parse_u32};
use crate::cli::RunArgs;
use crate::env;

/// `--pin`, `--gpu-visibility`, `--preflight` and their kin.
pub(super) fn resolve(
    args: &RunArgs,
    s: &mut Settings<'_>,
    root: PathBuf,
    gpus: Vec<crate::gpu::Gpu>,
    nproc: u32,
) -> Result<crate::gpu::GpuPlan, Error> {
    let env = s.env;
    use crate::gpu::preflight::{Check, Expect};
    use crate::gpu::{PinMode, Visibility};
    let pin = match (&args.numa_binding, args.pin.as_deref()) {
        (Some(nb), None) => {
            let l = lookup(Some(nb), "--numa-binding", env, &[]);
            let mode = PinMode::parse(nb).filter(|_| matches!(nb.trim(), "node" | "exclusive"));
            (
                mode.ok_or_else(|| Error::Unsupported {
                    what: format!("--numa-binding {nb}"),
                    hint: "use node or exclusive, or trainlet's --pin none|gpu|cpu|numa|auto".into(),
                })?,
                l.source,
            )
        }
        (_, cli) => {
            let l = lookup(cli, "--pin", env, &[env::TRAINLET_PIN]);
            let v = l.value.unwrap_or("auto");
            (PinMode::parse(v).ok_or_else(|| invalid(&l.origin(), v, "none, gpu, cpu, numa or auto"))?, l.source)
        }
    };
    s.prov.push(("pin", pin.0.to_string(), pin.1));
    let l = lookup(args.gpu_visibility.as_deref(), "--gpu-visibility", env, &[env::TRAINLET_GPU_VISIBILITY]);
    let visibility = match (l.value.map(str::trim), args.virtual_local_rank) {
        (None, true) => Visibility::Single,
        (None | Some("all"), _) => Visibility::All,
        (Some("single"), _) => Visibility::Single,
        (Some(v), _) => return Err(invalid(&l.origin(), v, "all or single")),
    };
    if !gpus.is_empty() {
        s.prov.push(("gpu visibility", visibility.to_string(), l.source));
    }
    let l = lookup(args.preflight.as_deref(), "--preflight", env, &[env::TRAINLET_PREFLIGHT]);
    let checks = Check::parse_list(l.value.unwrap_or("all")).map_err(|bad| {
        invalid(
            &l.origin(),
            l.value.unwrap_or_default(),
            &format!("all, none or a list of count,lost,ecc,remap,mig (not {bad:?})"),
        )
    })?;
    s.prov.push(("preflight", checks.iter().map(|c| c.name()).collect::<Vec<_>>().join(","), l.source));
    let l = lookup(args.expect_gpus.as_deref(), "--expect-gpus", env, &[env::TRAINLET_EXPECT_GPUS]);
    let expect_gpus = l.value.map(|_| parse_u32(&l, 0, "a number of GPUs >= 0")).transpose()?;
    if let Some(n) = expect_gpus {
        s.prov.push(("expect gpus", n.to_string(), l.source.clone()));
    }
    let l = lookup(args.mig.as_deref(), "--mig", env, &[env::TRAINLET_MIG]);
    let mig = match l.value.map(str::trim) {
        None => None,
        Some("on") => Some(true),
        Some("off") => Some(false),
        Some(v) => return Err(invalid(&l.origin(), v, "on or off")),
    };
    if let Some(on) = mig {
        s.prov.push(("mig", if on { "on" } else { "off" }.to_string(), l.source.clone()));
    }

    let nvml_timeout = s.secs(
        "nvml timeout",
        (args.nvml_timeout.as_deref(), "--nvml-timeout", &[env::TRAINLET_NVML_TIMEOUT]),
        Duration::from_secs(10),
    )?;
    let l = lookup(args.metrics_addr.as_deref(), "--metrics-addr", env, &[env::TRAINLET_METRICS_ADDR]);
    let metrics_addr = match l.value {
        None => None,
        Some(v) => Some(
            v.trim()
                .parse::<std::net::SocketAddr>()
                .map_err(|_| invalid(&l.origin(), v, "an address and port like 0.0.0.0:9400"))?,
        ),
    };
    if let Some(a) = metrics_addr {
        s.prov.push(("metrics", a.to_string(), l.source));
    }
    let (nic_hint, src) = flag_or_env(args.nic_hint, "--nic-hint", env, env::TRAINLET_NIC_HINT)?;
    if nic_hint {
        s.prov.push(("nic hint", "on".into(), src));
    }
    Ok(crate::gpu::GpuPlan {
        root,
        expect: Expect { nproc, assign: pin.0 != PinMode::None, gpus: expect_gpus, mig },
        gpus,
        pin: pin.0,
        visibility,
        user_order: env.get(env::CUDA_DEVICE_ORDER).is_some(),
        checks,
        nvml_timeout,
        nic_hint,
        metrics_addr,
        narrowed: false,
    })
}
