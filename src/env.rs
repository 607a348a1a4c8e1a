//! Every environment variable trainlet reads, by name, in one place.
//!
//! The `PET_*` names are torchrun's own (`PET_<DEST>` defaults every option)
//! and what Kubeflow Trainer injects into the `node` container
//! (reference/kubeflow.md section 8).

use std::collections::HashMap;

/// `--nnodes`.
pub const PET_NNODES: &str = "PET_NNODES";
/// `--nproc-per-node`.
pub const PET_NPROC_PER_NODE: &str = "PET_NPROC_PER_NODE";
/// `--node-rank`.
pub const PET_NODE_RANK: &str = "PET_NODE_RANK";
/// `--master-addr`.
pub const PET_MASTER_ADDR: &str = "PET_MASTER_ADDR";
/// `--master-port`.
pub const PET_MASTER_PORT: &str = "PET_MASTER_PORT";
/// `--rdzv-endpoint`.
pub const PET_RDZV_ENDPOINT: &str = "PET_RDZV_ENDPOINT";
/// `--rdzv-backend`.
pub const PET_RDZV_BACKEND: &str = "PET_RDZV_BACKEND";
/// `--rdzv-id`.
pub const PET_RDZV_ID: &str = "PET_RDZV_ID";
/// `--rdzv-conf`.
pub const PET_RDZV_CONF: &str = "PET_RDZV_CONF";
/// `--standalone` as "0"/"1".
pub const PET_STANDALONE: &str = "PET_STANDALONE";
/// `--max-restarts`.
pub const PET_MAX_RESTARTS: &str = "PET_MAX_RESTARTS";
/// `--monitor-interval`.
pub const PET_MONITOR_INTERVAL: &str = "PET_MONITOR_INTERVAL";
/// `--role`.
pub const PET_ROLE: &str = "PET_ROLE";
/// `--log-dir`.
pub const PET_LOG_DIR: &str = "PET_LOG_DIR";
/// `--redirects`.
pub const PET_REDIRECTS: &str = "PET_REDIRECTS";
/// `--tee`.
pub const PET_TEE: &str = "PET_TEE";
/// `--local-ranks-filter`.
pub const PET_LOCAL_RANKS_FILTER: &str = "PET_LOCAL_RANKS_FILTER";
/// `--local-addr`.
pub const PET_LOCAL_ADDR: &str = "PET_LOCAL_ADDR";
/// `--start-method`.
pub const PET_START_METHOD: &str = "PET_START_METHOD";
/// `-m/--module` as "0"/"1".
pub const PET_MODULE: &str = "PET_MODULE";
/// `--no-python` as "0"/"1".
pub const PET_NO_PYTHON: &str = "PET_NO_PYTHON";
/// `--run-path` as "0"/"1".
pub const PET_RUN_PATH: &str = "PET_RUN_PATH";
/// `--log-line-prefix-template` (torchrun's env name).
pub const TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: &str = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE";
/// `--shutdown-timeout` (torchrun's env name).
pub const TORCH_ELASTIC_SHUTDOWN_TIMEOUT: &str = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT";
/// `--signals-to-handle` (torchrun's env name).
pub const TORCHELASTIC_SIGNALS_TO_HANDLE: &str = "TORCHELASTIC_SIGNALS_TO_HANDLE";
/// Set by an agent (trainlet, torchrun) on every worker: the `python`
/// link runs the real interpreter there (`cmd::python`).
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// Node-rank fallback: the Job controller's completion index.
pub const JOB_COMPLETION_INDEX: &str = "JOB_COMPLETION_INDEX";
/// `--python`, trainlet's name.
pub const TRAINLET_PYTHON: &str = "TRAINLET_PYTHON";
/// `--python`, torchrun's name.
pub const PYTHON_EXEC: &str = "PYTHON_EXEC";
/// `--join-timeout`, trainlet's name.
pub const TRAINLET_JOIN_TIMEOUT: &str = "TRAINLET_JOIN_TIMEOUT";
/// `--store-memory`.
pub const TRAINLET_STORE_MEMORY: &str = "TRAINLET_STORE_MEMORY";
/// `--policy`.
pub const TRAINLET_POLICY: &str = "TRAINLET_POLICY";
/// A failure policy file read only when it exists: the runtimes' optional
/// ConfigMap, which an admin may not have made. `--policy` and
/// `TRAINLET_POLICY` win; a file that `TRAINLET_POLICY` names must exist.
pub const TRAINLET_POLICY_IF_PRESENT: &str = "TRAINLET_POLICY_IF_PRESENT";
/// `--checkpoint-signal`.
pub const TRAINLET_CHECKPOINT_SIGNAL: &str = "TRAINLET_CHECKPOINT_SIGNAL";
/// `--checkpoint-timeout`.
pub const TRAINLET_CHECKPOINT_TIMEOUT: &str = "TRAINLET_CHECKPOINT_TIMEOUT";
/// Where the one-line reason of a failed job is written for Kubernetes
/// (default `/dev/termination-log` when it exists, as in every pod).
pub const TRAINLET_TERMINATION_LOG: &str = "TRAINLET_TERMINATION_LOG";
/// `--checkpoint-dir`: checked writable before every round.
pub const TRAINLET_CHECKPOINT_DIR: &str = "TRAINLET_CHECKPOINT_DIR";
/// `--min-shm`: the least size of /dev/shm, checked before every round.
pub const TRAINLET_MIN_SHM: &str = "TRAINLET_MIN_SHM";
/// `--stragglers`: name the ranks the others wait for, `on` or `off`.
pub const TRAINLET_STRAGGLERS: &str = "TRAINLET_STRAGGLERS";
/// `--evict-stragglers`: seconds a rank is a straggler before its pod leaves (with spares).
pub const TRAINLET_EVICT_STRAGGLERS: &str = "TRAINLET_EVICT_STRAGGLERS";
/// `--spares`: pods of the job that wait warm to take a lost pod's place.
pub const TRAINLET_SPARES: &str = "TRAINLET_SPARES";
/// `--kill-timeout`.
pub const TRAINLET_KILL_TIMEOUT: &str = "TRAINLET_KILL_TIMEOUT";
/// `--hung-timeout`, torchrun's name.
pub const TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT: &str = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT";
/// `--restart-backoff`.
pub const TRAINLET_RESTART_BACKOFF: &str = "TRAINLET_RESTART_BACKOFF";
/// `--heartbeat-timeout`.
pub const TRAINLET_HEARTBEAT_TIMEOUT: &str = "TRAINLET_HEARTBEAT_TIMEOUT";
/// `--lost-grace`.
pub const TRAINLET_LOST_GRACE: &str = "TRAINLET_LOST_GRACE";
/// `--last-call-timeout`.
pub const TRAINLET_LAST_CALL_TIMEOUT: &str = "TRAINLET_LAST_CALL_TIMEOUT";
/// The JobSet restart attempt, from the downward API on the pod label
/// `jobset.sigs.k8s.io/restart-attempt`; part of the store namespace.
pub const JOBSET_RESTART_ATTEMPT: &str = "JOBSET_RESTART_ATTEMPT";
/// GPUs visible to CUDA.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// GPUs the NVIDIA container runtime exposed.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Inherited by workers; set to 1 when unset and nproc > 1, like torchrun.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";
/// Inherited by workers; defaults to 1, like torchrun.
pub const TORCH_NCCL_ASYNC_ERROR_HANDLING: &str = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
/// Where a failure report is copied when set on the agent (torchrun's `@record`).
pub const TORCHELASTIC_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";

