//! A submitted run, checked: `POST /v1/runs`'s JSON into the [`Run`]
//! every pod reads from the store, and the files it carries into
//! content-addressed blobs. Pure (no I/O): every refusal is a message that
//! names the field and what it should have been.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

pub use super::paths::{MAX_FILES, MAX_FILES_BYTES, check_path, shown};
pub use super::tar::Room;
/// Most words in command + args, and most env entries.
const MAX_WORDS: usize = 4096;
/// Longest word, or variable (`NAME=value`): what the kernel lets one
/// string of a command line or environment hold (MAX_ARG_STRLEN, 32
/// pages, with its NUL byte).
const MAX_WORD: usize = 128 * 1024 - 1;
/// Most bytes a run's command and variables, and apart from them the setup
/// steps' variables (with a pip step's arguments), may take of a worker's
/// `execve` (each string with its NUL and its 8-byte pointer, as the kernel
/// counts them against `ARG_MAX`). Linux's `ARG_MAX` is a quarter of the
/// stack limit, 2 MiB with the usual 8 MiB: the two shares leave 512 KiB
/// for the pod's own environment and what trainlet adds.
pub const EXEC_ROOM: usize = 768 * 1024;

/// What strings of these lengths take of an `execve`'s `ARG_MAX`.
pub fn exec_size(lengths: impl IntoIterator<Item = usize>) -> usize {
    lengths.into_iter().map(|n| n.saturating_add(1 + 8)).fold(0, usize::saturating_add)
}

/// Most workers per pod a run may ask for.
const MAX_NPROC: u32 = 1024;
/// Most restarts a run may ask for.
const MAX_RESTARTS: u32 = 10_000;

/// Variables trainlet sets for every worker: a run may not set them.
const RESERVED: &[&str] = &[
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
];
/// Prefixes of variables trainlet owns.
const RESERVED_PREFIXES: &[&str] = &["TORCHELASTIC_", "TRAINLET_", "KUBEFLOW_TRAINER_SERVER_"];

/// `POST /v1/runs`'s JSON body. Every list and map stops at its cap while
/// it is parsed ([`super::bounded`]), and an actor's arguments stay text:
/// what a body parses into is bounded by those caps and its own bytes.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submit {
    /// The program and its first arguments, e.g. `["python", "train.py"]`
    /// (none for an actor: trainlet's actor runtime is the program).
    #[serde(default, deserialize_with = "words")]
    pub command: Vec<String>,
    /// More arguments.
    #[serde(default, deserialize_with = "words")]
    pub args: Vec<String>,
    /// Variables for the workers.
    #[serde(default, deserialize_with = "variables")]
    pub env: BTreeMap<String, String>,
    /// Workers per pod (default: the pod's).
    #[serde(default)]
    pub nproc_per_node: Option<u32>,
    /// Restarts this run may use (default: the pod's `--max-restarts`).
    #[serde(default)]
    pub max_restarts: Option<u32>,
    /// Relative path -> base64 content.
    #[serde(default, deserialize_with = "file_map")]
    pub files: BTreeMap<String, String>,
    /// Stop a running run and start this one instead (else 409).
    #[serde(default)]
    pub replace: bool,
    /// An actor instead of a command (`POST /v1/actors`).
    #[serde(default)]
    pub actor: Option<ActorSubmit>,
}

fn words<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    super::bounded::seq(d, MAX_WORDS, "words")
}

fn variables<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    super::bounded::map(d, MAX_WORDS, "variables")
}

fn file_map<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    super::bounded::map(d, MAX_FILES, "files")
}

/// `POST /v1/actors`'s `actor`: what every worker instantiates.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActorSubmit {
    /// `package.module:Name`: a class (instantiated once per worker) or a
    /// function (a one-method actor, called as `__call__`).
    pub target: String,
    /// Positional arguments of `Name(...)`, a JSON list, kept as sent.
    #[serde(default)]
    pub args: Option<Box<RawValue>>,
    /// Keyword arguments, a JSON object, kept as sent.
    #[serde(default)]
    pub kwargs: Option<Box<RawValue>>,
    /// `(args, kwargs)` pickled and base64-encoded, instead of `args` and
    /// `kwargs` (the workers unpickle it: only for drivers they trust).
    #[serde(default)]
    pub pickle: Option<String>,
    /// What a fault restarts: every rank (the default), or only the
    /// missing ones ([`Restart::Survivors`]).
    #[serde(default)]
    pub restart: Restart,
}

