//! The token a guarded store asks of every connection (serve mode's
//! agents' store): a challenge and response on the TCPStore wire, so that
//! nothing without the control token reads, writes or deletes a key.
//!
//! After VALIDATE the client sends `AUTH(client nonce)`; the server answers
//! its own nonce and its proof, `HMAC(k, "store" | cn | sn)`; the client
//! checks it and sends `AUTH(HMAC(k, "agent" | cn | sn))`; the server
//! answers one byte, 1 (admitted) or 0 (refused, then closed). The key `k`
//! is `HMAC(token, DOMAIN)`, the token read from its file at each
//! handshake (a rotated Secret takes effect for new connections). Nonces
//! are 32 random bytes, so a recorded handshake is worth nothing on
//! another connection. The channel is not encrypted: the control API is
//! plain HTTP too, and a peer that can read pod traffic reads the token
//! there (README, serve mode's threat model).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ring::rand::SecureRandom;

/// Separates this key from every other use of the token (the run seals).
const DOMAIN: &[u8] = b"trainlet agents' store v1";
/// Bytes of a nonce and of a proof.
pub const NONCE_LEN: usize = 32;

/// Why the token cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// The file cannot be read.
    #[error("cannot read the control token {path}")]
    Read {
        /// The token file.
        path: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The file is empty.
    #[error("the control token file {0} is empty")]
    Empty(String),
    /// No randomness for a nonce.
    #[error("the system's random generator failed")]
    Random,
}

/// The control token's file, shared by a guarded store and its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    file: Arc<PathBuf>,
}

/// One side's secret for one handshake.
#[derive(Debug)]
pub struct Key(ring::hmac::Key);

impl Guard {
    /// The token in `file` guards the store.
    pub fn new(file: &Path) -> Self {
        Self { file: Arc::new(file.to_path_buf()) }
    }

    /// The token file.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// The handshake key, from the token as the file holds it now.
    pub fn key(&self) -> Result<Key, GuardError> {
        let shown = self.file.display().to_string();
        let raw =
            std::fs::read_to_string(&*self.file).map_err(|source| GuardError::Read { path: shown.clone(), source })?;
        let token = raw.trim();
        if token.is_empty() {
            return Err(GuardError::Empty(shown));
        }
        let outer = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.as_bytes());
        let k = ring::hmac::sign(&outer, DOMAIN);
        Ok(Key(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, k.as_ref())))
    }
}

impl Key {
    /// `who`'s proof for the nonces `cn` (client) and `sn` (server).
    pub fn proof(&self, who: &[u8], cn: &[u8], sn: &[u8]) -> Vec<u8> {
        ring::hmac::sign(&self.0, &message(who, cn, sn)).as_ref().to_vec()
    }

    /// Is `proof` `who`'s proof for these nonces (constant time)?
    pub fn verify(&self, who: &[u8], cn: &[u8], sn: &[u8], proof: &[u8]) -> bool {
        ring::hmac::verify(&self.0, &message(who, cn, sn), proof).is_ok()
    }
}

fn message(who: &[u8], cn: &[u8], sn: &[u8]) -> Vec<u8> {
    [who, b"|", cn, b"|", sn].concat()
}

/// A fresh nonce.
pub fn nonce() -> Result<[u8; NONCE_LEN], GuardError> {
    let mut n = [0u8; NONCE_LEN];
    ring::rand::SystemRandom::new().fill(&mut n).map_err(|_| GuardError::Random)?;
    Ok(n)
}

/// The proof's labels.
pub const STORE: &[u8] = b"store";
/// See [`STORE`].
pub const AGENT: &[u8] = b"agent";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_need_the_token_and_both_nonces() {
        let dir = tempfile::tempdir().expect("tmp");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, "s3cret\n").expect("a");
        std::fs::write(&b, "other").expect("b");
        let (ka, kb) = (Guard::new(&a).key().expect("a"), Guard::new(&b).key().expect("b"));
        let (cn, sn) = (nonce().expect("n"), nonce().expect("n"));
        let p = ka.proof(AGENT, &cn, &sn);
        assert!(ka.verify(AGENT, &cn, &sn, &p));
        assert!(!kb.verify(AGENT, &cn, &sn, &p), "another token");
        assert!(!ka.verify(STORE, &cn, &sn, &p), "the other side's label");
        assert!(!ka.verify(AGENT, &sn, &cn, &p), "nonces swapped");
        assert!(!ka.verify(AGENT, &cn, &nonce().expect("n"), &p), "another connection's nonce");
        std::fs::write(&a, "  \n").expect("empty");
        assert!(matches!(Guard::new(&a).key(), Err(GuardError::Empty(_))));
        assert!(matches!(Guard::new(&dir.path().join("none")).key(), Err(GuardError::Read { .. })));
    }

    #[tokio::test]
    async fn a_guarded_store_serves_only_clients_with_its_token() {
        use crate::store::{Budget, Client, ClientError, StoreServer};
        let dir = tempfile::tempdir().expect("tmp");
        let (good, bad) = (dir.path().join("good"), dir.path().join("bad"));
        std::fs::write(&good, "s3cret").expect("good");
        std::fs::write(&bad, "other").expect("bad");
        let cancel = tokio_util::sync::CancellationToken::new();
        let serve = |guard: Option<Guard>| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.set_nonblocking(true).expect("nonblocking");
            let l = tokio::net::TcpListener::from_std(l).expect("listener");
            StoreServer::start_guarded(l, Arc::new(Budget::new(64 << 20)), guard, cancel.child_token()).expect("serve")
        };
        let guarded = serve(Some(Guard::new(&good)));
        let addr = guarded.local_addr();
        let mut c = Client::connect_guarded(addr, Some(&Guard::new(&good))).await.expect("admitted");
        c.set("k", b"v").await.expect("set");
        assert_eq!(c.get("k").await.expect("get"), b"v");
        let refused = Client::connect_guarded(addr, Some(&Guard::new(&bad))).await.expect_err("another token");
        assert!(matches!(&refused, ClientError::Refused(m) if m.contains("could not prove")), "{refused:?}");
        assert!(Client::connect(addr).await.is_err(), "a client without a token is closed at its PING");
        let plain = serve(None);
        let e = Client::connect_guarded(plain.local_addr(), Some(&Guard::new(&good))).await.expect_err("unguarded");
        assert!(matches!(&e, ClientError::Refused(m) if m.contains("asks for no token")), "{e:?}");
        // A rotated token admits new connections with the new one only.
        std::fs::write(&good, "rotated").expect("rotate");
        std::fs::write(&bad, "rotated").expect("rotate");
        Client::connect_guarded(addr, Some(&Guard::new(&bad))).await.expect("the rotated token");
        cancel.cancel();
    }
}
