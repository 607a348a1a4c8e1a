//! Which of the pod's GPUs the workers may use, and in which order
//! (reference/gpu-pid1.md 3.3). The result's position is the CUDA ordinal
//! under `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so local rank i gets entry i.
//!
//! NVIDIA_VISIBLE_DEVICES is applied by the container runtime when the
//! container is created; inside a container it only narrows what procfs
//! already shows, and outside one (bare metal) it is honoured the same way:
//! `all`, `void` or unset = every GPU, `none` = no GPU, else indices or
//! UUIDs. CUDA_VISIBLE_DEVICES then picks and orders, as CUDA does:
//! indices into that list or `GPU-` UUID prefixes; an invalid entry hides
//! it and everything after it; empty = no GPU.

use super::{Gpu, GpuError};

/// Apply both variables to `gpus` (bus order).
pub fn visible(gpus: Vec<Gpu>, nvidia: Option<&str>, cuda: Option<&str>) -> Result<Vec<Gpu>, GpuError> {
    let gpus = match nvidia.map(str::trim) {
        None | Some("" | "all" | "void") => gpus,
        Some("none") => Vec::new(),
        Some(list) => {
            let mut out = Vec::new();
            for entry in list.split(',').map(str::trim) {
                let found = pick(&gpus, entry).ok_or_else(|| GpuError::Visibility {
                    var: "NVIDIA_VISIBLE_DEVICES",
                    value: list.to_string(),
                    what: format!("no GPU {entry:?} in this pod ({} GPUs)", gpus.len()),
                })?;
                if !out.contains(&found) {
                    out.push(found);
                }
            }
            out
        }
    };
    let Some(list) = cuda else { return Ok(gpus) };
    let mut out: Vec<Gpu> = Vec::new();
    for entry in list.split(',').map(str::trim) {
        // CUDA stops at the first entry it cannot use.
        match pick(&gpus, entry) {
            Some(g) if !out.contains(&g) => out.push(g),
            _ => break,
        }
    }
    Ok(out)
}

/// An index into `gpus`, or a UUID (a `GPU-` prefix is enough).
fn pick(gpus: &[Gpu], entry: &str) -> Option<Gpu> {
    if let Ok(i) = entry.parse::<usize>() {
        return gpus.get(i).cloned();
    }
    if entry.len() < 5 || !entry.starts_with("GPU-") {
        return None;
    }
    let mut hits = gpus.iter().filter(|g| g.uuid.as_deref().is_some_and(|u| u.starts_with(entry)));
    match (hits.next(), hits.next()) {
        (Some(g), None) => Some(g.clone()),
        _ => None, // unknown or ambiguous prefix
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::CpuSet;

    fn gpus(n: u32) -> Vec<Gpu> {
        (0..n)
            .map(|i| Gpu {
                bus_id: format!("0000:{:02x}:00.0", 0x10 + i),
                uuid: Some(format!("GPU-{i}a{i}")),
                model: None,
                minor: Some(i),
                numa_node: None,
                local_cpus: CpuSet::default(),
            })
            .collect()
    }

    fn ids(v: &[Gpu]) -> Vec<u32> {
        v.iter().filter_map(|g| g.minor).collect()
    }

    #[test]
    fn cuda_visible_devices_picks_and_orders() {
        assert_eq!(ids(&visible(gpus(4), None, None).expect("all")), [0, 1, 2, 3]);
        assert_eq!(ids(&visible(gpus(4), None, Some("2,0")).expect("list")), [2, 0]);
        assert_eq!(ids(&visible(gpus(4), None, Some("GPU-3,1")).expect("uuid prefix")), [3, 1]);
        assert_eq!(ids(&visible(gpus(4), None, Some("1,7,2")).expect("invalid")), [1], "stops at 7");
        assert!(visible(gpus(4), None, Some("")).expect("empty").is_empty());
        assert!(visible(gpus(4), None, Some("-1")).expect("-1").is_empty());
    }

    #[test]
    fn nvidia_visible_devices_narrows_first() {
        assert!(visible(gpus(4), Some("none"), None).expect("none").is_empty());
        assert_eq!(ids(&visible(gpus(4), Some("all"), None).expect("all")), [0, 1, 2, 3]);
        let two = visible(gpus(4), Some("GPU-2a2,GPU-3a3"), Some("1")).expect("uuids then cuda");
        assert_eq!(ids(&two), [3]);
        let e = visible(gpus(2), Some("5"), None).expect_err("missing");
        assert!(e.to_string().contains("no GPU \"5\" in this pod (2 GPUs)"), "{e}");
    }
}
