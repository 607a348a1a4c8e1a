//! Key material: where it is mounted, how it is read, which host keys a
//! client pins, and `trainlet keygen`.
//!
//! The layout is the one Trainer and MPI Operator mount (reference/kubeflow.md
//! 3.1 and 8.9; reference/mpi.md 6.1): a directory (`sshAuthMountPath`,
//! default `$HOME/.ssh`, else `/root/.ssh`) with `id_rsa` (an ECDSA P-521 key
//! in SEC1 PEM despite the name), `id_rsa.pub` and `authorized_keys`, modes
//! 0640/0644 and owned by root. OpenSSH-format and PKCS#8 keys of any type
//! are read too. trainlet never insists on file modes (the mounts are
//! read-only and root-owned), which removes OpenSSH's "UNPROTECTED PRIVATE
//! KEY FILE" and "bad ownership or modes" failures.
//!
//! Host keys: the server uses `ssh_host_key` from the directory when present
//! (`trainlet keygen --split`), else the job key itself, as the MPI
//! Operator's images do. A client pins, for any host, the public halves of
//! its own identities and `ssh_host_key.pub` (the job's host keys), plus the
//! entries of a `known_hosts` file that match the host. Nothing is trusted
//! on first use and nothing is ever written.

use std::path::{Path, PathBuf};

use russh::keys::ssh_key::{self, Algorithm, EcdsaCurve, HashAlg, LineEnding, PrivateKey, PublicKey};

/// Why key material could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A private key file did not parse.
    #[error("{path} is not a private key trainlet can read (OpenSSH, SEC1 PEM or PKCS#8, unencrypted)")]
    Private {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        #[source]
        source: russh::keys::Error,
    },
    /// No usable key where one was needed.
    #[error("no {what} found in {dir}: mount the job's SSH Secret there (sshAuthMountPath) or run `trainlet keygen`")]
    Missing {
        /// What was looked for.
        what: &'static str,
        /// Where.
        dir: PathBuf,
    },
    /// A key could not be generated or encoded.
    #[error("cannot encode a key")]
    Encode(#[source] ssh_key::Error),
    /// A file could not be written.
    #[error("cannot write {path}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Identity file names tried in order when no `-i` is given.
pub const IDENTITY_NAMES: [&str; 3] = ["id_ed25519", "id_ecdsa", "id_rsa"];
/// A separate host key in the key directory (`trainlet keygen --split`).
pub const HOST_KEY_NAME: &str = "ssh_host_key";

/// The key directory: `explicit` (flag or env), else `$HOME/.ssh` when it
/// exists, else `/root/.ssh` (Trainer's default sshAuthMountPath).
pub fn key_dir(explicit: Option<&Path>, home: Option<&str>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    if let Some(h) = home.filter(|h| !h.is_empty()) {
        let p = Path::new(h).join(".ssh");
        if p.is_dir() {
            return p;
        }
    }
    PathBuf::from("/root/.ssh")
}

/// Read one private key in any format russh knows.
pub fn load_private(path: &Path) -> Result<PrivateKey, KeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read { path: path.into(), source })?;
    warn_if_world_readable(path);
    russh::keys::decode_secret_key(&text, None).map_err(|source| KeyError::Private { path: path.into(), source })
}

fn warn_if_world_readable(path: &Path) {
    use std::os::unix::fs::MetadataExt;
    if std::fs::metadata(path).is_ok_and(|m| m.mode() & 0o004 != 0) {
        tracing::warn!(path = %path.display(), "private key is world-readable; mount it with mode 0600 or 0640");
    }
}

/// The default identities present in `dir`, in [`IDENTITY_NAMES`] order.
pub fn default_identities(dir: &Path) -> Vec<PathBuf> {
    IDENTITY_NAMES.iter().map(|n| dir.join(n)).filter(|p| p.is_file()).collect()
}

/// SHA256 fingerprint, as OpenSSH prints it.
pub fn fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

/// authorized_keys options that only narrow what a key may do in ways
/// trainlet's server enforces for every key anyway.
const HARMLESS_OPTIONS: [&str; 7] = [
    "restrict",
    "no-pty",
    "no-port-forwarding",
    "no-agent-forwarding",
    "no-x11-forwarding",
    "no-user-rc",
    "no-touch-required",
];

/// Parse authorized_keys text. Keys with options trainlet does not
/// implement (`command=`, `from=`, ...) are left out with a warning rather
/// than accepted without their restriction; unparseable lines are skipped.
pub fn parse_authorized(text: &str, origin: &Path) -> Vec<PublicKey> {
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let entry = match line.parse::<ssh_key::authorized_keys::Entry>() {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(file = %origin.display(), line = n + 1, error = %e, "authorized_keys line skipped");
                continue;
            }
        };
        let unsupported: Vec<&str> = entry
            .config_opts()
            .iter()
            .filter(|o| !HARMLESS_OPTIONS.contains(&o.to_ascii_lowercase().as_str()))
            .collect();
        if unsupported.is_empty() {
            keys.push(entry.public_key().clone());
        } else {
            tracing::warn!(file = %origin.display(), line = n + 1, options = ?unsupported,
                "authorized key left out: trainlet does not implement these restrictions");
        }
    }
    keys
}