/// `--framework`: torch, jax, xgboost or mpi (default: detected from the env).
pub const TRAINLET_FRAMEWORK: &str = "TRAINLET_FRAMEWORK";
/// Trainer's JAX plugin: `<trainjob>-node-0-0.<trainjob>:29500` (the store
/// endpoint for trainlet; workers get the coordinator's own address).
pub const JAX_COORDINATOR_ADDRESS: &str = "JAX_COORDINATOR_ADDRESS";
/// Trainer's JAX plugin: the number of pods (workers get the process count).
pub const JAX_NUM_PROCESSES: &str = "JAX_NUM_PROCESSES";
/// Trainer's JAX plugin: the pod's index (workers get their process id).
pub const JAX_PROCESS_ID: &str = "JAX_PROCESS_ID";
/// The GPUs a JAX process uses, read by `jax.distributed.initialize()`.
pub const JAX_LOCAL_DEVICE_IDS: &str = "JAX_LOCAL_DEVICE_IDS";
/// Trainer's XGBoost plugin: the first pod's host (the store host for
/// trainlet; workers get the tracker's address).
pub const DMLC_TRACKER_URI: &str = "DMLC_TRACKER_URI";
/// Trainer's XGBoost plugin: 29500 (trainlet's store; workers get the tracker's port).
pub const DMLC_TRACKER_PORT: &str = "DMLC_TRACKER_PORT";
/// Trainer's XGBoost plugin: the pod's index (workers get their global task id).
pub const DMLC_TASK_ID: &str = "DMLC_TASK_ID";
/// Trainer's XGBoost plugin: pods x GPUs (or pods on CPU); workers get the world size.
pub const DMLC_NUM_WORKER: &str = "DMLC_NUM_WORKER";

