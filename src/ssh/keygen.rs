//! `trainlet keygen`: a job key pair, written to a directory and printed as
//! Kubernetes Secret manifests in the layout Trainer mounts
//! (reference/kubeflow.md 3.1 and 8.9): type `kubernetes.io/ssh-auth`, keys
//! `ssh-privatekey` and `ssh-publickey`, mounted as `id_rsa`, `id_rsa.pub`
//! and `authorized_keys`. The job key then doubles as every worker's host
//! key, as in MPI Operator's images.
//!
//! With `split`, the launcher's client key and the workers' host key are
//! different keys in two Secrets: `<name>-launcher` (client key plus a
//! `known_hosts` pin of the host key) and `<name>-node` (host key plus
//! `authorized_keys`). A worker then holds no key that logs into its peers,
//! which needs a flat launch (`trainlet mpi`'s default).

use std::path::Path;

use data_encoding::BASE64;

use super::keys::{self, HOST_KEY_NAME, KeyError, KeyType};

/// What `trainlet keygen` produced.
#[derive(Debug)]
pub struct Generated {
    /// The Secret manifests (YAML, `---`-separated).
    pub manifest: String,
    /// Files written (when a directory was given).
    pub files: Vec<std::path::PathBuf>,
}

fn secret(name: &str, namespace: Option<&str>, kind: &str, data: &[(&str, &str)]) -> String {
    let mut s = format!("apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n");
    if let Some(ns) = namespace {
        s.push_str(&format!("  namespace: {ns}\n"));
    }
    s.push_str(&format!("type: {kind}\ndata:\n"));
    for (k, v) in data {
        s.push_str(&format!("  {k}: {}\n", BASE64.encode(v.as_bytes())));
    }
    s
}

/// Generate the key(s); write them under `out` when given (private keys
/// 0600); return the manifests.
pub fn generate(
    name: &str,
    namespace: Option<&str>,
    kind: KeyType,
    split: bool,
    out: Option<&Path>,
) -> Result<Generated, KeyError> {
    let client = keys::generate(kind, &format!("{name}-launcher"))?;
    let client_priv = keys::private_text(&client)?;
    let client_pub = keys::public_line(client.public_key())?;
    let mut files = Vec::new();
    let mut write = |dir: &Path, file: &str, text: &str, mode: u32| -> Result<(), KeyError> {
        std::fs::create_dir_all(dir).map_err(|source| KeyError::Write { path: dir.into(), source })?;
        let p = dir.join(file);
        keys::write_file(&p, text, mode)?;
        files.push(p);
        Ok(())
    };
    if !split {
        if let Some(dir) = out {
            write(dir, "id_rsa", &client_priv, 0o600)?;
            write(dir, "id_rsa.pub", &client_pub, 0o644)?;
            write(dir, "authorized_keys", &client_pub, 0o644)?;
        }
        let manifest = secret(
            name,
            namespace,
            "kubernetes.io/ssh-auth",
            &[("ssh-privatekey", &client_priv), ("ssh-publickey", &client_pub)],
        );
        return Ok(Generated { manifest, files });
    }
    let host = keys::generate(kind, &format!("{name}-node"))?;
    let host_priv = keys::private_text(&host)?;
    let host_pub = keys::public_line(host.public_key())?;
    let pin = format!("* {host_pub}");
    if let Some(dir) = out {
        let (l, n) = (dir.join("launcher"), dir.join("node"));
        write(&l, "id_rsa", &client_priv, 0o600)?;
        write(&l, "id_rsa.pub", &client_pub, 0o644)?;
        write(&l, "known_hosts", &pin, 0o644)?;
        write(&n, HOST_KEY_NAME, &host_priv, 0o600)?;
        write(&n, &format!("{HOST_KEY_NAME}.pub"), &host_pub, 0o644)?;
        write(&n, "authorized_keys", &client_pub, 0o644)?;
    }
    let launcher = secret(
        &format!("{name}-launcher"),
        namespace,
        "kubernetes.io/ssh-auth",
        &[("ssh-privatekey", &client_priv), ("ssh-publickey", &client_pub), ("known_hosts", &pin)],
    );
    let node = secret(
        &format!("{name}-node"),
        namespace,
        "Opaque",
        &[(HOST_KEY_NAME, &host_priv), ("ssh_host_key.pub", &host_pub), ("authorized_keys", &client_pub)],
    );
    Ok(Generated { manifest: format!("{launcher}---\n{node}"), files })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trainer_layout_and_split_layout() {
        let dir = tempfile::tempdir().expect("test setup");
        let g = generate("job", Some("ns"), KeyType::EcdsaP521, false, Some(dir.path())).expect("test setup");
        assert!(g.manifest.contains("type: kubernetes.io/ssh-auth\n"));
        assert!(g.manifest.contains("  ssh-privatekey: ") && g.manifest.contains("  ssh-publickey: "));
        assert!(g.manifest.contains("  namespace: ns\n"));
        let key = keys::load_private(&dir.path().join("id_rsa")).expect("test setup");
        let auth = keys::load_authorized(&dir.path().join("authorized_keys")).expect("test setup");
        assert_eq!(auth[0].key_data(), key.public_key().key_data());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("id_rsa")).expect("test setup").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);

        let s = generate("job", None, KeyType::Ed25519, true, Some(dir.path())).expect("test setup");
        assert_eq!(s.manifest.matches("kind: Secret").count(), 2);
        let launcher = dir.path().join("launcher");
        let node = dir.path().join("node");
        assert!(!node.join("id_rsa").exists(), "workers get no client key");
        let client = keys::load_private(&launcher.join("id_rsa")).expect("test setup");
        let (_, host) = keys::load_host_key(&node, None).expect("test setup");
        let pins = keys::Pins::load(&launcher, [client.public_key()], None);
        assert!(pins.accepts("any-worker", 2222, host.public_key()));
        let auth = keys::load_authorized(&node.join("authorized_keys")).expect("test setup");
        assert_eq!(auth[0].key_data(), client.public_key().key_data());
    }
}
