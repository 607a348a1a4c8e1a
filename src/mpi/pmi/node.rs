//! One pod's PMI service as a pure state machine: the commands of its
//! local ranks in, the replies and the job-wide fences out. No I/O here;
//! the server feeds it what each rank's socket reads and carries out the
//! effects (write a reply, run a fence over the store, stop the job).

use std::collections::{BTreeMap, HashMap};

use super::wire::{Command, format_v1, format_v2};

/// Longest key a rank may put.
pub const KEYLEN_MAX: usize = 64;
/// Longest value a rank may put (MPICH fits its puts into 1024-byte lines).
pub const VALLEN_MAX: usize = 1024;
/// Longest kvsname we hand out.
pub const KVSNAME_MAX: usize = 256;
/// Most keys one pod may put between two fences.
pub const MAX_PENDING: usize = 65_536;
/// Most bytes of keys and values the job's key-value space may hold
/// (every pod's puts of every fence of the round; MPICH puts a few
/// hundred bytes per rank).
pub const MAX_KVS_BYTES: usize = 64 << 20;

/// What every rank of the job is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorldInfo {
    /// The key-value space's name (PMI-1 kvsname, PMI-2 jobid).
    pub kvsname: String,
    /// Ranks in the job.
    pub size: u32,
    /// This pod's first rank; its local rank `l` is `first_rank + l`.
    pub first_rank: u32,
    /// Ranks on this pod.
    pub local: usize,
    /// `PMI_process_mapping`, pre-put.
    pub mapping: String,
}

/// The wire a rank speaks now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// PMI-1 lines (every rank starts here).
    V1,
    /// PMI-2 frames (after `init pmi_version=2`).
    V2,
}

/// What the server must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Write these bytes to local rank `local`.
    Reply {
        /// The local rank.
        local: usize,
        /// A PMI-1 line or PMI-2 frame.
        bytes: Vec<u8>,
    },
    /// Every local rank is at the fence: publish `puts` for the job, wait
    /// for every pod, then call [`Node::fenced`] with the job's keys.
    Fence {
        /// This pod's puts since the last fence.
        puts: Vec<(String, String)>,
    },
    /// Local rank `local` called abort: the job ends (no reply is
    /// written; a PMI-1 client waits to be killed, Slurm's PMI-2 library
    /// exits 1 by itself).
    Abort {
        /// The local rank.
        local: usize,
        /// Its exit code (1 when it gave none).
        code: i32,
        /// What it said (empty when nothing).
        why: String,
    },
    /// Local rank `local` broke the protocol or asked for what trainlet
    /// does not serve (spawn): it waits for a reply it will never get, so
    /// it must be stopped, and the job ends.
    Refuse {
        /// The local rank.
        local: usize,
        /// What it did wrong.
        why: String,
    },
}

/// One pod's PMI state.
#[derive(Debug)]
pub struct Node {
    job: WorldInfo,
    wires: Vec<Wire>,
    /// The fence request each local rank waits on (to answer it in kind).
    waiting: Vec<Option<Command>>,
    pending: BTreeMap<String, String>,
    kvs: HashMap<String, String>,
    node_attrs: HashMap<String, String>,
    /// Ranks waiting (`info-getnodeattr wait=TRUE`) for a node attribute
    /// not yet put: at most one each (a rank waits for its reply).
    attr_waits: Vec<Option<Command>>,
    fencing: bool,
    /// Ranks that finalized or closed their socket: they take part in no
    /// fence any more.
    done: Vec<bool>,
    kvs_bytes: usize,
}

impl Node {
    /// A node for `job`, with `PMI_process_mapping` pre-put.
    pub fn new(job: WorldInfo) -> Node {
        let mut kvs = HashMap::new();
        kvs.insert("PMI_process_mapping".to_string(), job.mapping.clone());
        Node {
            wires: vec![Wire::V1; job.local],
            waiting: vec![None; job.local],
            attr_waits: vec![None; job.local],
            done: vec![false; job.local],
            job,
            pending: BTreeMap::new(),
            kvs,
            node_attrs: HashMap::new(),
            fencing: false,
            kvs_bytes: 0,
        }
    }

