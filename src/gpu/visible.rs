//! Which of the pod's GPUs the workers may use, and in which order
//! (reference/gpu-pid1.md 3.3). The result's position is the CUDA ordinal
//! under `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so local rank i gets entry i.
//!
//! NVIDIA_VISIBLE_DEVICES is applied by the container runtime when the
//! container is created, and procfs then shows only those GPUs; inside the
//! container it still holds the *host's* indices (`3,5`), which need not
//! exist here. So it narrows only when every entry resolves here (bare
//! metal, or UUIDs); otherwise the runtime has already applied it and it is
//! ignored. `all`, `void` or unset = every GPU, `none` = no GPU. CUDA_VISIBLE_DEVICES then picks and orders, as CUDA does:
//! indices into that list or `GPU-` UUID prefixes; an invalid entry hides
//! it and everything after it; empty = no GPU.

use super::Gpu;

/// Apply both variables to `gpus` (bus order).
pub fn visible(gpus: Vec<Gpu>, nvidia: Option<&str>, cuda: Option<&str>) -> Vec<Gpu> {
    let gpus = match nvidia.map(str::trim) {
        None | Some("" | "all" | "void") => gpus,
        Some("none") => Vec::new(),
        Some(list) => {
            let mut out: Vec<Gpu> = Vec::new();
            for found in list.split(',').map(|e| pick(&gpus, e.trim())) {
                match found {
                    Some(g) if !out.contains(&g) => out.push(g),
                    Some(_) => {}
                    None => {
                        out = gpus.clone(); // host indices: already applied by the runtime
                        break;
                    }
                }
            }
            out
        }
    };
    let Some(list) = cuda else { return gpus };
    let mut out: Vec<Gpu> = Vec::new();
    for entry in list.split(',').map(str::trim) {
        // CUDA stops at the first entry it cannot use.
        match pick(&gpus, entry) {
            Some(g) if !out.contains(&g) => out.push(g),
            _ => break,
        }
    }
    out
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

    fn gpus(n: u32) -> Vec<Gpu> {
        // UUIDs GPU-0a0, GPU-1a1, ...
        let mut g = crate::gpu::test_gpus(n, 0x10, "");
        for (i, gpu) in g.iter_mut().enumerate() {
            gpu.uuid = Some(format!("GPU-{i}a{i}"));
        }
        g
    }

    fn ids(v: &[Gpu]) -> Vec<u32> {
        v.iter().filter_map(|g| g.minor).collect()
    }

    #[test]
    fn cuda_visible_devices_picks_and_orders() {
        assert_eq!(ids(&visible(gpus(4), None, None)), [0, 1, 2, 3]);
        assert_eq!(ids(&visible(gpus(4), None, Some("2,0"))), [2, 0]);
        assert_eq!(ids(&visible(gpus(4), None, Some("GPU-3,1"))), [3, 1]);
        assert_eq!(ids(&visible(gpus(4), None, Some("1,7,2"))), [1], "stops at 7");
        assert!(visible(gpus(4), None, Some("")).is_empty());
        assert!(visible(gpus(4), None, Some("-1")).is_empty());
    }

    #[test]
    fn nvidia_visible_devices_narrows_first() {
        assert!(visible(gpus(4), Some("none"), None).is_empty());
        assert_eq!(ids(&visible(gpus(4), Some("all"), None)), [0, 1, 2, 3]);
        let two = visible(gpus(4), Some("GPU-2a2,GPU-3a3"), Some("1"));
        assert_eq!(ids(&two), [3]);
        assert_eq!(ids(&visible(gpus(4), Some("1,3"), None)), [1, 3], "bare metal indices");
        // Host indices in a container given host GPUs 3 and 5: procfs
        // already shows just those two.
        assert_eq!(ids(&visible(gpus(2), Some("3,5"), None)), [0, 1]);
    }
}
