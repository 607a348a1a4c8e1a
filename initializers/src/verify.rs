//! Verification of a fetched file against what its source publishes: a
//! digest that follows the written prefix of the part file (so hashing
//! overlaps the download), and the final size and digest check.

use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::InitError;
use crate::remote::Check;

/// A digest that follows the written prefix of a part file, so verifying a
/// large file overlaps its download instead of rereading it all at the end.
#[derive(Debug)]
pub(crate) struct Hashing {
    pub(crate) digest: Digest,
    pub(crate) upto: u64,
}

/// The running digest of one check.
#[derive(Clone)]
pub(crate) enum Digest {
    Ring(ring::digest::Context),
    Md5(md5::Md5),
    None,
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Digest::Ring(_) => "Digest::Ring",
            Digest::Md5(_) => "Digest::Md5",
            Digest::None => "Digest::None",
        })
    }
}

impl Digest {
    pub(crate) fn new(check: &Check, size: u64) -> Self {
        use md5::Digest as _;
        match check {
            Check::Sha256(_) => Digest::Ring(ring::digest::Context::new(&ring::digest::SHA256)),
            Check::GitSha1(_) => {
                let mut c = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
                c.update(format!("blob {size}\0").as_bytes());
                Digest::Ring(c)
            }
            Check::Md5(_) => Digest::Md5(md5::Md5::new()),
            Check::Size(_) => Digest::None,
        }
    }

    pub(crate) fn update(&mut self, b: &[u8]) {
        use md5::Digest as _;
        match self {
            Digest::Ring(c) => c.update(b),
            Digest::Md5(m) => m.update(b),
            Digest::None => {}
        }
    }

    pub(crate) fn hex(self) -> Option<String> {
        use md5::Digest as _;
        let hex = |b: &[u8]| data_encoding::HEXLOWER.encode(b);
        match self {
            Digest::Ring(c) => Some(hex(c.finish().as_ref())),
            Digest::Md5(m) => Some(hex(&m.finalize())),
            Digest::None => None,
        }
    }
}

impl Hashing {
    /// Hash the part file's bytes from `upto` to `to`.
    pub(crate) fn advance(&mut self, data: &std::fs::File, part: &Path, to: u64) -> Result<(), InitError> {
        if matches!(self.digest, Digest::None) {
            self.upto = self.upto.max(to);
            return Ok(());
        }
        let mut buf = vec![0u8; usize::try_from((to - self.upto.min(to)).min(4 << 20)).unwrap_or(4 << 20)];
        while self.upto < to {
            let want = usize::try_from((to - self.upto).min(buf.len() as u64)).unwrap_or(buf.len());
            let n = data.read_at(&mut buf[..want], self.upto).map_err(InitError::at("cannot read", part))?;
            if n == 0 {
                break;
            }
            self.digest.update(&buf[..n]);
            self.upto += n as u64;
        }
        Ok(())
    }
}

/// Finish hashing the part file (from where `hashing` stopped), sync it;
/// `Some((want, got))` on a mismatch.
pub(crate) fn verify(
    data: &std::fs::File,
    part: &Path,
    size: u64,
    check: &Check,
    mut hashing: Hashing,
) -> Result<Option<(String, String)>, InitError> {
    let len = data.metadata().map_err(InitError::at("cannot read", part))?.len();
    if len != size {
        return Ok(Some((format!("{size} bytes"), format!("{len} bytes"))));
    }
    hashing.advance(data, part, size)?;
    // No digest (`--verify size`): the size above was the check.
    if let (Some((algorithm, want)), Some(got)) = (check.digest(), hashing.digest.hex())
        && want != got
    {
        return Ok(Some((format!("{algorithm} {want}"), got)));
    }
    data.sync_data().map_err(InitError::at("cannot sync", part))?;
    Ok(None)
}