/// What a worker's death or a lost pod restarts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Restart {
    /// Every rank is stopped and instantiated again.
    #[default]
    All,
    /// The live workers keep their processes and state: they leave the
    /// process group, take the new round's rank and world, and meet the
    /// fresh ranks in a new group (the runtime's `reconfigure`).
    Survivors,
}

/// How arguments and results travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// JSON text.
    Json,
    /// base64 of a pickle.
    Pickle,
}

/// An actor as every pod reads it (in its [`Run`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Actor {
    /// `package.module:Name`.
    pub target: String,
    /// How `init` is encoded.
    pub encoding: Encoding,
    /// `{"args": [...], "kwargs": {...}}` (JSON), or base64 of the pickled
    /// `(args, kwargs)`.
    pub init: String,
    /// What a fault restarts.
    #[serde(default)]
    pub restart: Restart,
}

/// One file of a run, by content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRef {
    /// Relative path in the run's directory.
    pub path: String,
    /// Lower-case hex SHA-256 of its content.
    pub sha256: String,
    /// Its length.
    pub size: u64,
}

/// A run as every pod reads it from the store (`serve/run`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    /// `run-<seq>-<random>`.
    pub id: String,
    /// 1, 2, ... in submission order.
    pub seq: u64,
    /// Program and arguments (`args` appended).
    pub command: Vec<String>,
    /// Variables for the workers.
    pub env: Vec<(String, String)>,
    /// Workers per pod, when the run sets it.
    pub nproc: Option<u32>,
    /// Restarts it may use.
    pub max_restarts: u32,
    /// The job-wide restart count when it was submitted: its own restarts
    /// are counted from there.
    pub base_restarts: u32,
    /// Its files.
    pub files: Vec<FileRef>,
    /// The actor it serves, when it is one (`command` is then only shown).
    #[serde(default)]
    pub actor: Option<Actor>,
    /// Its first worker slot on every pod (its workers take the pod's
    /// slots `first_slot..first_slot + nproc`, and the GPUs of those slots).
    #[serde(default)]
    pub first_slot: u32,
    /// It runs in a lane of its own beside the pods' main run
    /// (`crate::serve::lane`): its own agents, rounds and process group.
    #[serde(default)]
    pub lane: bool,
}

/// A checked submission: the run less its identity, and the blobs to store.
#[derive(Debug)]
pub struct Checked {
    /// Command with args appended.
    pub command: Vec<String>,
    /// Variables.
    pub env: Vec<(String, String)>,
    /// Workers per pod.
    pub nproc: Option<u32>,
    /// Restarts (None: the pod's default).
    pub max_restarts: Option<u32>,
    /// Files by content.
    pub files: Vec<FileRef>,
    /// Distinct contents by SHA-256.
    pub blobs: BTreeMap<String, Vec<u8>>,
    /// Replace a running run.
    pub replace: bool,
    /// The actor, when it is one.
    pub actor: Option<Actor>,
}

/// Hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    data_encoding::HEXLOWER.encode(ring::digest::digest(&ring::digest::SHA256, data).as_ref())
}

/// Parse and check a submission sent as a tar (or tar.gz) body of its
/// files, with the JSON (without `files`) in a header.
pub fn check_archive(json: &str, body: &[u8], room: Room<'_>) -> Result<Checked, String> {
    let s: Submit = serde_json::from_str(json).map_err(|e| format!("X-Trainlet-Run is not a valid run: {e}"))?;
    if !s.files.is_empty() {
        return Err("X-Trainlet-Run: give the files in the archive, not in \"files\"".into());
    }
    let files = super::tar::files(body, room)?;
    checked(s, files)
}