/// Read `authorized_keys`; an absent or empty file is an error (the server
/// could let nobody in).
pub fn load_authorized(path: &Path) -> Result<Vec<PublicKey>, KeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read { path: path.into(), source })?;
    let keys = parse_authorized(&text, path);
    if keys.is_empty() {
        let dir = path.parent().unwrap_or(Path::new("/")).to_path_buf();
        return Err(KeyError::Missing { what: "usable key in authorized_keys", dir });
    }
    Ok(keys)
}

/// The server's host key: `explicit`, else `dir/ssh_host_key`, else the
/// first identity in `dir` (the job key doubles as the host key).
pub fn load_host_key(dir: &Path, explicit: Option<&Path>) -> Result<(PathBuf, PrivateKey), KeyError> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let own = dir.join(HOST_KEY_NAME);
            if own.is_file() {
                own
            } else {
                default_identities(dir)
                    .into_iter()
                    .next()
                    .ok_or_else(|| KeyError::Missing { what: "host key (ssh_host_key or id_*)", dir: dir.into() })?
            }
        }
    };
    let key = load_private(&path)?;
    Ok((path, key))
}

/// Host keys a client accepts.
#[derive(Debug, Clone, Default)]
pub struct Pins {
    /// Keys accepted for any host (the job's own keys).
    any: Vec<PublicKey>,
    /// `known_hosts` entries: host patterns and key.
    listed: Vec<(String, PublicKey)>,
}

impl Pins {
    /// The job's pins from `dir` (see the module doc) plus the public
    /// halves of our identities, plus `known_hosts` (`dir/known_hosts`
    /// unless given; `/dev/null` reads as empty).
    pub fn load<'a>(
        dir: &Path,
        identities: impl IntoIterator<Item = &'a PublicKey>,
        known_hosts: Option<&Path>,
    ) -> Self {
        let mut pins = Pins::default();
        pins.any.extend(identities.into_iter().cloned());
        let mut pubs: Vec<PathBuf> = IDENTITY_NAMES.iter().map(|n| dir.join(format!("{n}.pub"))).collect();
        pubs.push(dir.join(format!("{HOST_KEY_NAME}.pub")));
        for p in pubs {
            if let Ok(text) = std::fs::read_to_string(&p) {
                match PublicKey::from_openssh(text.trim()) {
                    Ok(k) => pins.any.push(k),
                    Err(e) => tracing::warn!(file = %p.display(), error = %e, "public key file skipped"),
                }
            }
        }
        let kh = known_hosts.map_or_else(|| dir.join("known_hosts"), Path::to_path_buf);
        if let Ok(text) = std::fs::read_to_string(&kh) {
            pins.listed = parse_known_hosts(&text, &kh);
        }
        pins
    }

    /// Is `key` pinned for `host`:`port`?
    pub fn accepts(&self, host: &str, port: u16, key: &PublicKey) -> bool {
        let same = |k: &PublicKey| k.key_data() == key.key_data();
        self.any.iter().any(same)
            || self.listed.iter().any(|(patterns, k)| same(k) && host_matches(patterns, host, port))
    }
}

/// `known_hosts` lines: `patterns alg base64 [comment]`. Hashed names and
/// `@cert-authority`/`@revoked` markers are skipped with a warning.
fn parse_known_hosts(text: &str, origin: &Path) -> Vec<(String, PublicKey)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((patterns, key)) = line.split_once(char::is_whitespace) else { continue };
        if patterns.starts_with('@') || patterns.starts_with('|') {
            tracing::warn!(file = %origin.display(), line = n + 1, "known_hosts markers and hashed names are not supported; line skipped");
            continue;
        }
        match PublicKey::from_openssh(key.trim()) {
            Ok(k) => out.push((patterns.to_string(), k)),
            Err(e) => tracing::warn!(file = %origin.display(), line = n + 1, error = %e, "known_hosts line skipped"),
        }
    }
    out
}

/// OpenSSH host pattern lists: `a,b,*.job,!bad,[h]:2222`; `*` and `?`
/// wildcards; a negated match wins.
fn host_matches(patterns: &str, host: &str, port: u16) -> bool {
    let name = if port == 22 { host.to_string() } else { format!("[{host}]:{port}") };
    let mut hit = false;
    for p in patterns.split(',') {
        let (neg, p) = p.strip_prefix('!').map_or((false, p), |p| (true, p));
        if glob(p, &name) || (port != 22 && glob(p, host) && !p.starts_with('[')) {
            if neg {
                return false;
            }
            hit = true;
        }
    }
    hit
}