/// PMI (`--framework mpi`): the descriptor of a rank's pre-connected PMI socket.
pub const PMI_FD: &str = "PMI_FD";
/// PMI: the rank's global rank.
pub const PMI_RANK: &str = "PMI_RANK";
/// PMI: ranks in the job.
pub const PMI_SIZE: &str = "PMI_SIZE";
/// PMI-2: the id `PMI2_Init` sends in `fullinit pmirank=` (the rank).
pub const PMI_ID: &str = "PMI_ID";
/// PMI-2 (Slurm's client library): the job id (the key-value space's name).
pub const PMI_JOBID: &str = "PMI_JOBID";
/// Hydra's: the rank's index on its node (Intel MPI reads it).
pub const MPI_LOCALRANKID: &str = "MPI_LOCALRANKID";
/// Hydra's: ranks on the node.
pub const MPI_LOCALNRANKS: &str = "MPI_LOCALNRANKS";

/// Trainer's status endpoint (`TrainJobStatus` feature gate): the URL workers POST
/// `{"trainerStatus": ...}` to; trainlet posts there and gives workers its own.
pub const KUBEFLOW_TRAINER_SERVER_URL: &str = "KUBEFLOW_TRAINER_SERVER_URL";
/// The CA file that verifies the status endpoint's TLS certificate.
pub const KUBEFLOW_TRAINER_SERVER_CA_CERT: &str = "KUBEFLOW_TRAINER_SERVER_CA_CERT";
/// The (rotating) projected token file for the status endpoint.
pub const KUBEFLOW_TRAINER_SERVER_TOKEN: &str = "KUBEFLOW_TRAINER_SERVER_TOKEN";
/// `--progress-timeout`.
pub const TRAINLET_PROGRESS_TIMEOUT: &str = "TRAINLET_PROGRESS_TIMEOUT";
/// A file a worker touches to say it makes progress (trainlet gives each worker its own).
pub const TRAINLET_HEARTBEAT_FILE: &str = "TRAINLET_HEARTBEAT_FILE";

/// The Unix socket an actor's worker dials its agent on (set by trainlet).
pub const TRAINLET_ACTOR_SOCKET: &str = "TRAINLET_ACTOR_SOCKET";
/// A served pod's cache directory, kept across runs and actors (set by trainlet).
pub const TRAINLET_CACHE_DIR: &str = "TRAINLET_CACHE_DIR";

/// `--serve`: keep the pods up between runs submitted to the control API.
pub const TRAINLET_SERVE: &str = "TRAINLET_SERVE";
/// `--control-port`: the control API's port on the store host.
pub const TRAINLET_CONTROL_PORT: &str = "TRAINLET_CONTROL_PORT";
/// `--control-bind`: `loopback`, `any`, `pod` (POD_IP) or an address.
pub const TRAINLET_CONTROL_BIND: &str = "TRAINLET_CONTROL_BIND";
/// `--control-token-file`: the control API's bearer token (a Secret).
pub const TRAINLET_CONTROL_TOKEN_FILE: &str = "TRAINLET_CONTROL_TOKEN_FILE";
/// `--serve-idle-timeout`: seconds without a run or a request before the pods exit 0.
pub const TRAINLET_SERVE_IDLE_TIMEOUT: &str = "TRAINLET_SERVE_IDLE_TIMEOUT";
/// `--serve-dir`: where runs' files are unpacked and cached.
pub const TRAINLET_SERVE_DIR: &str = "TRAINLET_SERVE_DIR";
/// Internal: set by a serving pod's agent on the lane agent it starts for
/// an actor beside the main run (`crate::serve::lane`), as JSON
/// ([`crate::config::Lane`]). Never passed on to a worker.
pub const TRAINLET_LANE: &str = "TRAINLET_LANE";
/// The pod's IP (downward API), for `--control-bind pod`.
pub const POD_IP: &str = "POD_IP";

