//! The defaults of the rendezvous and stop settings, where each
//! resolver can take them without importing another.

use std::time::Duration;

/// Default store port (torchrun's `--master-port`, Trainer's PET_MASTER_PORT).
pub const DEFAULT_PORT: u16 = 29500;
/// Default join deadline (torchrun's c10d `join_timeout`).
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// Default grace before SIGKILL: with the kill timeout it fits inside
/// Kubernetes' default terminationGracePeriodSeconds of 30 s.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(25);
/// Default bound on waiting for workers after SIGKILL.
pub const DEFAULT_KILL_TIMEOUT: Duration = Duration::from_secs(3);
/// Default time workers get to checkpoint (capped below the grace period).
pub const DEFAULT_CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(15);
/// Default elastic last-call window (torch's `last_call_timeout`).
pub const DEFAULT_LAST_CALL: Duration = Duration::from_secs(30);
/// Default heartbeat period.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// Default silence after which a pod is dead.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time a member's heartbeat connection, closed by its end without
/// a `bye` (its agent died), has to come back before the member is dead.
pub const DEFAULT_LOST_GRACE: Duration = Duration::from_millis(500);