/// Parse and check a JSON submission; each file's bytes are asked of
/// `room` before they are decoded.
pub fn check(body: &[u8], room: Room<'_>) -> Result<Checked, String> {
    let mut s: Submit = serde_json::from_slice(body).map_err(|e| format!("the body is not a valid run: {e}"))?;
    let mut files = Vec::new();
    // Each file's base64 is dropped once decoded: the body, its text and
    // its bytes are never all held at once.
    for (path, b64) in std::mem::take(&mut s.files) {
        room(data_encoding::BASE64.decode_len(b64.len()).unwrap_or(b64.len()))?;
        let data = data_encoding::BASE64
            .decode(b64.as_bytes())
            .map_err(|e| format!("files[{}]: not base64 ({e})", shown(&path)))?;
        drop(b64);
        files.push((path, data));
    }
    checked(s, files)
}

/// Check a submission's JSON with its files (from the JSON or the archive).
fn checked(s: Submit, files: Vec<(String, Vec<u8>)>) -> Result<Checked, String> {
    let actor = s.actor.map(check_actor).transpose()?;
    let mut c = check_parts(
        command_of(s.command, actor.as_ref()),
        s.args,
        s.env,
        (s.nproc_per_node, s.max_restarts),
        files,
        s.replace,
    )?;
    c.actor = actor;
    Ok(c)
}

/// Why `k` cannot be a variable a client gives the workers (a bad name,
/// or one trainlet sets), if it cannot.
pub(crate) fn env_name_refused(k: &str) -> Option<String> {
    let name_ok = !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !name_ok {
        return Some(format!("{} is not a variable name (letters, digits and _)", shown(k)));
    }
    if RESERVED.contains(&k) || RESERVED_PREFIXES.iter().any(|p| k.starts_with(p)) {
        return Some(format!("{k} is set by trainlet for every worker and cannot be overridden"));
    }
    None
}

/// Why a submission does not belong where it was sent (`POST /v1/actors`
/// when `actor`, else `POST /v1/runs`), if it does not.
pub fn misrouted(c: &Checked, actor: bool, serves_actors: bool) -> Option<&'static str> {
    match (c.actor.is_some(), actor) {
        (false, true) => Some("an actor needs \"actor\": {\"target\": \"package.module:Name\", ...}"),
        (true, false) => Some("a run with \"actor\" goes to POST /v1/actors"),
        (true, true) if !serves_actors => Some("this control API serves no actors"),
        _ => None,
    }
}

/// The command a run shows: an actor's is trainlet's runtime and its target.
fn command_of(command: Vec<String>, actor: Option<&Actor>) -> Vec<String> {
    match actor {
        Some(a) if command.is_empty() => vec!["python".into(), "-m".into(), "trainlet-actor".into(), a.target.clone()],
        _ => command,
    }
}

/// Most bytes of an actor's target, and of its encoded init arguments.
const MAX_TARGET: usize = 512;
/// Most bytes of an actor's encoded init arguments (the run, files' list
/// and all, is one store value of 8 MiB at most).
pub const MAX_INIT: usize = 4 * 1024 * 1024;

/// A dotted Python name: identifiers separated by `.`.
fn dotted(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|p| {
            !p.is_empty()
                && !p.starts_with(|c: char| c.is_ascii_digit())
                && p.chars().all(|c| c.is_alphanumeric() || c == '_')
        })
}

/// Check an actor's target and init arguments.
pub fn check_actor(a: ActorSubmit) -> Result<Actor, String> {
    let target_ok =
        a.target.len() <= MAX_TARGET && a.target.split_once(':').is_some_and(|(m, n)| dotted(m) && dotted(n));
    if !target_ok {
        return Err(format!(
            "actor.target: {} is not `package.module:Name` (a module to import and a class or function in it)",
            shown(&a.target)
        ));
    }
    let (args, kwargs) = (a.args.as_deref(), a.kwargs.as_deref());
    // Refused for its size before the arguments are copied.
    let size = a.pickle.as_ref().map_or_else(|| super::bounded::encoded_len(args, kwargs), String::len);
    if size > MAX_INIT {
        return Err(format!("actor: the init arguments are {size} bytes encoded, at most {MAX_INIT}"));
    }
    let (encoding, init) = match a.pickle {
        Some(p) if super::bounded::empty(args) && super::bounded::empty(kwargs) => {
            data_encoding::BASE64.decode(p.as_bytes()).map_err(|e| format!("actor.pickle: not base64 ({e})"))?;
            (Encoding::Pickle, p)
        }
        Some(_) => return Err("actor: give either pickle or args/kwargs, not both".into()),
        None => (Encoding::Json, super::bounded::arguments(args, kwargs, "actor.")?),
    };
    Ok(Actor { target: a.target, encoding, init, restart: a.restart })
}