fn glob(pattern: &str, text: &str) -> bool {
    fn go(p: &[u8], t: &[u8]) -> bool {
        match (p.first(), t.first()) {
            (None, None) => true,
            (Some(b'*'), _) => go(&p[1..], t) || (!t.is_empty() && go(p, &t[1..])),
            (Some(b'?'), Some(_)) => go(&p[1..], &t[1..]),
            (Some(a), Some(b)) if a.eq_ignore_ascii_case(b) => go(&p[1..], &t[1..]),
            _ => false,
        }
    }
    go(pattern.as_bytes(), text.as_bytes())
}

/// Key types `trainlet keygen` makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyType {
    /// Ed25519 (the default).
    Ed25519,
    /// ECDSA on P-521, what Trainer and MPI Operator generate.
    EcdsaP521,
}

/// A fresh private key.
pub fn generate(kind: KeyType, comment: &str) -> Result<PrivateKey, KeyError> {
    let alg = match kind {
        KeyType::Ed25519 => Algorithm::Ed25519,
        KeyType::EcdsaP521 => Algorithm::Ecdsa { curve: EcdsaCurve::NistP521 },
    };
    let mut key = PrivateKey::random(&mut rand::rng(), alg).map_err(KeyError::Encode)?;
    key.set_comment(comment);
    Ok(key)
}

/// OpenSSH text of a private key.
pub fn private_text(key: &PrivateKey) -> Result<String, KeyError> {
    key.to_openssh(LineEnding::LF).map(|z| z.to_string()).map_err(KeyError::Encode)
}

/// authorized_keys / `.pub` line of a key, newline-terminated.
pub fn public_line(key: &PublicKey) -> Result<String, KeyError> {
    key.to_openssh().map(|s| s + "\n").map_err(KeyError::Encode)
}

/// Write `text` to `path` with `mode`, replacing any file atomically.
pub fn write_file(path: &Path, text: &str, mode: u32) -> Result<(), KeyError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| KeyError::Write { path: path.into(), source };
    let tmp = path.with_extension("trainlet-tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp).map_err(err)?;
    f.write_all(text.as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorized_keys_options_and_junk() {
        let k = generate(KeyType::Ed25519, "a").expect("test setup");
        let line = public_line(k.public_key()).expect("test setup");
        let text = format!("# comment\n\n{line}no-pty,restrict {line}command=\"/bin/evil\" {line}garbage here\n");
        let keys = parse_authorized(&text, Path::new("ak"));
        assert_eq!(keys.len(), 2, "plain and harmless-option keys in, command= out, junk skipped");
    }

    #[test]
    fn pins_match_hosts_and_ports() {
        let job = generate(KeyType::Ed25519, "job").expect("test setup");
        let other = generate(KeyType::Ed25519, "other").expect("test setup");
        let dir = tempfile::tempdir().expect("test setup");
        let kh = format!(
            "w-*.job,!w-9.job {}[odd]:2200 {}",
            public_line(other.public_key()).expect("test setup"),
            public_line(other.public_key()).expect("test setup")
        );
        std::fs::write(dir.path().join("known_hosts"), kh).expect("test setup");
        let pins = Pins::load(dir.path(), [job.public_key()], None);
        assert!(pins.accepts("anything", 2222, job.public_key()), "the job key is pinned for every host");
        assert!(pins.accepts("w-1.job", 2222, other.public_key()));
        assert!(!pins.accepts("w-9.job", 2222, other.public_key()), "negated pattern");
        assert!(!pins.accepts("x-1.job", 2222, other.public_key()));
        assert!(pins.accepts("odd", 2200, other.public_key()));
        assert!(!pins.accepts("odd", 2201, other.public_key()));
        let devnull = Pins::load(dir.path(), [], Some(Path::new("/dev/null")));
        assert!(
            !devnull.accepts("w-1.job", 2222, other.public_key()),
            "nothing is pinned with no key and an empty list"
        );
    }

    #[test]
    fn generated_keys_round_trip_through_the_reader() {
        let dir = tempfile::tempdir().expect("test setup");
        for kind in [KeyType::Ed25519, KeyType::EcdsaP521] {
            let k = generate(kind, "c").expect("test setup");
            let p = dir.path().join("id");
            write_file(&p, &private_text(&k).expect("test setup"), 0o600).expect("test setup");
            let back = load_private(&p).expect("test setup");
            assert_eq!(back.public_key().key_data(), k.public_key().key_data());
        }
    }

    #[test]
    fn key_dir_precedence() {
        let d = tempfile::tempdir().expect("test setup");
        std::fs::create_dir(d.path().join(".ssh")).expect("test setup");
        let home = d.path().to_str().expect("test setup");
        assert_eq!(key_dir(Some(Path::new("/x")), Some(home)), PathBuf::from("/x"));
        assert_eq!(key_dir(None, Some(home)), d.path().join(".ssh"));
        assert_eq!(key_dir(None, Some("/nonexistent-home")), PathBuf::from("/root/.ssh"));
    }
}