/// `--in-place-restart`: be this pod's JobSet in-place restart agent.
pub const TRAINLET_IN_PLACE_RESTART: &str = "TRAINLET_IN_PLACE_RESTART";
/// The pod's JobSet (downward API, annotation `jobset.sigs.k8s.io/jobset-name`),
/// as JobSet's in-place restart agent reads it.
pub const JOBSET_NAME: &str = "JOBSET_NAME";
/// The pod's name (downward API, `metadata.name`).
pub const POD_NAME: &str = "POD_NAME";
/// The pod's namespace (downward API, `metadata.namespace`); else the
/// service account's namespace file.
pub const POD_NAMESPACE: &str = "POD_NAMESPACE";
/// The pod's uid (downward API, `metadata.uid`): the Events' `regarding`
/// object without a GET of the pod.
pub const POD_UID: &str = "POD_UID";
/// The pod's TrainJob (downward API, label `jobset.sigs.k8s.io/jobset-name`,
/// Trainer's own name for it): the Events' `related` object.
pub const TRAIN_JOB_NAME: &str = "TRAIN_JOB_NAME";
/// `--events`: write Kubernetes Events (`on`, the default, or `off`).
pub const TRAINLET_EVENTS: &str = "TRAINLET_EVENTS";
/// Set in every pod by the kubelet: the API server's in-cluster address.
pub const KUBERNETES_SERVICE_HOST: &str = "KUBERNETES_SERVICE_HOST";
/// A kubeconfig outside a pod (read by the kube client).
pub const KUBECONFIG: &str = "KUBECONFIG";
/// The code the agent exits with when the JobSet restarts the pod in place
/// (default 1, as JobSet's agent).
pub const IN_PLACE_RESTART_EXIT_CODE: &str = "IN_PLACE_RESTART_EXIT_CODE";
/// `--replica-groups`: TorchFT replica groups.
pub const TRAINLET_REPLICA_GROUPS: &str = "TRAINLET_REPLICA_GROUPS";
/// TorchFT's Lighthouse address (`http://host:port`); set, trainlet runs none.
pub const TORCHFT_LIGHTHOUSE: &str = "TORCHFT_LIGHTHOUSE";
/// The Lighthouse program trainlet runs (default: `torchft_lighthouse` beside python, else on PATH).
pub const TRAINLET_LIGHTHOUSE: &str = "TRAINLET_LIGHTHOUSE";
/// The port of the Lighthouse trainlet runs (default 29510; 0: a free port).
pub const TRAINLET_LIGHTHOUSE_PORT: &str = "TRAINLET_LIGHTHOUSE_PORT";
/// The Lighthouse's `--min_replicas` (default 1).
pub const TRAINLET_LIGHTHOUSE_MIN_REPLICAS: &str = "TRAINLET_LIGHTHOUSE_MIN_REPLICAS";
/// The Lighthouse's `--join_timeout_ms`, in seconds (default 1).
pub const TRAINLET_LIGHTHOUSE_JOIN_TIMEOUT: &str = "TRAINLET_LIGHTHOUSE_JOIN_TIMEOUT";
/// The Lighthouse's `--heartbeat_timeout_ms`, in seconds (default 2).
pub const TRAINLET_LIGHTHOUSE_HEARTBEAT_TIMEOUT: &str = "TRAINLET_LIGHTHOUSE_HEARTBEAT_TIMEOUT";
/// torchft's quorum retries (trainlet sets 10 when it runs the Lighthouse).
pub const TORCHFT_QUORUM_RETRIES: &str = "TORCHFT_QUORUM_RETRIES";
/// `--preload`: modules a Python zygote imports before workers are forked from it.
pub const TRAINLET_PRELOAD: &str = "TRAINLET_PRELOAD";

