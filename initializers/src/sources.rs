//! Which remote source a URI names ([`Remote`]): the Hub, S3 or a plain
//! URL, each behind what [`crate::remote`] says every source gives the
//! fetch engine.

use std::ops::Range;

use crate::config::{Config, Source};
use crate::error::InitError;
use crate::remote::{Body, Client, Failure, Listing, RemoteFile};

/// A source, connected.
#[derive(Debug)]
pub enum Remote {
    /// `hf://`.
    Hub(crate::hub::Hub),
    /// `s3://`.
    S3(crate::s3::S3),
    /// `http(s)://`.
    Http(crate::http::Http),
}

impl Remote {
    /// For `cfg`'s source (`file://` is not remote).
    pub fn new(cfg: &Config, client: &Client) -> Result<Self, InitError> {
        match &cfg.source {
            Source::Hf { repo, revision } => Ok(Remote::Hub(crate::hub::Hub::new(cfg, client, repo, revision))),
            Source::S3 { bucket, prefix } => Ok(Remote::S3(crate::s3::S3::new(cfg, client, bucket, prefix)?)),
            Source::Http(url) => Ok(Remote::Http(crate::http::Http::new(cfg, client, url))),
            Source::File(_) => Err(InitError::Config(format!("{}: file:// is not a remote source", cfg.uri))),
        }
    }

    /// The files, with sizes and checks.
    pub async fn list(&self) -> Result<Listing, InitError> {
        match self {
            Remote::Hub(h) => h.list().await,
            Remote::S3(s) => s.list().await,
            Remote::Http(h) => h.list().await,
        }
    }

    /// Read `range` of `file`.
    pub async fn open(&self, file: &RemoteFile, range: Range<u64>) -> Result<Body, Failure> {
        match self {
            Remote::Hub(h) => h.open(file, range).await,
            Remote::S3(s) => s.open(file, range).await,
            Remote::Http(h) => h.open(file, range).await,
        }
    }
}
