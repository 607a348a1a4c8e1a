//! The SSH algorithms trainlet offers, as server and as client.
//!
//! OpenSSH's current defaults minus what ssh-audit flags: no
//! encrypt-and-MAC (`hmac-sha2-256`/`-512`: the MAC is computed over the
//! plaintext), no SHA-1 (`ssh-rsa` signatures, `hmac-sha1*`, SHA-1 key
//! exchange), no NIST-curve key exchange and no 2048-bit DH group.
//!
//! | kind | offered, in order |
//! |---|---|
//! | key exchange | `mlkem768x25519-sha256`, `curve25519-sha256`, `curve25519-sha256@libssh.org`, `diffie-hellman-group18-sha512`, `diffie-hellman-group16-sha512` |
//! | ciphers | `chacha20-poly1305@openssh.com`, `aes256-gcm@openssh.com`, `aes128-gcm@openssh.com` (AEAD), then `aes256-ctr`, `aes192-ctr`, `aes128-ctr` (only ever with an etm MAC) |
//! | MACs | `hmac-sha2-512-etm@openssh.com`, `hmac-sha2-256-etm@openssh.com` |
//! | host key and signature | `ssh-ed25519`, `ecdsa-sha2-nistp256/384/521`, `rsa-sha2-512`, `rsa-sha2-256` |
//!
//! Every OpenSSH since 7.4 (so every 8.x and 9.x client and server) has a
//! match in each row: curve25519, chacha20-poly1305, the etm MACs and
//! rsa-sha2 signatures. ECDSA stays in the host key row because Trainer's
//! MPI runtimes mount an ECDSA P-521 key (the only key of the job) as the
//! host key; `trainlet keygen --type ed25519` avoids it where the runtime
//! lets you choose.

use std::borrow::Cow;

use russh::keys::{Algorithm, EcdsaCurve, HashAlg};
use russh::{Preferred, cipher, kex, mac};

const KEX: &[kex::Name] = &[
    kex::MLKEM768X25519_SHA256,
    kex::CURVE25519,
    kex::CURVE25519_PRE_RFC_8731,
    kex::DH_G18_SHA512,
    kex::DH_G16_SHA512,
    kex::EXTENSION_SUPPORT_AS_CLIENT,
    kex::EXTENSION_SUPPORT_AS_SERVER,
    kex::EXTENSION_OPENSSH_STRICT_KEX_AS_CLIENT,
    kex::EXTENSION_OPENSSH_STRICT_KEX_AS_SERVER,
];

const CIPHERS: &[cipher::Name] = &[
    cipher::CHACHA20_POLY1305,
    cipher::AES_256_GCM,
    cipher::AES_128_GCM,
    cipher::AES_256_CTR,
    cipher::AES_192_CTR,
    cipher::AES_128_CTR,
];

const MACS: &[mac::Name] = &[mac::HMAC_SHA512_ETM, mac::HMAC_SHA256_ETM];

const KEYS: &[Algorithm] = &[
    Algorithm::Ed25519,
    Algorithm::Ecdsa { curve: EcdsaCurve::NistP256 },
    Algorithm::Ecdsa { curve: EcdsaCurve::NistP384 },
    Algorithm::Ecdsa { curve: EcdsaCurve::NistP521 },
    Algorithm::Rsa { hash: Some(HashAlg::Sha512) },
    Algorithm::Rsa { hash: Some(HashAlg::Sha256) },
];

/// What the server and the client offer (see the module table).
pub fn preferred() -> Preferred {
    Preferred {
        kex: Cow::Borrowed(KEX),
        key: Cow::Borrowed(KEYS),
        cipher: Cow::Borrowed(CIPHERS),
        mac: Cow::Borrowed(MACS),
        ..Preferred::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_encrypt_and_mac_no_sha1_no_nist_kex() {
        let p = preferred();
        let names = |v: Vec<&str>| v.join(",");
        let macs = names(p.mac.iter().map(|m| m.as_ref()).collect());
        assert_eq!(macs, "hmac-sha2-512-etm@openssh.com,hmac-sha2-256-etm@openssh.com");
        let kex = names(p.kex.iter().map(|k| k.as_ref()).collect());
        assert!(!kex.contains("sha1") && !kex.contains("nistp") && !kex.contains("group14"), "{kex}");
        let keys: Vec<String> = p.key.iter().map(ToString::to_string).collect();
        assert!(!keys.iter().any(|k| k == "ssh-rsa"), "{keys:?}");
        let ciphers = names(p.cipher.iter().map(|c| c.as_ref()).collect());
        assert!(ciphers.starts_with("chacha20-poly1305@openssh.com,aes256-gcm@openssh.com,aes128-gcm"), "{ciphers}");
        assert!(!ciphers.contains("cbc") && !ciphers.contains("3des"), "{ciphers}");
    }
}
