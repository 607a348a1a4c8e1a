//! SSH for MPI bootstrap, with no OpenSSH in the image: keys, the embedded
//! server of `trainlet sshd`, the ssh(1)-compatible client that MPI
//! launchers run as their remote shell, and hostfiles.
//!
//! # Design
//! Built on russh. The server serves `exec` only and ties every remote
//! command's process group to its channel; the client retries connect and
//! auth for a bounded time and pins host keys instead of trusting on first
//! use. This module starts no process and waits for none: the server asks a
//! [`server::Processes`] (wired by `trainlet sshd` to the one spawner
//! thread and the one reaper) and the launcher flow lives in `trainlet mpi`.
//! `ssh` does not import `store` or `supervise`.

pub(crate) mod algorithms;
pub(crate) mod argv;
pub(crate) mod client;
mod conn;
pub(crate) mod hostfile;
pub(crate) mod keygen;
pub(crate) mod keys;
pub(crate) mod local;
pub mod server;
mod session;
pub(crate) mod sshd_config;

pub use keys::KeyError;

/// A client-chosen string (user name, subsystem, host) as it may appear in
/// a log line: control characters escaped, at most 128 characters.
pub fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(128).flat_map(char::escape_debug).collect();
    if s.chars().nth(128).is_some() {
        out.push_str("...");
    }
    out
}
