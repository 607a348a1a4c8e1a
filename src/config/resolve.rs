//! `RunArgs` + `Env` + [`Machine`] -> `Plan`: the per-concern resolvers
//! ([`super::nodes`], [`super::rendezvous`], [`super::timeouts`],
//! [`super::output`], [`super::entry`], [`super::gpu`]) in order, each
//! recording where its values came from.

use super::machine::Machine;
use super::{Error, Plan};
use crate::cli::RunArgs;
use crate::env::Env;

impl Plan {
    /// Resolve `args` against `env` on this machine. `need_command` is
    /// false for `doctor`.
    pub fn resolve(args: &RunArgs, env: &Env, need_command: bool) -> Result<Plan, Error> {
        Self::resolve_on(args, env, Machine::discover(env)?, need_command)
    }

    /// Resolve `args` against `env` for `machine`: no file is read here
    /// but the failure policy file (`--policy`) and PATH's python.
    pub fn resolve_on(args: &RunArgs, env: &Env, machine: Machine, need_command: bool) -> Result<Plan, Error> {
        if let Some(flag) = args.unsupported() {
            return Err(Error::Unsupported { what: flag.into(), hint: "remove it from the command line".into() });
        }
        let mut s = super::setting::Settings::new(env);
        let framework = super::framework::resolve(args, &mut s)?;
        let nodes = super::nodes::resolve(args, &mut s, &machine, framework)?;
        let rdzv = super::rendezvous::resolve(args, &mut s, nodes, &machine, framework)?;
        let t = super::timeouts::resolve(args, &mut s)?;
        let out = super::output::resolve(args, &mut s, &machine)?;
        let serve = super::serve::resolve(args, &mut s, rdzv.standalone)?;
        if let (Some(_), Some(script)) = (&serve, args.command.first()) {
            return Err(Error::Usage(format!(
                "--serve takes its runs from the control API; drop {script} from the command line and submit it as a run"
            )));
        }
        let (entry, omp_default) =
            super::entry::resolve(args, &mut s, nodes.nproc, need_command && serve.is_none(), framework)?;
        let mut entry = entry;
        let spares = super::nodes::spares(args, &mut s, nodes, framework)?;
        let (groups, nodes) =
            super::groups::resolve(args, &mut s, nodes, (framework, serve.is_some(), entry.python.as_deref()))?;
        if let Some(super::Groups { lighthouse: super::Lighthouse::Run(r), .. }) = &groups
            && r.port != 0
            && r.port == rdzv.endpoint.port
        {
            return Err(Error::Usage(format!(
                "TRAINLET_LIGHTHOUSE_PORT {}: the store listens there; give the Lighthouse another port",
                r.port
            )));
        }
        if let Some(g) = &groups
            && rdzv.serve_store != (g.job_node_rank == 0)
        {
            return Err(Error::Usage(
                "--replica-groups: the store and the Lighthouse are on node rank 0; drop is_host from --rdzv-conf"
                    .into(),
            ));
        }
        if serve.is_some() && entry.python.is_none() {
            // Served runs that name `python` get the pod's interpreter.
            entry.python = super::entry::resolve_python(args, env).ok().map(|(p, _)| p);
        }
        let preload = super::serve::resolve_preload(args, &mut s, entry.python.as_deref())?;
        let progress = super::progress::resolve(args, &mut s, rdzv.progress_timeout)?;
        let health = super::health::resolve(args, &mut s)?;
        let gpu = super::gpu::resolve(args, &mut s, machine.gpu_root, machine.gpus, nodes.nproc)?;
        let in_place = super::inplace::resolve(args, &mut s)?;
        let events = super::events::resolve(args, &mut s)?;
        if groups.is_some() && spares > 0 {
            return Err(Error::Usage(
                "--replica-groups: the other groups carry on while one restarts, so --spares does not apply; choose one"
                    .into(),
            ));
        }
        if health.evict_stragglers.is_some() && spares == 0 {
            return Err(Error::Usage(
                "--evict-stragglers: an evicted pod's rank goes to a spare; give the job --spares (or drop --evict-stragglers)"
                    .into(),
            ));
        }
        if groups.is_some() && in_place.is_some() {
            return Err(Error::Usage(
                "--replica-groups restarts one group at a time, --in-place-restart every pod: choose one".into(),
            ));
        }
        let mut plan = Plan {
            framework,
            progress,
            health,
            gpu,
            min_nodes: nodes.min_nodes,
            nnodes: nodes.nnodes,
            spares,
            nproc: nodes.nproc,
            node_rank: nodes.node_rank,
            jobset_attempt: rdzv.jobset_attempt,
            last_call: rdzv.last_call,
            heartbeat: rdzv.heartbeat,
            heartbeat_timeout: rdzv.heartbeat_timeout,
            lost_grace: rdzv.lost_grace,
            standalone: rdzv.standalone,
            endpoint: rdzv.endpoint,
            serve_store: rdzv.serve_store,
            run_id: rdzv.run_id,
            join_timeout: rdzv.join_timeout,
            store_memory: rdzv.store_memory,
            restart_backoff: t.restart_backoff,
            checkpoint_signal: t.checkpoint_signal,
            checkpoint_timeout: t.checkpoint_timeout,
            kill_timeout: t.kill_timeout,
            hung_timeout: t.hung_timeout,
            rules: t.rules,
            max_restarts: t.max_restarts,
            grace: t.grace,
            stop_signals: t.stop_signals,
            output: out,
            entry,
            serve,
            preload,
            in_place,
            events,
            groups,
            omp_default,
            provenance: s.prov,
        };
        super::serve::into_lane(&mut plan);
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::cli::TorchrunCli;
    use crate::config::Framework;
    use crate::config::InPlace;
    use crate::config::Source;
    use crate::config::Streams;
    use crate::store::Endpoint;
    use clap::Parser;
    use test_case::test_case;

    fn args(a: &[&str]) -> RunArgs {
        TorchrunCli::try_parse_from(std::iter::once("torchrun").chain(a.iter().copied())).expect("parse").run
    }

    fn plan(a: &[&str], env: &[(&str, &str)]) -> Result<Plan, Error> {
        let mut e: Vec<(&str, &str)> = vec![("PATH", "/usr/bin:/bin"), ("TRAINLET_SYSFS_ROOT", "/nonexistent")];
        e.extend_from_slice(env);
        Plan::resolve(&args(a), &Env::from_pairs(e), true)
    }

    fn err(a: &[&str], env: &[(&str, &str)]) -> String {
        plan(a, env).expect_err("must fail").to_string()
    }

    #[test]
    fn gpu_settings_from_the_inventory() {
        let d = tempfile::tempdir().expect("tmp");
        crate::gpu::sysfs::fake::dgx(d.path()).expect("tree");
        let root = d.path().to_str().expect("utf-8");
        let p = plan(&["--python", "py", "--nproc-per-node", "auto", "t.py"], &[("TRAINLET_SYSFS_ROOT", root)])
            .expect("plan");
        assert_eq!((p.nproc, p.gpu.gpus.len()), (8, 8));
        assert_eq!(p.gpu.pin, crate::gpu::PinMode::Auto);
        let p = plan(
            &["--python", "py", "--nproc-per-node", "gpu", "--numa-binding", "node", "--virtual-local-rank", "t.py"],
            &[("TRAINLET_SYSFS_ROOT", root), ("CUDA_VISIBLE_DEVICES", "3,1")],
        )
        .expect("plan");
        assert_eq!(p.nproc, 2, "CUDA_VISIBLE_DEVICES narrows");
        assert_eq!(p.gpu.gpus[0].bus_id, "0000:5d:00.0", "and orders");
        assert_eq!((p.gpu.pin, p.gpu.visibility), (crate::gpu::PinMode::Numa, crate::gpu::Visibility::Single));
        let p = plan(&["--python", "py", "t.py"], &[("TRAINLET_SYSFS_ROOT", root), ("TRAINLET_PIN", "none")])
            .expect("plan");
        assert_eq!((p.nproc, p.gpu.pin, p.gpu.expect.assign), (1, crate::gpu::PinMode::None, false));
    }

    #[test]
    fn a_lane_agent_dials_the_pods_store_and_takes_its_slots_and_their_gpus() {
        let d = tempfile::tempdir().expect("tmp");
        crate::gpu::sysfs::fake::dgx(d.path()).expect("tree");
        let root = d.path().to_str().expect("utf-8");
        let lane = r#"{"seq":7,"nproc":2,"first":4,"store":"10.0.0.5:29500","token_file":"/etc/t/token","report":true,"main_dir":"/srv/serve","run_id":"job-a","attempt":3}"#;
        let env = [("TRAINLET_SYSFS_ROOT", root), ("TRAINLET_LANE", lane), ("TRAINLET_METRICS_ADDR", "127.0.0.1:0")];
        let p = plan(&["--serve", "--nproc-per-node", "gpu", "--nnodes", "2"], &env).expect("plan");
        assert!(!p.serve_store, "a lane agent hosts no store");
        assert_eq!((p.endpoint.host.as_str(), p.endpoint.port), ("10.0.0.5", 29500));
        assert_eq!(p.nproc, 2);
        let buses: Vec<&str> = p.gpu.gpus.iter().map(|g| g.bus_id.as_str()).collect();
        let all = plan(&["--serve", "--nproc-per-node", "gpu", "--nnodes", "2"], &env[..1]).expect("plan");
        assert_eq!(buses, [all.gpu.gpus[4].bus_id.as_str(), all.gpu.gpus[5].bus_id.as_str()], "slots 4 and 5");
        assert!(p.gpu.narrowed && !all.gpu.narrowed);
        assert!(p.gpu.metrics_addr.is_none() && p.gpu.checks.is_empty());
        let serve = p.serve.as_ref().expect("serve");
        assert_eq!(serve.token_file.as_deref(), Some(std::path::Path::new("/etc/t/token")));
        assert_eq!(serve.dir, std::path::Path::new("/srv/serve/lane7"));
        assert!(serve.idle_timeout.is_none());
        assert_eq!((p.run_id.as_str(), p.jobset_attempt), ("job-a", 3), "the pod's agent's, not drawn again");
        assert_eq!(p.rdzv_id(), "job-a/lane7", "its own rendezvous");
        let bad = err(&["--serve"], &[("TRAINLET_LANE", "{\"seq\": 1}")]);
        assert!(bad.contains("TRAINLET_LANE") && bad.contains("unset it"), "{bad}");
    }

    /// A machine as resolution sees it: `gpus` GPUs, `cpus` CPUs, a host name.
    fn machine(gpus: u32, cpus: usize) -> Machine {
        let gpu = |ordinal: u32| crate::gpu::Gpu {
            bus_id: format!("0000:{:02x}:00.0", 0x10 + ordinal),
            uuid: None,
            model: None,
            minor: Some(ordinal),
            ordinal,
            numa_node: None,
            local_cpus: crate::process::CpuSet::default(),
        };
        Machine {
            gpu_root: "/nonexistent".into(),
            gpus: (0..gpus).map(gpu).collect(),
            cpus,
            hostname: "pod-7".into(),
            store_memory: 1 << 30,
        }
    }

    /// Resolution is pure over the machine it is given: what `auto`,
    /// `gpu` and `cpu` count, and this pod's name, come from it alone.
    #[test_case("auto", 8, 64, Ok(8); "auto counts gpus")]
    #[test_case("auto", 0, 6, Ok(6); "auto without a gpu counts cpus")]
    #[test_case("cpu", 8, 6, Ok(6); "cpu counts cpus")]
    #[test_case("gpu", 4, 6, Ok(4); "gpu counts gpus")]
    #[test_case("gpu", 0, 6, Err("no GPU is usable here"); "gpu without a gpu")]
    #[test_case("3", 0, 1, Ok(3); "a number is a number")]
    fn nproc_counts_the_machine_it_is_given(nproc: &str, gpus: u32, cpus: usize, want: Result<u32, &str>) {
        let env = Env::from_pairs([("PATH", "/usr/bin:/bin")]);
        let got = Plan::resolve_on(
            &args(&["--python", "py", "--nproc-per-node", nproc, "t.py"]),
            &env,
            machine(gpus, cpus),
            true,
        );
        match (got, want) {
            (Ok(p), Ok(n)) => {
                assert_eq!(p.nproc, n);
                assert_eq!(p.output.host, "pod-7", "the host name is the machine's");
                assert_eq!(p.gpu.gpus.len(), gpus as usize);
            }
            (Err(e), Err(needle)) => assert!(e.to_string().contains(needle), "{e}"),
            (got, want) => panic!("{got:?} vs {want:?}"),
        }
    }

    /// What Trainer's JAX and XGBoost plugins inject resolves like PET_*:
    /// pods, this pod's index and the store (on the port Trainer declares).
    #[test_case(&[("JAX_COORDINATOR_ADDRESS", "j-node-0-0.j:29500"), ("JAX_NUM_PROCESSES", "3"), ("JAX_PROCESS_ID", "2")], 0,
        Ok((Framework::Jax, 3, 2, 1, "j-node-0-0.j:29500")); "jax")]
    #[test_case(&[("DMLC_TRACKER_URI", "x-node-0-0.x"), ("DMLC_TRACKER_PORT", "29500"), ("DMLC_TASK_ID", "1"), ("DMLC_NUM_WORKER", "8")], 4,
        Ok((Framework::Xgboost, 2, 1, 4, "x-node-0-0.x:29500")); "xgboost counts workers per gpu")]
    #[test_case(&[("DMLC_TRACKER_URI", "x"), ("DMLC_TASK_ID", "0"), ("DMLC_NUM_WORKER", "2")], 0,
        Ok((Framework::Xgboost, 2, 0, 1, "x:29500")); "xgboost on cpu is a worker per pod")]
    #[test_case(&[("DMLC_TRACKER_URI", "x"), ("DMLC_NUM_WORKER", "6")], 4,
        Err("DMLC_NUM_WORKER"); "xgboost workers not a multiple of the gpus")]
    #[test_case(&[("JAX_NUM_PROCESSES", "2"), ("JAX_PROCESS_ID", "2")], 0,
        Err("JAX_PROCESS_ID"); "jax process id out of range")]
    #[test_case(&[("TRAINLET_FRAMEWORK", "jax"), ("PET_NNODES", "1:3")], 0,
        Err("fixed number of processes"); "jax is not elastic")]
    #[test_case(&[("TRAINLET_FRAMEWORK", "xgboost"), ("PET_NNODES", "2"), ("PET_NODE_RANK", "1"), ("PET_RDZV_CONF", "is_host=1")], 0,
        Err("store on node rank 0"); "xgboost tracker next to the store")]
    fn framework_env_resolves(env: &[(&str, &str)], gpus: u32, want: Result<(Framework, u32, u32, u32, &str), &str>) {
        let env = Env::from_pairs(env.iter().copied().chain([("PATH", "/usr/bin:/bin")]));
        match (Plan::resolve_on(&args(&["--python", "py", "t.py"]), &env, machine(gpus, 4), true), want) {
            (Ok(p), Ok((fw, nnodes, rank, nproc, endpoint))) => {
                assert_eq!((p.framework, p.nnodes, p.node_rank, p.nproc), (fw, nnodes, rank, nproc));
                assert_eq!(p.endpoint.to_string(), endpoint);
            }
            (Err(e), Err(needle)) => assert!(e.to_string().contains(needle), "{e}"),
            (got, want) => panic!("{got:?} vs {want:?}"),
        }
    }

    /// Trainer's three status variables come together or not at all; the
    /// progress timeout comes from the flag, the env or `--rdzv-conf`.
    #[test_case(&[], &[], Ok((false, None)); "nothing set: nothing changes")]
    #[test_case(&[], &[("KUBEFLOW_TRAINER_SERVER_URL", "https://t.ns.svc:443/status"), ("KUBEFLOW_TRAINER_SERVER_CA_CERT", "/ca"),
        ("KUBEFLOW_TRAINER_SERVER_TOKEN", "/token")], Ok((true, None)); "all three")]
    #[test_case(&[], &[("KUBEFLOW_TRAINER_SERVER_URL", "https://t/status")], Ok((false, None)); "partial: off, with a warning")]
    #[test_case(&[], &[("KUBEFLOW_TRAINER_SERVER_URL", "ftp://t"), ("KUBEFLOW_TRAINER_SERVER_CA_CERT", "/ca"),
        ("KUBEFLOW_TRAINER_SERVER_TOKEN", "/token")], Ok((false, None)); "not http: off, with a warning")]
    #[test_case(&["--progress-timeout", "30"], &[("TRAINLET_PROGRESS_TIMEOUT", "5")], Ok((false, Some(30))); "flag over env")]
    #[test_case(&[], &[("TRAINLET_PROGRESS_TIMEOUT", "5"), ("PET_RDZV_CONF", "progress_timeout=9")], Ok((false, Some(5))); "env over conf")]
    #[test_case(&[], &[("PET_RDZV_CONF", "progress_timeout=9")], Ok((false, Some(9))); "rdzv conf key")]
    #[test_case(&["--progress-timeout", "0"], &[], Err("--progress-timeout"); "zero is refused")]
    fn progress_settings(a: &[&str], env: &[(&str, &str)], want: Result<(bool, Option<u64>), &str>) {
        match (plan(&[a, &["--python", "py", "t.py"]].concat(), env), want) {
            (Ok(p), Ok((upstream, timeout))) => {
                assert_eq!(p.progress.upstream.is_some(), upstream);
                let off = env.iter().any(|(k, _)| k.starts_with("KUBEFLOW")) && !upstream;
                assert_eq!(p.progress.off_because.is_some(), off, "{:?}", p.progress.off_because);
                assert_eq!(p.progress.timeout, timeout.map(Duration::from_secs));
            }
            (Err(e), Err(needle)) => assert!(e.to_string().contains(needle), "{e}"),
            (got, want) => panic!("{got:?} vs {want:?}"),
        }
    }

    /// Every value doctor prints says where it came from.
    #[test]
    fn every_setting_has_a_source() {
        let env = Env::from_pairs([("PATH", "/usr/bin:/bin"), ("PET_NNODES", "2")]);
        let p = Plan::resolve_on(&args(&["--python", "py", "--tee", "3", "t.py"]), &env, machine(2, 4), true)
            .expect("plan");
        let named: Vec<&str> = p.provenance.iter().map(|(n, _, _)| *n).collect();
        for want in [
            "nnodes",
            "node rank",
            "gpus",
            "nproc per node",
            "store endpoint",
            "run id",
            "join timeout",
            "store memory budget",
            "heartbeat timeout",
            "max restarts",
            "grace period",
            "stop signals",
            "restart backoff",
            "kill timeout",
            "hung timeout",
            "failure policy",
            "role",
            "redirects",
            "tee",
            "console ranks",
            "line prefix",
            "host",
            "python",
            "pin",
            "gpu visibility",
            "preflight",
            "nvml timeout",
        ] {
            assert!(named.contains(&want), "{want} missing from {named:?}");
        }
        let tee = p.provenance.iter().find(|(n, _, _)| *n == "tee").expect("tee");
        assert_eq!((tee.1.as_str(), &tee.2), ("3", &Source::Flag("--tee")));
        assert_eq!(p.store_memory, 1 << 30, "the default budget is the machine's");
        let nnodes = p.provenance.iter().find(|(n, _, _)| *n == "nnodes").expect("nnodes");
        assert_eq!(nnodes.2, Source::Env("PET_NNODES"));
    }

    /// The runtimes' optional ConfigMap: a file that is not there gives the
    /// default rules; one that is there is read (and must parse); a file
    /// that `TRAINLET_POLICY` names must exist.
    #[test]
    fn a_policy_file_if_present_is_read_only_when_it_exists() {
        let d = tempfile::tempdir().expect("tmp");
        let missing = d.path().join("policy.toml");
        let missing = missing.to_str().expect("utf-8");
        let p = plan(&["--python", "py", "t.py"], &[("TRAINLET_POLICY_IF_PRESENT", missing)]).expect("plan");
        let policy = p.provenance.iter().find(|(n, _, _)| *n == "failure policy").expect("failure policy");
        assert_eq!(policy.2, Source::Default, "{policy:?}");
        let msg = err(&["t.py"], &[("TRAINLET_POLICY", missing)]);
        assert!(msg.contains("cannot read the failure policy file"), "{msg}");

        std::fs::write(missing, "[[rule]]\nexit_codes = [3]\naction = \"fail\"\n").expect("write");
        let p = plan(&["--python", "py", "t.py"], &[("TRAINLET_POLICY_IF_PRESENT", missing)]).expect("plan");
        let policy = p.provenance.iter().find(|(n, _, _)| *n == "failure policy").expect("failure policy");
        assert_eq!(policy.2, Source::Env("TRAINLET_POLICY_IF_PRESENT"), "{policy:?}");
        assert!(policy.1.contains("policy.toml rule 1"), "{policy:?}");

        std::fs::write(missing, "[[rule]]\naction = 7\n").expect("write");
        let msg = err(&["t.py"], &[("TRAINLET_POLICY_IF_PRESENT", missing)]);
        assert!(msg.contains("invalid failure policy file"), "{msg}");
    }

    #[test]
    fn no_options_no_env_is_standalone_on_this_machine() {
        let p = plan(&["--python", "py", "t.py"], &[]).expect("plan");
        assert!(p.standalone && p.serve_store);
        assert_eq!((p.nnodes, p.nproc, p.node_rank), (1, 1, 0));
        assert_eq!(p.endpoint, Endpoint { host: "127.0.0.1".into(), port: 0 });
        assert_eq!(p.entry.args, ["-u", "t.py"]);
    }

    /// torchrun's stacked single-node recipe (`--rdzv-endpoint=localhost:0
    /// --nnodes=1`) and a static `--master-port 0`: this pod serves the
    /// store on a port picked when it binds.
    #[test_case(&["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1", "t.py"], "localhost"; "stacked")]
    #[test_case(&["--master-port", "0", "--nnodes", "1", "t.py"], "127.0.0.1"; "static")]
    #[test_case(&["--master-port", "0", "--nnodes", "1:1", "t.py"], "127.0.0.1"; "elastic of one")]
    fn port_0_on_one_node_is_a_free_port_this_pod_serves(a: &[&str], host: &str) {
        let mut full = vec!["--python", "py"];
        full.extend_from_slice(a);
        let p = plan(&full, &[]).expect("plan");
        assert!(!p.standalone && p.serve_store, "{p:?}");
        assert_eq!(p.endpoint, Endpoint { host: host.into(), port: 0 });
        assert!(p.describe().contains("served by this pod on a free port"), "{}", p.describe());
    }

    #[test]
    fn trainer_env_is_read() {
        let env = [
            ("PET_NNODES", "3"),
            ("PET_NPROC_PER_NODE", "2"),
            ("PET_NODE_RANK", "2"),
            ("PET_MASTER_ADDR", "job-node-0-0.job"),
            ("PET_MASTER_PORT", "29500"),
        ];
        let p = plan(&["--python", "py", "t.py"], &env).expect("plan");
        assert!(!p.standalone && !p.serve_store);
        assert_eq!((p.nnodes, p.nproc, p.node_rank, p.world_size()), (3, 2, 2, 6));
        assert_eq!(p.endpoint.to_string(), "job-node-0-0.job:29500");
        assert!(p.provenance.iter().any(|(n, _, s)| *n == "node rank" && *s == Source::Env("PET_NODE_RANK")));
    }

    #[test]
    fn cli_beats_env_and_completion_index_is_the_fallback() {
        let env = [("PET_NNODES", "4"), ("JOB_COMPLETION_INDEX", "3"), ("PET_MASTER_ADDR", "m")];
        let p = plan(&["--python", "py", "--nnodes", "5", "t.py"], &env).expect("plan");
        assert_eq!((p.nnodes, p.node_rank), (5, 3));
        let p = plan(
            &["--python", "py", "t.py"],
            &[("PET_NNODES", "4"), ("PET_NODE_RANK", "1"), ("JOB_COMPLETION_INDEX", "3")],
        )
        .expect("plan");
        assert_eq!(p.node_rank, 1, "PET_NODE_RANK before JOB_COMPLETION_INDEX");
    }

    #[test_case(&["--nnodes", "x", "t.py"], &[], "--nnodes value \"x\""; "nnodes not a number")]
    #[test_case(&["t.py"], &[("PET_NNODES", "zero")], "PET_NNODES value \"zero\""; "nnodes env")]
    #[test_case(&["--nnodes", "1:x", "t.py"], &[], "--nnodes value \"1:x\""; "elastic max not a number")]
    #[test_case(&["--nnodes", "3:2", "t.py"], &[], "MIN <= MAX"; "min above max")]
    #[test_case(&["t.py"], &[("PET_NNODES", "2"), ("PET_NODE_RANK", "2")], "PET_NODE_RANK value \"2\": expected a node rank below nnodes (2)"; "rank too big")]
    #[test_case(&["--node-rank", "-1", "t.py"], &[], "--node-rank value \"-1\""; "negative rank")]
    #[test_case(&["t.py"], &[("JOB_COMPLETION_INDEX", "abc")], "JOB_COMPLETION_INDEX value \"abc\""; "completion index")]
    #[test_case(&["--master-port", "70000", "t.py"], &[], "--master-port value \"70000\": expected a TCP port 1-65535, or 0 for a free port"; "port range")]
    #[test_case(&["--master-port", "0", "--nnodes", "2", "t.py"], &[], "--master-port gives port 0 (a free port) to a job of up to 2 nodes"; "free port multi")]
    #[test_case(&["--rdzv-endpoint", "h:0", "--nnodes", "1:2", "t.py"], &[], "--rdzv-endpoint gives port 0 (a free port) to a job of up to 2 nodes"; "free port elastic")]
    #[test_case(&["--rdzv-endpoint", "h:0", "--rdzv-conf", "is_host=false", "t.py"], &[], "is_host=false in --rdzv-conf makes another pod serve"; "free port not host")]
    #[test_case(&["--rdzv-conf", "bogus=1", "t.py"], &[], "use_libuv, store_type=tcp"; "every conf key listed")]
    #[test_case(&["t.py"], &[("PET_MASTER_PORT", "http")], "PET_MASTER_PORT value \"http\""; "port env")]
    #[test_case(&["--nproc-per-node", "0", "t.py"], &[], "--nproc-per-node value \"0\""; "nproc zero")]
    #[test_case(&["t.py"], &[("PET_NPROC_PER_NODE", "many")], "PET_NPROC_PER_NODE value \"many\": expected an integer >= 1, auto, cpu or gpu"; "nproc env")]
    #[test_case(&["--nproc-per-node", "gpu", "t.py"], &[("CUDA_VISIBLE_DEVICES", "")], "no GPU is usable here"; "gpu without gpus")]
    #[test_case(&["--rdzv-backend", "etcd", "t.py"], &[], "--rdzv-backend etcd is not supported"; "etcd")]
    #[test_case(&["--rdzv-conf", "join_timeout=", "t.py"], &[], "a value for join_timeout"; "empty conf value")]
    #[test_case(&["--rdzv-conf", "store_type=file", "t.py"], &[], "--rdzv-conf store_type=file is not supported"; "store type")]
    #[test_case(&["--rdzv-conf", "keep_alive_max_attempt=0", "t.py"], &[], "keep_alive_max_attempt >= 1"; "keep alive attempts")]
    #[test_case(&["--heartbeat-timeout", "0.5", "t.py"], &[], "at least two heartbeat periods"; "heartbeat too short")]
    #[test_case(&["--heartbeat-timeout", "1e9", "t.py"], &[], "--heartbeat-timeout value \"1e9\": expected a heartbeat timeout of at most 86400 s"; "heartbeat too long")]
    #[test_case(&["--rdzv-conf", "keep_alive_interval=1e18,keep_alive_max_attempt=4000000000", "t.py"], &[], "at most 86400 s"; "keep alive overflow")]
    #[test_case(&["--lost-grace", "11", "t.py"], &[], "--lost-grace value \"11\": expected a grace of at most the heartbeat timeout (10s)"; "grace past timeout")]
    #[test_case(&["t.py"], &[("TRAINLET_LOST_GRACE", "soon")], "TRAINLET_LOST_GRACE value \"soon\": expected a number of seconds"; "grace env")]
    #[test_case(&["--checkpoint-signal", "SIGBOGUS", "t.py"], &[], "--checkpoint-signal value \"SIGBOGUS\""; "checkpoint signal")]
    #[test_case(&["--checkpoint-signal", "USR1", "--checkpoint-timeout", "40", "t.py"], &[], "must be shorter than the grace period"; "checkpoint beyond grace")]
    #[test_case(&["--on-exit", "3=explode", "t.py"], &[], "invalid failure rule \"3=explode\""; "bad rule flag")]
    #[test_case(&["--policy", "/nonexistent/p.toml", "t.py"], &[], "cannot read the failure policy file /nonexistent/p.toml"; "missing policy")]
    #[test_case(&["t.py"], &[("JOBSET_RESTART_ATTEMPT", "x")], "JOBSET_RESTART_ATTEMPT value \"x\""; "jobset attempt")]
    #[test_case(&["--kill-timeout", "-1", "t.py"], &[], "--kill-timeout value \"-1\""; "kill timeout")]
    #[test_case(&["--max-restarts", "-2", "t.py"], &[], "--max-restarts value \"-2\""; "restarts")]
    #[test_case(&["--numa-binding", "socket", "t.py"], &[], "--numa-binding socket is not supported"; "numa socket")]
    #[test_case(&["--pin", "sometimes", "t.py"], &[], "--pin value \"sometimes\": expected none, gpu, cpu, numa or auto"; "pin")]
    #[test_case(&["t.py"], &[("TRAINLET_PREFLIGHT", "ecc,temp")], "TRAINLET_PREFLIGHT value \"ecc,temp\""; "preflight")]
    #[test_case(&["--mig", "maybe", "t.py"], &[], "--mig value \"maybe\": expected on or off"; "mig")]
    #[test_case(&["--gpu-visibility", "some", "t.py"], &[], "expected all or single"; "visibility")]
    #[test_case(&["--metrics-addr", "9400", "t.py"], &[], "an address and port like 0.0.0.0:9400"; "metrics addr")]
    #[test_case(&["--no-python", "-m", "t.py"], &[], "cannot be combined"; "no python with module")]
    #[test_case(&["--standalone", "--nnodes", "2"], &[], "--standalone runs one node"; "standalone multi")]
    #[test_case(&["--signals-to-handle", "SIGNOPE", "t.py"], &[], "--signals-to-handle value"; "bad signal")]
    #[test_case(&["--rdzv-endpoint", "[::1", "t.py"], &[], "--rdzv-endpoint value \"[::1\""; "bad endpoint")]
    #[test_case(&["--shutdown-timeout", "soon", "t.py"], &[], "--shutdown-timeout value \"soon\""; "grace")]
    #[test_case(&["--in-place-restart", "t.py"], &[("POD_NAME", "p")], "JOBSET_NAME is not set; give it with the downward API"; "in place without jobset")]
    #[test_case(&["t.py"], &[("TRAINLET_IN_PLACE_RESTART", "1"), ("JOBSET_NAME", "j")], "POD_NAME is not set"; "in place without pod")]
    #[test_case(&["--in-place-restart", "t.py"], &[("JOBSET_NAME", "j"), ("POD_NAME", "p"), ("IN_PLACE_RESTART_EXIT_CODE", "0")], "IN_PLACE_RESTART_EXIT_CODE value \"0\": expected an exit code from 1 to 255 other than"; "in place exit 0")]
    #[test_case(&["t.py"], &[("TRAINLET_IN_PLACE_RESTART", "yes")], "TRAINLET_IN_PLACE_RESTART value \"yes\""; "in place bad bool")]
    fn bad_input_names_the_culprit(a: &[&str], env: &[(&str, &str)], want: &str) {
        let mut full = vec!["--python", "py"];
        full.extend_from_slice(a);
        let msg = err(&full, env);
        assert!(msg.contains(want), "{msg:?} should contain {want:?}");
    }

    #[test]
    fn in_place_restarts_read_jobsets_agent_env() {
        let env = [("JOBSET_NAME", "train"), ("POD_NAME", "train-node-0-0-x"), ("IN_PLACE_RESTART_EXIT_CODE", "42")];
        let p = plan(&["--python", "py", "--in-place-restart", "t.py"], &env).expect("plan");
        let want = InPlace { jobset: "train".into(), pod: "train-node-0-0-x".into(), namespace: None, exit_code: 42 };
        assert_eq!(p.in_place, Some(want));
        let p = plan(&["--python", "py", "t.py"], &env).expect("plan");
        assert_eq!(p.in_place, None, "off unless asked for");
        let env =
            [("TRAINLET_IN_PLACE_RESTART", "1"), ("JOBSET_NAME", "j"), ("POD_NAME", "p"), ("POD_NAMESPACE", "ns")];
        let p = plan(&["--python", "py", "t.py"], &env).expect("plan");
        let got = p.in_place.expect("on");
        assert_eq!((got.namespace.as_deref(), got.exit_code), (Some("ns"), 1), "JobSet's agent exits 1 by default");
    }

    #[test]
    fn replica_groups_give_each_group_its_own_rendezvous() {
        let env = [
            ("PET_NNODES", "4"),
            ("PET_NODE_RANK", "3"),
            ("PET_MASTER_ADDR", "job-0"),
            ("TRAINLET_LIGHTHOUSE", "/bin/true"),
        ];
        let p = plan(&["--python", "py", "--replica-groups", "2", "--rdzv-id", "job", "t.py"], &env).expect("plan");
        assert_eq!((p.nnodes, p.node_rank, p.serve_store), (2, 1, false), "pod 3 is group 1's second pod");
        assert_eq!(p.rdzv_id(), "job/g1");
        assert_eq!(p.run_id, "job", "the workers see the job's run id");
        let env = [
            ("PET_NNODES", "4"),
            ("PET_NODE_RANK", "0"),
            ("PET_MASTER_ADDR", "job-0"),
            ("TRAINLET_LIGHTHOUSE", "/bin/true"),
        ];
        let p = plan(&["--python", "py", "--replica-groups", "2", "t.py"], &env).expect("plan");
        assert!(p.serve_store, "node rank 0 serves every group's store");
        assert_eq!(p.rdzv_id(), "none/g0");
        let both = [("JOBSET_NAME", "j"), ("POD_NAME", "p"), ("TRAINLET_LIGHTHOUSE", "/bin/true"), ("PET_NNODES", "2")];
        let e = err(&["--python", "py", "--replica-groups", "2", "--in-place-restart", "t.py"], &both);
        assert!(e.contains("choose one"), "{e}");
        let e = err(&["--python", "py", "--replica-groups", "2", "--rdzv-conf", "is_host=1", "t.py"], &env[..1]);
        assert!(e.contains("is_host") || e.contains("TRAINLET_LIGHTHOUSE"), "{e}");
    }

    #[test]
    fn spares_leave_the_others_to_train_and_bad_counts_say_what_fits() {
        let p = plan(&["--spares", "1", "t.py"], &[("PET_NNODES", "3"), ("PET_NODE_RANK", "2")]).expect("plan");
        assert_eq!((p.nnodes, p.spares, p.world_nodes(), p.world_size()), (3, 1, (2, 2), 2));
        assert!(p.describe().contains("the others train: 2 pods"), "{}", p.describe());
        let p = plan(&["--nnodes", "2:5", "t.py"], &[("TRAINLET_SPARES", "2")]).expect("elastic");
        assert_eq!(p.world_nodes(), (2, 3));
        assert_eq!(plan(&["t.py"], &[("PET_NNODES", "2")]).expect("none").world_nodes(), (2, 2));
        let e = err(&["--spares", "3", "t.py"], &[("PET_NNODES", "3")]);
        assert!(e.contains("--spares") && e.contains("fewer than the job's 3 pods"), "{e}");
        let e = err(&["--nnodes", "2:3", "--spares", "2", "t.py"], &[]);
        assert!(e.contains("at most MAX - MIN = 1 of --nnodes 2:3"), "{e}");
        let e = err(&["--spares", "x", "t.py"], &[]);
        assert!(e.contains("a number of spare pods"), "{e}");
        let e = err(&["--spares", "1", "t.py"], &[("JAX_NUM_PROCESSES", "2"), ("JAX_COORDINATOR_ADDRESS", "h:1234")]);
        assert!(e.contains("no spares for"), "{e}");
        let e = err(&["--evict-stragglers", "60", "t.py"], &[("PET_NNODES", "3")]);
        assert!(e.contains("--evict-stragglers") && e.contains("give the job --spares"), "{e}");
        let p = plan(&["--spares", "1", "--evict-stragglers", "60", "t.py"], &[("PET_NNODES", "3")]).expect("plan");
        assert_eq!(p.health.evict_stragglers, Some(Duration::from_secs(60)));
        let e = err(
            &["--spares", "1", "--replica-groups", "2", "t.py"],
            &[("PET_NNODES", "4"), ("TORCHFT_LIGHTHOUSE", "http://h:29510")],
        );
        assert!(e.contains("--spares does not apply"), "{e}");
    }

    #[test]
    fn the_lost_grace_is_read_and_never_outlasts_the_heartbeat_timeout() {
        let p = plan(&["--lost-grace", "2.5", "t.py"], &[]).expect("plan");
        assert_eq!(p.lost_grace, Duration::from_millis(2500));
        let p = plan(&["t.py"], &[("TRAINLET_LOST_GRACE", "10"), ("TRAINLET_HEARTBEAT_TIMEOUT", "10")]).expect("plan");
        assert_eq!(p.lost_grace, Duration::from_secs(10), "as long as the timeout");
        let p = plan(&["--rdzv-conf", "keep_alive_interval=0.1,keep_alive_max_attempt=3", "t.py"], &[]).expect("plan");
        assert_eq!(p.lost_grace, Duration::from_millis(300), "the default, cut to a shorter timeout");
    }

    #[test]
    fn elastic_and_failure_settings_are_read() {
        let p = plan(
            &[
                "--nnodes",
                "2:4",
                "--rdzv-conf",
                "last_call_timeout=2,keep_alive_interval=0.5,keep_alive_max_attempt=4",
                "--on-exit",
                "3=fail",
                "--checkpoint-signal",
                "SIGUSR1",
                "--shutdown-timeout",
                "10",
                "t.py",
            ],
            &[
                ("JOBSET_RESTART_ATTEMPT", "3"),
                ("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "60"),
                ("TRAINLET_RESTART_BACKOFF", "2"),
            ],
        )
        .expect("plan");
        assert_eq!((p.min_nodes, p.nnodes, p.nnodes_spec()), (2, 4, "2:4".to_string()));
        assert_eq!(
            (p.last_call, p.heartbeat, p.heartbeat_timeout),
            (Duration::from_secs(2), Duration::from_millis(500), Duration::from_secs(2))
        );
        assert_eq!(p.lost_grace, Duration::from_millis(500), "the default");
        assert_eq!(p.jobset_attempt, 3);
        assert_eq!(p.hung_timeout, Some(Duration::from_secs(60)));
        assert_eq!(p.restart_backoff, Duration::from_secs(2));
        assert_eq!(p.checkpoint_signal, Some(libc::SIGUSR1));
        assert_eq!(p.checkpoint_timeout, Duration::from_secs(5), "capped at half the grace period");
        assert_eq!(p.rules.action(crate::sys::Exit::Code(3)), crate::config::rules::RuleAction::Fail);
        let d = p.describe();
        assert!(d.contains("2:4") && d.contains("3=fail") && d.contains("SIGUSR1"), "{d}");
    }

    #[test]
    fn defaults_fit_the_kubernetes_grace_period() {
        let p = plan(&["t.py"], &[]).expect("plan");
        assert!(p.grace + p.kill_timeout < Duration::from_secs(30));
        assert_eq!(p.checkpoint_signal, None);
        assert_eq!(p.hung_timeout, None);
    }

    #[test]
    fn missing_script_is_a_usage_error() {
        assert!(err(&["--python", "py"], &[]).contains("missing the training script"));
    }

    #[test_case("h:1234", "h", 1234; "host port")]
    #[test_case("h", "h", 29400; "default c10d port")]
    #[test_case("[::1]:5", "::1", 5; "ipv6")]
    fn endpoints(v: &str, host: &str, port: u16) {
        let p = plan(&["--python", "py", "--rdzv-backend", "c10d", "--rdzv-endpoint", v, "--nnodes", "2", "t.py"], &[])
            .expect("plan");
        assert_eq!(p.endpoint, Endpoint { host: host.into(), port });
    }

    #[test]
    fn entrypoints_match_torchrun() {
        let p = plan(&["--python", "py", "-m", "pkg.train", "--lr", "1"], &[]).expect("plan");
        assert_eq!(p.entry.args, ["-u", "-m", "pkg.train", "--lr", "1"]);
        let p = plan(&["--no-python", "/bin/echo", "hi"], &[]).expect("plan");
        assert_eq!((p.entry.program.as_str(), p.entry.args.as_slice()), ("/bin/echo", &["hi".to_string()][..]));
        let p = plan(&["t.py"], &[("TRAINLET_PYTHON", "/opt/py")]).expect("plan");
        assert_eq!(p.entry.program, "/opt/py");
    }

    #[test]
    fn streams_parse_like_torchrun() {
        let s = Streams::parse("--tee", "0:3,1:2").expect("parse");
        assert_eq!((s.for_rank(0), s.for_rank(1), s.for_rank(2)), ((true, true), (false, true), (false, false)));
        assert_eq!(Streams::parse("--tee", "1").expect("parse").for_rank(7), (true, false));
        assert!(Streams::parse("--tee", "4").is_err());
    }

    #[test]
    fn omp_threads_default_like_torchrun() {
        assert_eq!(
            plan(&["--python", "py", "--nproc-per-node", "2", "t.py"], &[]).expect("plan").omp_default.as_deref(),
            Some("1")
        );
        assert_eq!(
            plan(&["--python", "py", "--nproc-per-node", "2", "t.py"], &[("OMP_NUM_THREADS", "4")])
                .expect("plan")
                .omp_default,
            None
        );
    }
}