    /// The wire local rank `local` speaks now.
    pub fn wire(&self, local: usize) -> Wire {
        self.wires.get(local).copied().unwrap_or(Wire::V1)
    }

    fn reply(&self, local: usize, query: &Command, name: &str, args: &[(&str, String)]) -> Effect {
        let mut cmd = Command::new(name).arg("rc", 0);
        for (k, v) in args {
            cmd = cmd.arg(k, v);
        }
        if let Some(thrid) = query.get("thrid") {
            cmd = cmd.arg("thrid", thrid);
        }
        let bytes = match self.wire(local) {
            Wire::V1 => format_v1(&cmd),
            Wire::V2 => format_v2(&cmd).unwrap_or_else(|| {
                format_v2(&Command::new(name).arg("rc", -1).arg("errmsg", "reply_too_long")).unwrap_or_default()
            }),
        };
        Effect::Reply { local, bytes }
    }

    /// Local rank `local` closed its socket (it exited, or closed `PMI_FD`).
    pub fn closed(&mut self, local: usize) -> Vec<Effect> {
        if let Some(d) = self.done.get_mut(local) {
            *d = true;
        }
        self.stuck()
    }

    /// A refusal when no local rank can move any more: none is free (each
    /// waits at a fence or for a node attribute, or is done) and one
    /// waits, with no fence under way. A fence needs every local rank, so
    /// one that is done leaves it waiting forever; so does a node
    /// attribute nobody is left to put.
    fn stuck(&self) -> Vec<Effect> {
        let blocked = |l: usize| self.waiting[l].is_some() || self.attr_waits[l].is_some();
        let n = self.job.local;
        if self.fencing || (0..n).any(|l| !self.done[l] && !blocked(l)) {
            return Vec::new();
        }
        let Some(first) = (0..n).find(|&l| blocked(l)) else { return Vec::new() };
        let done: Vec<usize> = (0..n).filter(|&l| self.done[l] && !blocked(l)).collect();
        let at_fence: Vec<usize> = (0..n).filter(|&l| self.waiting[l].is_some()).collect();
        let why = if done.is_empty() {
            format!(
                "every local rank waits and none can move: local ranks {at_fence:?} at a fence, the others for node attributes nobody puts"
            )
        } else {
            format!(
                "local ranks {done:?} finalized or left PMI while local ranks {at_fence:?} wait at a fence (or others for node attributes): they can never go on"
            )
        };
        Self::refuse(first, why)
    }

    /// The answer to `info-getnodeattr` `query` as things are now.
    fn attr_reply(&self, local: usize, query: &Command) -> Effect {
        let found = query.get("key").and_then(|k| self.node_attrs.get(k)).cloned();
        let args = match found {
            Some(v) => vec![("found", "TRUE".to_string()), ("value", v)],
            None => vec![("found", "FALSE".to_string())],
        };
        self.reply(local, query, "info-getnodeattr-response", &args)
    }

    /// A failed reply (`rc=1`) saying the name service is not served.
    fn error_reply(&self, local: usize, query: &Command, name: &str) -> Effect {
        let why = "trainlet does not serve MPI's name service (publish/lookup)";
        let cmd = match self.wire(local) {
            Wire::V1 => Command::new(name).arg("rc", 1).arg("msg", why),
            Wire::V2 => Command::new(name).arg("rc", 1).arg("errmsg", why),
        };
        let cmd = match query.get("thrid") {
            Some(t) => cmd.arg("thrid", t),
            None => cmd,
        };
        let bytes = match self.wire(local) {
            Wire::V1 => format_v1(&cmd),
            Wire::V2 => format_v2(&cmd).unwrap_or_default(),
        };
        Effect::Reply { local, bytes }
    }

    fn refuse(local: usize, why: String) -> Vec<Effect> {
        vec![Effect::Refuse { local, why }]
    }

