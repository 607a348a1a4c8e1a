//! The Process Management Interface that MPI ranks started without
//! `mpirun` ask their launcher for (issue 29): rank and size, a key-value
//! space, barriers. This module has its wire formats (`wire`); the server
//! that answers each rank on its pre-connected `PMI_FD` comes next.

#[cfg_attr(not(test), expect(dead_code, reason = "the PMI server that uses it is next (issue 29)"))]
pub mod wire;
