//! `trainlet nvml-probe`: the NVML child (reference/gpu-pid1.md 2.3).
//! Whatever happens in here, the agent only sees a report, an error line,
//! or a dead child; its codes are 0 and 1, read only by the agent.

use std::time::Duration;

use crate::exit;

/// Probe once (or every `every`), report on stdout.
pub fn main(every: Option<Duration>) -> u8 {
    let lib = std::env::var_os(crate::env::TRAINLET_NVML_LIB).map(std::path::PathBuf::from);
    match crate::gpu::nvml::probe_main(lib.as_deref(), every) {
        Ok(()) => exit::SUCCESS,
        Err(e) => {
            eprintln!("trainlet nvml-probe: {e}");
            1
        }
    }
}