    /// Handle `cmd` from local rank `local`.
    pub fn handle(&mut self, local: usize, cmd: &Command) -> Vec<Effect> {
        if local >= self.job.local {
            return Self::refuse(local, format!("local rank {local} is not one of this pod's {}", self.job.local));
        }
        let rank = self.job.first_rank + u32::try_from(local).unwrap_or(u32::MAX);
        let job = &self.job;
        match cmd.name.as_str() {
            "init" => {
                let v2 = cmd.get("pmi_version") == Some("2");
                let (version, sub) = if v2 { ("2", "0") } else { ("1", "1") };
                let reply = self.reply(
                    local,
                    cmd,
                    "response_to_init",
                    &[("pmi_version", version.into()), ("pmi_subversion", sub.into())],
                );
                if v2 {
                    self.wires[local] = Wire::V2;
                }
                vec![reply]
            }
            "fullinit" => vec![self.reply(
                local,
                cmd,
                "fullinit-response",
                // Slurm's client needs every one but the last two, and
                // those as TRUE/FALSE; `spawner-jobid` only for spawned
                // jobs (its presence means spawned).
                &[
                    ("pmi-version", "2".into()),
                    ("pmi-subversion", "0".into()),
                    ("rank", rank.to_string()),
                    ("size", job.size.to_string()),
                    ("appnum", "0".into()),
                    ("debugged", "FALSE".into()),
                    ("pmiverbose", "FALSE".into()),
                ],
            )],
            "get_maxes" => vec![self.reply(
                local,
                cmd,
                "maxes",
                &[
                    ("kvsname_max", KVSNAME_MAX.to_string()),
                    ("keylen_max", KEYLEN_MAX.to_string()),
                    ("vallen_max", VALLEN_MAX.to_string()),
                ],
            )],
            "get_universe_size" => vec![self.reply(local, cmd, "universe_size", &[("size", job.size.to_string())])],
            "get_appnum" => vec![self.reply(local, cmd, "appnum", &[("appnum", "0".into())])],
            "get_my_kvsname" => vec![self.reply(local, cmd, "my_kvsname", &[("kvsname", job.kvsname.clone())])],
            "job-getid" => vec![self.reply(local, cmd, "job-getid-response", &[("jobid", job.kvsname.clone())])],
            "put" | "kvs-put" => self.put(local, cmd),
            "get" | "kvs-get" | "info-getjobattr" => {
                let name = match cmd.name.as_str() {
                    "get" => "get_result",
                    "kvs-get" => "kvs-get-response",
                    _ => "info-getjobattr-response",
                };
                let key = cmd.get("key").unwrap_or_default();
                let found = self.kvs.get(key).or_else(|| self.pending.get(key)).cloned();
                let args = match found {
                    Some(v) => vec![("found", "TRUE".to_string()), ("value", v)],
                    None => vec![("found", "FALSE".to_string())],
                };
                vec![self.reply(local, cmd, name, &args)]
            }
            "info-putnodeattr" => match (cmd.get("key"), cmd.get("value")) {
                (Some(k), Some(v))
                    if k.len() <= KEYLEN_MAX
                        && v.len() <= VALLEN_MAX
                        && ![k, v].iter().any(|t| t.contains(['\n', '\r', '\0'])) =>
                {
                    if self.node_attrs.len() >= MAX_PENDING && !self.node_attrs.contains_key(k) {
                        return Self::refuse(local, format!("rank {rank} put more than {MAX_PENDING} node attributes"));
                    }
                    self.node_attrs.insert(k.to_string(), v.to_string());
                    let mut out = vec![self.reply(local, cmd, "info-putnodeattr-response", &[])];
                    // The ranks waiting for this attribute get it now.
                    for l in 0..self.attr_waits.len() {
                        if self.attr_waits[l].as_ref().is_some_and(|q| q.get("key") == Some(k))
                            && let Some(q) = self.attr_waits[l].take()
                        {
                            out.push(self.attr_reply(l, &q));
                        }
                    }
                    out
                }
                _ => Self::refuse(
                    local,
                    format!("rank {rank}: info-putnodeattr needs a key and a value within the limits"),
                ),
            },
            "info-getnodeattr" => {
                let known = cmd.get("key").is_some_and(|k| self.node_attrs.contains_key(k));
                if !known && cmd.get("wait") == Some("TRUE") {
                    // Answered when a rank of this pod puts it.
                    self.attr_waits[local] = Some(cmd.clone());
                    return self.stuck();
                }
                vec![self.attr_reply(local, cmd)]
            }
            "barrier_in" | "kvs-fence" => self.enter_fence(local, cmd),
            "finalize" => {
                let name = if self.wire(local) == Wire::V2 { "finalize-response" } else { "finalize_ack" };
                let mut out = vec![self.reply(local, cmd, name, &[])];
                self.done[local] = true;
                out.extend(self.stuck());
                out
            }
            "abort" => {
                // PMI-1: exitcode= (the rank then waits to be killed);
                // PMI-2: isworld= and msg= (Slurm's client exits 1 itself).
                let code = cmd.get("exitcode").and_then(|c| c.parse().ok()).unwrap_or(1);
                let message = ["message", "error_msg", "msg"].iter().find_map(|k| cmd.get(k)).unwrap_or_default();
                vec![Effect::Abort { local, code, why: message.to_string() }]
            }
            // MPI's name service (MPI_Publish_name, MPI_Lookup_name) is not
            // served: the call fails in the rank, which can go on.
            "publish_name" | "unpublish_name" | "lookup_name" | "name-publish" | "name-unpublish" | "name-lookup" => {
                let name = match cmd.name.as_str() {
                    "publish_name" => "publish_result",
                    "unpublish_name" => "unpublish_result",
                    "lookup_name" => "lookup_result",
                    other => return vec![self.error_reply(local, cmd, &format!("{other}-response"))],
                };
                vec![self.error_reply(local, cmd, name)]
            }
            "spawn" => Self::refuse(
                local,
                format!(
                    "rank {rank} called MPI_Comm_spawn: trainlet's PMI starts a fixed set of ranks and cannot spawn more"
                ),
            ),
            other => Self::refuse(local, format!("rank {rank} sent a PMI command trainlet does not serve: {other:?}")),
        }
    }

