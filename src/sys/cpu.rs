//! CPU and NUMA masks as the kernel takes them, the CPUs this process may
//! run on, and the preferred memory node.

use nix::errno::Errno;

/// A kernel CPU (or node) bitmask: bit `b` of word `w` is number `w*64+b`,
/// with one spare trailing word so either `maxnode` convention of
/// set_mempolicy covers it (reference/gpu-pid1.md 3.4).
pub fn cpu_mask(ids: impl IntoIterator<Item = u32>) -> Vec<libc::c_ulong> {
    let bits = libc::c_ulong::BITS;
    let ids: Vec<u32> = ids.into_iter().collect();
    let words = ids.iter().max().map_or(1, |m| m / bits + 1) as usize + 1;
    let mut mask = vec![0; words];
    for id in ids {
        mask[(id / bits) as usize] |= 1 << (id % bits);
    }
    mask
}

/// The numbers set in a kernel bitmask (the inverse of [`cpu_mask`]).
pub fn mask_ids(mask: &[libc::c_ulong]) -> Vec<u32> {
    let bits = libc::c_ulong::BITS;
    (0u32..)
        .zip(mask)
        .flat_map(|(w, word)| (0..bits).filter(move |b| word & (1 << b) != 0).map(move |b| w * bits + b))
        .collect()
}

/// The CPUs this process may run on (`sched_getaffinity`: the pod's cpuset),
/// read with a buffer that grows past glibc's 1024-CPU `cpu_set_t`.
pub fn allowed_cpus() -> Vec<u32> {
    let mut words = 16usize;
    loop {
        let mut mask: Vec<libc::c_ulong> = vec![0; words];
        // SAFETY: the kernel writes at most the given byte length into the
        // buffer, which is that long and live for the call.
        let rc = unsafe {
            libc::syscall(libc::SYS_sched_getaffinity, 0, std::mem::size_of_val(mask.as_slice()), mask.as_mut_ptr())
        };
        if rc > 0 {
            return mask_ids(&mask);
        }
        if Errno::last() != Errno::EINVAL || words >= 1 << 16 {
            return Vec::new();
        }
        words *= 4;
    }
}

/// Make the calling thread's memory policy "prefer `node`" (None: the
/// default policy). A child forked afterwards inherits it across exec, as
/// `numactl --preferred` does. Fails with EPERM where seccomp's default
/// profile withholds set_mempolicy (no CAP_SYS_NICE) and EINVAL for a node
/// the kernel does not have.
pub fn set_preferred_node(node: Option<u32>) -> std::io::Result<()> {
    let mask = node.map(|n| cpu_mask([n]));
    let (mode, ptr, maxnode) = match &mask {
        Some(m) => (libc::MPOL_PREFERRED, m.as_ptr(), m.len() * libc::c_ulong::BITS as usize),
        None => (libc::MPOL_DEFAULT, std::ptr::null(), 0),
    };
    // SAFETY: `ptr` is null with maxnode 0, or points to `mask`, which holds
    // `maxnode` bits and outlives the call; the kernel only reads it.
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, mode, ptr, maxnode) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// Number of CPUs this process may run on (the container's cpuset).
pub fn cpu_count() -> usize {
    Some(allowed_cpus().len())
        .filter(|&n| n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(usize::from))
        .unwrap_or(1)
}