/// Check the parts of a submission (the JSON's, or a tar's files).
pub fn check_parts(
    mut command: Vec<String>,
    args: Vec<String>,
    env: BTreeMap<String, String>,
    (nproc, max_restarts): (Option<u32>, Option<u32>),
    files: Vec<(String, Vec<u8>)>,
    replace: bool,
) -> Result<Checked, String> {
    if command.is_empty() || command[0].is_empty() {
        return Err("command: must name a program, e.g. [\"python\", \"train.py\"]".into());
    }
    command.extend(args);
    if command.len() > MAX_WORDS {
        return Err(format!("command and args: {} words, at most {MAX_WORDS}", command.len()));
    }
    for (i, w) in command.iter().enumerate() {
        if w.contains('\0') || w.len() > MAX_WORD {
            return Err(format!("command word {i}: holds a NUL byte or is longer than {MAX_WORD} bytes"));
        }
    }
    if env.len() > MAX_WORDS {
        return Err(format!("env: {} variables, at most {MAX_WORDS}", env.len()));
    }
    for (k, v) in &env {
        if let Some(why) = env_name_refused(k) {
            return Err(format!("env: {why}"));
        }
        if v.contains('\0') || k.len() + 1 + v.len() > MAX_WORD {
            return Err(format!("env: {k} holds a NUL byte or, as {k}=value, is longer than {MAX_WORD} bytes"));
        }
    }
    let exec = exec_size(command.iter().map(String::len).chain(env.iter().map(|(k, v)| k.len() + 1 + v.len())));
    if exec > EXEC_ROOM {
        return Err(format!(
            "command, args and env: {exec} bytes of a worker's command line and environment (each string with its NUL and pointer), at most {EXEC_ROOM} (the kernel's ARG_MAX is 2 MiB with an 8 MiB stack, shared with the pod's own variables and the setup steps'); put large values in a file"
        ));
    }
    if let Some(n) = nproc.filter(|n| *n == 0 || *n > MAX_NPROC) {
        return Err(format!("nproc_per_node: {n}, must be 1-{MAX_NPROC}"));
    }
    if let Some(n) = max_restarts.filter(|n| *n > MAX_RESTARTS) {
        return Err(format!("max_restarts: {n}, at most {MAX_RESTARTS}"));
    }
    if files.len() > MAX_FILES {
        return Err(format!("files: {} files, at most {MAX_FILES}", files.len()));
    }
    let total: usize = files.iter().map(|(_, d)| d.len()).sum();
    if total > MAX_FILES_BYTES {
        return Err(format!("files: {total} bytes in all, at most {MAX_FILES_BYTES}"));
    }
    let mut refs = Vec::new();
    let mut blobs = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    for (path, data) in files {
        check_path(&path)?;
        // A file and a directory of the same name cannot both be made.
        for (i, _) in path.match_indices('/') {
            if seen.contains(&path[..i]) {
                return Err(format!("files: {} is both a file and a directory", shown(&path[..i])));
            }
        }
        if !seen.insert(path.clone()) {
            return Err(format!("files: {} given twice", shown(&path)));
        }
        let sha256 = sha256_hex(&data);
        refs.push(FileRef { path, sha256: sha256.clone(), size: data.len() as u64 });
        blobs.entry(sha256).or_insert(data);
    }
    if let Some(dir) = refs.iter().find(|r| seen.iter().any(|s| s.starts_with(&format!("{}/", r.path)))) {
        return Err(format!("files: {} is both a file and a directory", shown(&dir.path)));
    }
    Ok(Checked {
        command,
        env: env.into_iter().collect(),
        nproc,
        max_restarts,
        files: refs,
        blobs,
        replace,
        actor: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        check(body.as_bytes(), &mut |_| Ok(())).expect_err("refused")
    }

    #[test]
    fn a_run_carries_its_files_by_content() {
        let b64 = data_encoding::BASE64.encode(b"print(1)\n");
        let mut asked = Vec::new();
        let c = check(
            format!(
                r#"{{"command": ["python", "train.py"], "args": ["--lr", "0.1"], "env": {{"A": "1"}},
                   "nproc_per_node": 2, "files": {{"train.py": "{b64}", "lib/util.py": "{b64}"}}}}"#
            )
            .as_bytes(),
            &mut |n| {
                asked.push(n);
                Ok(())
            },
        )
        .expect("ok");
        assert_eq!(asked, [9, 9], "each file's bytes asked for before they are decoded");
        assert_eq!(c.command, ["python", "train.py", "--lr", "0.1"]);
        assert_eq!(c.env, [("A".to_string(), "1".to_string())]);
        assert_eq!((c.nproc, c.max_restarts, c.replace), (Some(2), None, false));
        assert_eq!(c.files.len(), 2);
        assert_eq!(c.blobs.len(), 1, "one content, one blob");
        assert_eq!(c.files[0].sha256, sha256_hex(b"print(1)\n"));
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            "FIPS 180-2's example"
        );
    }

    #[test]
    fn bad_submissions_name_what_was_wrong() {
        // Seven arguments of 120 KiB: past a run's share of a worker's exec.
        let arg = "x".repeat(120 * 1024);
        let too_long = format!(r#"{{"command": ["python"], "args": [{}]}}"#, vec![format!(r#""{arg}""#); 7].join(", "));
        // One argument of 128 KiB: with its NUL past what one string of an
        // exec may hold.
        let edge = format!(r#"{{"command": ["python"], "args": ["{}"]}}"#, "x".repeat(128 * 1024));
        let var = format!(r#"{{"command": ["python"], "env": {{"K": "{}"}}}}"#, "x".repeat(128 * 1024 - 2));
        for (body, want) in [
            (edge.as_str(), "longer than 131071 bytes"),
            (var.as_str(), "as K=value, is longer than 131071 bytes"),
            ("{", "not a valid run"),
            (r#"{"command": []}"#, "command: must name a program"),
            (r#"{"command": ["python"], "bogus": 1}"#, "unknown field `bogus`"),
            (r#"{"command": ["python"], "env": {"RANK": "3"}}"#, "RANK is set by trainlet"),
            (r#"{"command": ["python"], "env": {"TORCHELASTIC_X": "3"}}"#, "TORCHELASTIC_X is set by trainlet"),
            (r#"{"command": ["python"], "env": {"A=B": "3"}}"#, "is not a variable name"),
            (r#"{"command": ["python"], "nproc_per_node": 0}"#, "nproc_per_node: 0"),
            (r#"{"command": ["python"], "files": {"a.py": "%%%"}}"#, "not base64"),
            (r#"{"command": ["python"], "files": {"../etc/passwd": ""}}"#, "stay inside"),
            (r#"{"command": ["python"], "files": {"/etc/passwd": ""}}"#, "absolute"),
            (r#"{"command": ["python"], "files": {"a//b": ""}}"#, "empty"),
            (r#"{"command": ["python"], "files": {"a\\b": ""}}"#, "backslash"),
            (r#"{"command": ["python"], "files": {"a": "", "a/b": ""}}"#, "both a file and a directory"),
            (too_long.as_str(), "at most 786432"),
        ] {
            let e = err(body);
            assert!(e.contains(want), "{body}: {e}");
        }
        assert!(check_path("data/x.py").is_ok());
        assert!(shown("a\nb\u{1b}[31m").contains("\\n") && !shown("\u{1b}").contains('\u{1b}'));
    }
}