    fn put(&mut self, local: usize, cmd: &Command) -> Vec<Effect> {
        let rank = self.job.first_rank + u32::try_from(local).unwrap_or(u32::MAX);
        let (Some(key), Some(value)) = (cmd.get("key"), cmd.get("value")) else {
            return Self::refuse(local, format!("rank {rank}: {} without a key or a value", cmd.name));
        };
        if [key, value].iter().any(|t| t.contains(['\n', '\r', '\0'])) {
            return Self::refuse(local, format!("rank {rank} put a key or value with a line break or NUL"));
        }
        if key.len() > KEYLEN_MAX || value.len() > VALLEN_MAX {
            return Self::refuse(
                local,
                format!("rank {rank} put a key over {KEYLEN_MAX} or a value over {VALLEN_MAX} bytes"),
            );
        }
        if self.pending.len() >= MAX_PENDING && !self.pending.contains_key(key) {
            return Self::refuse(
                local,
                format!("rank {rank}: this pod's ranks put more than {MAX_PENDING} keys before a fence"),
            );
        }
        self.pending.insert(key.to_string(), value.to_string());
        let name = if cmd.name == "put" { "put_result" } else { "kvs-put-response" };
        vec![self.reply(local, cmd, name, &[])]
    }

    fn enter_fence(&mut self, local: usize, cmd: &Command) -> Vec<Effect> {
        if self.waiting[local].is_some() {
            return Self::refuse(local, format!("local rank {local} entered a fence twice"));
        }
        self.waiting[local] = Some(cmd.clone());
        if self.fencing || self.waiting.iter().any(Option::is_none) {
            return self.stuck();
        }
        self.fencing = true;
        let puts = std::mem::take(&mut self.pending).into_iter().collect();
        vec![Effect::Fence { puts }]
    }