/// Key directory of `trainlet sshd`/`ssh`/`mpi` (the runtime's sshAuthMountPath).
pub const TRAINLET_SSH_DIR: &str = "TRAINLET_SSH_DIR";
/// SSH port of the workers (`trainlet sshd --listen`, the client's default port).
pub const TRAINLET_SSH_PORT: &str = "TRAINLET_SSH_PORT";
/// How long `trainlet ssh` retries connect and auth, in seconds.
pub const TRAINLET_SSH_RETRY: &str = "TRAINLET_SSH_RETRY";
/// `no` turns host-key pinning off for `trainlet ssh` (StrictHostKeyChecking=no).
pub const TRAINLET_SSH_HOST_KEY_CHECKING: &str = "TRAINLET_SSH_HOST_KEY_CHECKING";
/// `trainlet sshd --host-key`.
pub const TRAINLET_SSH_HOST_KEY: &str = "TRAINLET_SSH_HOST_KEY";
/// Directory holding the `ssh` link that MPI launchers run (default `$TMPDIR/trainlet-bin`).
pub const TRAINLET_AGENT_DIR: &str = "TRAINLET_AGENT_DIR";
/// The real mpirun when trainlet answers to the name `mpirun`/`mpiexec`.
pub const TRAINLET_MPIRUN: &str = "TRAINLET_MPIRUN";
/// Hosts for `trainlet mpi` when no hostfile exists: `h1,h2:4`.
pub const TRAINLET_MPI_HOSTS: &str = "TRAINLET_MPI_HOSTS";
/// Open MPI's hostfile setting, which Trainer and MPI Operator set on the launcher.
pub const OMPI_MCA_ORTE_DEFAULT_HOSTFILE: &str = "OMPI_MCA_orte_default_hostfile";
/// Slots per host, which Trainer and MPI Operator set on the launcher.
pub const OMPI_MCA_ORTE_SET_DEFAULT_SLOTS: &str = "OMPI_MCA_orte_set_default_slots";

/// `--pin`.
pub const TRAINLET_PIN: &str = "TRAINLET_PIN";
/// `--gpu-visibility`.
pub const TRAINLET_GPU_VISIBILITY: &str = "TRAINLET_GPU_VISIBILITY";
/// `--preflight`.
pub const TRAINLET_PREFLIGHT: &str = "TRAINLET_PREFLIGHT";
/// `--expect-gpus`.
pub const TRAINLET_EXPECT_GPUS: &str = "TRAINLET_EXPECT_GPUS";
/// `--mig`.
pub const TRAINLET_MIG: &str = "TRAINLET_MIG";
/// `--nvml-timeout`.
pub const TRAINLET_NVML_TIMEOUT: &str = "TRAINLET_NVML_TIMEOUT";
/// `--nic-hint` (`1`).
pub const TRAINLET_NIC_HINT: &str = "TRAINLET_NIC_HINT";
/// `--metrics-addr`.
pub const TRAINLET_METRICS_ADDR: &str = "TRAINLET_METRICS_ADDR";
/// Root of the sysfs/procfs/dev tree the GPU inventory reads (default `/`;
/// tests point it at a fake machine).
pub const TRAINLET_SYSFS_ROOT: &str = "TRAINLET_SYSFS_ROOT";
/// Path of libnvidia-ml for the NVML probe (default: the loader's search for
/// `libnvidia-ml.so.1`).
pub const TRAINLET_NVML_LIB: &str = "TRAINLET_NVML_LIB";
/// CUDA's device order; trainlet sets PCI_BUS_ID when it assigns GPUs.
pub const CUDA_DEVICE_ORDER: &str = "CUDA_DEVICE_ORDER";

/// A snapshot of the environment, so resolution is a pure function.
#[derive(Debug, Clone, Default)]
pub struct Env(HashMap<String, String>);

impl Env {
    /// The process environment (non-UTF-8 entries skipped).
    pub fn from_process() -> Self {
        Self(std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))).collect())
    }

    /// A given set of variables (tests).
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self(pairs.into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    /// A variable's value, empty counted as unset.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str).filter(|v| !v.is_empty())
    }

    /// A variable's value, empty kept (CUDA_VISIBLE_DEVICES="" hides every GPU).
    pub fn raw(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// PATH lookup of an executable name.
    pub fn which(&self, name: &str) -> Option<std::path::PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        self.get("PATH")?
            .split(':')
            .filter(|d| !d.is_empty())
            .map(|d| std::path::Path::new(d).join(name))
            .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_values_count_as_unset() {
        let env = Env::from_pairs([("PET_NNODES", "")]);
        assert_eq!(env.get(PET_NNODES), None);
    }
}