    /// The job's fence is over: `all` holds every pod's puts. Every local
    /// rank waiting at it is answered.
    pub fn fenced(&mut self, all: Vec<(String, String)>) -> Vec<Effect> {
        self.kvs_bytes += all.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        if self.kvs_bytes > MAX_KVS_BYTES {
            return Self::refuse(0, format!("the job's PMI key-value space outgrew {MAX_KVS_BYTES} bytes"));
        }
        self.kvs.extend(all);
        self.fencing = false;
        let waiting: Vec<(usize, Command)> =
            self.waiting.iter_mut().enumerate().filter_map(|(l, w)| Some((l, w.take()?))).collect();
        waiting
            .into_iter()
            .map(|(l, q)| {
                let name = if q.name == "barrier_in" { "barrier_out" } else { "kvs-fence-response" };
                self.reply(l, &q, name, &[])
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::wire::{parse_v1, parse_v2};
    use super::*;

    fn job(local: usize) -> WorldInfo {
        WorldInfo { kvsname: "kvs_7".into(), size: 4, first_rank: 2, local, mapping: "(vector,(0,2,2))".into() }
    }

    /// The one reply to `cmd`, parsed back.
    fn ask(node: &mut Node, local: usize, line: &str) -> Command {
        let cmd = parse_v1(line.as_bytes()).expect("line");
        match node.handle(local, &cmd).as_slice() {
            [Effect::Reply { local: l, bytes }] if *l == local => parse_v1(bytes).expect("reply"),
            other => panic!("{line}: {other:?}"),
        }
    }

    fn ask2(node: &mut Node, local: usize, body: &str) -> Command {
        let cmd = parse_v2(body.as_bytes()).expect("frame");
        match node.handle(local, &cmd).as_slice() {
            [Effect::Reply { local: l, bytes }] if *l == local => parse_v2(&bytes[6..]).expect("reply"),
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn pmi1_startup_answers_what_mpich_asks() {
        let mut node = Node::new(job(2));
        let r = ask(&mut node, 1, "cmd=init pmi_version=1 pmi_subversion=1");
        assert_eq!((r.name.as_str(), r.get("rc"), r.get("pmi_version")), ("response_to_init", Some("0"), Some("1")));
        let r = ask(&mut node, 1, "cmd=get_maxes");
        assert_eq!((r.get("keylen_max"), r.get("vallen_max")), (Some("64"), Some("1024")));
        assert_eq!(ask(&mut node, 1, "cmd=get_my_kvsname").get("kvsname"), Some("kvs_7"));
        assert_eq!(ask(&mut node, 1, "cmd=get_universe_size").get("size"), Some("4"));
        assert_eq!(ask(&mut node, 1, "cmd=get_appnum").get("appnum"), Some("0"));
        let r = ask(&mut node, 0, "cmd=get kvsname=kvs_7 key=PMI_process_mapping");
        assert_eq!((r.get("found"), r.get("value")), (Some("TRUE"), Some("(vector,(0,2,2))")));
        assert_eq!(ask(&mut node, 0, "cmd=get kvsname=kvs_7 key=nothing").get("found"), Some("FALSE"));
        assert_eq!(ask(&mut node, 0, "cmd=finalize").name, "finalize_ack");
    }

    #[test]
    fn a_fence_waits_for_every_local_rank_publishes_once_and_answers_each_in_its_wire() {
        let mut node = Node::new(job(2));
        // Rank 0 speaks PMI-1, rank 1 PMI-2.
        assert_eq!(ask(&mut node, 1, "cmd=init pmi_version=2 pmi_subversion=0").get("pmi_version"), Some("2"));
        assert_eq!(node.wire(1), Wire::V2);
        let r = ask2(&mut node, 1, "cmd=fullinit;pmirank=3;threaded=FALSE;");
        assert_eq!((r.name.as_str(), r.get("rank"), r.get("size")), ("fullinit-response", Some("3"), Some("4")));
        assert_eq!(ask(&mut node, 0, "cmd=put kvsname=kvs_7 key=card-2 value=a\\ b").name, "put_result");
        assert_eq!(ask2(&mut node, 1, "cmd=kvs-put;key=card-3;value=c;").name, "kvs-put-response");
        let fence = parse_v1(b"cmd=barrier_in").expect("line");
        assert_eq!(node.handle(0, &fence), Vec::new(), "rank 1 is not at the fence yet");
        let fence2 = parse_v2(b"cmd=kvs-fence;thrid=0x1;").expect("frame");
        let effects = node.handle(1, &fence2);
        assert_eq!(
            effects,
            vec![Effect::Fence { puts: vec![("card-2".into(), "a b".into()), ("card-3".into(), "c".into())] }]
        );
        let replies = node.fenced(vec![("card-0".into(), "x".into()), ("card-2".into(), "a b".into())]);
        let [Effect::Reply { local: 0, bytes: b0 }, Effect::Reply { local: 1, bytes: b1 }] = replies.as_slice() else {
            panic!("{replies:?}")
        };
        assert_eq!(parse_v1(b0).expect("line").name, "barrier_out");
        let r1 = parse_v2(&b1[6..]).expect("frame");
        assert_eq!((r1.name.as_str(), r1.get("thrid")), ("kvs-fence-response", Some("0x1")));
        let r = ask2(&mut node, 1, "cmd=kvs-get;jobid=kvs_7;srcid=-1;key=card-0;");
        assert_eq!((r.get("found"), r.get("value")), (Some("TRUE"), Some("x")));
        // The next fence starts empty.
        node.handle(0, &fence);
        assert_eq!(node.handle(1, &fence2), vec![Effect::Fence { puts: Vec::new() }]);
    }

    /// A fence needs every local rank: one that finalized or closed its
    /// socket leaves the others waiting forever, so they are refused; one
    /// still free (starting up) may yet come.
    #[test]
    fn a_fence_no_rank_can_complete_is_refused() {
        let fence = parse_v1(b"cmd=barrier_in").expect("line");
        let fin = parse_v1(b"cmd=finalize").expect("line");
        let mut node = Node::new(job(2));
        assert_eq!(node.handle(1, &fence), Vec::new(), "rank 0 may still come");
        let effects = node.handle(0, &fin);
        assert!(
            matches!(effects.as_slice(), [Effect::Reply { .. }, Effect::Refuse { local: 1, why }] if why.contains("[0]")),
            "{effects:?}"
        );
        let mut node = Node::new(job(2));
        assert_eq!(node.handle(1, &fence), Vec::new());
        assert!(matches!(node.closed(0).as_slice(), [Effect::Refuse { local: 1, .. }]));
        let mut node = Node::new(job(2));
        assert_eq!(node.closed(0), Vec::new(), "nobody waits");
        let wait = parse_v2(b"cmd=info-getnodeattr;key=never;wait=TRUE;").expect("frame");
        ask(&mut node, 1, "cmd=init pmi_version=2 pmi_subversion=0");
        assert!(
            matches!(node.handle(1, &wait).as_slice(), [Effect::Refuse { local: 1, .. }]),
            "nobody is left to put it"
        );
    }

    #[test]
    fn a_put_with_a_line_break_is_refused() {
        let mut node = Node::new(job(1));
        ask(&mut node, 0, "cmd=init pmi_version=2 pmi_subversion=0");
        let put = parse_v2(b"cmd=kvs-put;key=k;value=x\ncmd=barrier_out;").expect("frame");
        assert!(matches!(node.handle(0, &put).as_slice(), [Effect::Refuse { .. }]));
    }

    #[test]
    fn the_name_service_answers_an_error_the_rank_can_go_on_from() {
        let mut node = Node::new(job(1));
        let r = ask(&mut node, 0, "cmd=lookup_name service=ocean");
        assert_eq!((r.name.as_str(), r.get("rc")), ("lookup_result", Some("1")));
        assert_eq!(ask(&mut node, 0, "cmd=get_appnum").get("rc"), Some("0"), "still served");
    }

    /// What Intel MPI over Slurm's `libpmi2` asks on one pod (seen
    /// 2026-11-27): fullinit's reply keys, and a node attribute read with
    /// `wait=TRUE` before another rank has put it.
    #[test]
    fn pmi2_fullinit_and_a_node_attribute_waited_for() {
        let mut node = Node::new(job(2));
        for l in 0..2 {
            ask(&mut node, l, "cmd=init pmi_version=2 pmi_subversion=0");
        }
        let r = ask2(&mut node, 0, "cmd=fullinit;pmijobid=kvs_7;srcid=2;threaded=FALSE;");
        for (k, v) in
            [("pmi-version", "2"), ("rank", "2"), ("appnum", "0"), ("debugged", "FALSE"), ("pmiverbose", "FALSE")]
        {
            assert_eq!(r.get(k), Some(v), "{k}");
        }
        assert_eq!(r.get("spawner-jobid"), None, "its presence would mean a spawned job");
        let wait = parse_v2(b"cmd=info-getnodeattr;key=-bcast-1-0;wait=TRUE;").expect("frame");
        assert_eq!(node.handle(1, &wait), Vec::new(), "held until the key is put");
        let put = parse_v2(b"cmd=info-putnodeattr;key=-bcast-1-0;value=2F6465;").expect("frame");
        let effects = node.handle(0, &put);
        let [Effect::Reply { local: 0, .. }, Effect::Reply { local: 1, bytes }] = effects.as_slice() else {
            panic!("{effects:?}")
        };
        let r = parse_v2(&bytes[6..]).expect("reply");
        assert_eq!(
            (r.name.as_str(), r.get("found"), r.get("value")),
            ("info-getnodeattr-response", Some("TRUE"), Some("2F6465"))
        );
        let r = ask2(&mut node, 1, "cmd=info-getnodeattr;key=other;");
        assert_eq!(r.get("found"), Some("FALSE"), "without wait: answered at once");
        let abort =
            parse_v2(b"cmd=abort;isworld=TRUE;msg=application called MPI_Abort(MPI_COMM_WORLD, 3);").expect("frame");
        assert!(
            matches!(node.handle(1, &abort).as_slice(), [Effect::Abort { local: 1, code: 1, why }] if why.contains("MPI_Abort"))
        );
    }

    #[test]
    fn abort_spawn_and_protocol_faults_stop_the_job_with_a_reason() {
        let mut node = Node::new(job(1));
        let abort = parse_v1(b"cmd=abort exitcode=3 message=bad\\ input").expect("line");
        assert_eq!(node.handle(0, &abort), vec![Effect::Abort { local: 0, code: 3, why: "bad input".into() }]);
        let spawn = parse_v1(b"mcmd=spawn").expect("line");
        assert!(
            matches!(node.handle(0, &spawn).as_slice(), [Effect::Refuse { why, .. }] if why.contains("MPI_Comm_spawn"))
        );
        let long = Command::new("put").arg("key", "k").arg("value", "v".repeat(VALLEN_MAX + 1));
        assert!(matches!(node.handle(0, &long).as_slice(), [Effect::Refuse { .. }]));
        let fence = parse_v1(b"cmd=barrier_in").expect("line");
        let mut two = Node::new(job(2));
        assert!(two.handle(0, &fence).is_empty());
        assert!(matches!(two.handle(0, &fence).as_slice(), [Effect::Refuse { why, .. }] if why.contains("twice")));
        assert!(matches!(node.handle(5, &fence).as_slice(), [Effect::Refuse { .. }]));
        let unknown = parse_v1(b"cmd=frobnicate").expect("line");
        assert!(
            matches!(node.handle(0, &unknown).as_slice(), [Effect::Refuse { why, .. }] if why.contains("frobnicate"))
        );
    }
}
