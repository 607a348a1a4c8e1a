//! `http(s)://` sources: one file, over reqwest with rustls. A `HEAD`
//! (or, where a server refuses it, a one-byte ranged `GET`) gives the size,
//! the `ETag` and whether ranges are served; reads carry `If-Match` on a
//! strong ETag so a file replaced mid-download fails instead of mixing.
//! The file is named by the URL's last path segment; the query string
//! (a presigned URL's signature) is never logged.

use std::ops::Range;

use crate::config::{Config, Secret};
use crate::error::InitError;
use crate::remote::{Body, Check, Client, Failure, Listing, RemoteFile, describe, safe_rel, status_failure};

/// One URL.
#[derive(Debug)]
pub struct Http {
    /// The URL without its query (cfg.uri), for messages.
    uri: String,
    client: Client,
    url: String,
    token: Option<Secret>,
}

impl Http {
    /// `url`, with cfg's token (ACCESS_TOKEN) as a bearer token if set.
    pub fn new(cfg: &Config, client: &Client, url: &str) -> Self {
        Http { uri: cfg.uri.clone(), client: client.clone(), url: url.to_string(), token: cfg.token.clone() }
    }

    fn name(&self) -> Result<String, InitError> {
        let path = self.uri.split_once("://").map_or("", |(_, rest)| rest);
        let last = path.split_once('/').map_or("", |(_, p)| p).rsplit('/').next().unwrap_or_default();
        let name = percent_encoding::percent_decode_str(last).decode_utf8_lossy().into_owned();
        if safe_rel(&name) && !name.contains('/') {
            Ok(name)
        } else {
            Err(InitError::Config(format!(
                "{}: cannot name the file from the URL (its path must end with a file name, not {last:?})",
                self.uri
            )))
        }
    }

    async fn probe(&self, method: reqwest::Method) -> Result<reqwest::Response, InitError> {
        let mut req =
            self.client.inner().request(method.clone(), &self.url).header(reqwest::header::ACCEPT_ENCODING, "identity");
        if method == reqwest::Method::GET {
            req = req.header(reqwest::header::RANGE, "bytes=0-0");
        }
        if let Some(t) = &self.token {
            req = req.bearer_auth(&t.0);
        }
        req.send().await.map_err(|e| InitError::Source { uri: self.uri.clone(), what: describe(&e) })
    }

    /// The one file: its size, ETag and whether ranges work.
    pub async fn list(&self) -> Result<Listing, InitError> {
        let rel = self.name()?;
        let mut resp = self.probe(reqwest::Method::HEAD).await?;
        if matches!(resp.status().as_u16(), 405 | 501) {
            resp = self.probe(reqwest::Method::GET).await?;
        }
        let status = resp.status();
        if !status.is_success() {
            return Err(match status_failure(&self.uri, &self.uri, status, resp.headers()) {
                Failure::Fatal(e) => e,
                Failure::Retry(why) => InitError::Source { uri: self.uri.clone(), what: why },
            });
        }
        let h = resp.headers();
        let header = |n: reqwest::header::HeaderName| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
        let total = header(reqwest::header::CONTENT_RANGE)
            .and_then(|r| r.rsplit('/').next().and_then(|t| t.parse::<u64>().ok()));
        let size = match (status.as_u16(), total) {
            (206, Some(t)) => Some(t),
            _ => header(reqwest::header::CONTENT_LENGTH).and_then(|l| l.parse::<u64>().ok()),
        };
        let size = size.ok_or_else(|| InitError::Source {
            uri: self.uri.clone(),
            what: "the server does not give the file's size (no Content-Length); cannot verify a download".into(),
        })?;
        let ranges = status.as_u16() == 206
            || header(reqwest::header::ACCEPT_RANGES).is_some_and(|v| v.eq_ignore_ascii_case("bytes"));
        // A weak ETag (W/"...") may not be used with If-Match.
        let etag = header(reqwest::header::ETAG);
        let version = etag.clone().filter(|t| !t.starts_with("W/"));
        Ok(Listing {
            commit: None,
            files: vec![RemoteFile { rel, size, check: Check::Size(etag), locator: self.url.clone(), version, ranges }],
        })
    }

    /// Read `range` of the file.
    pub async fn open(&self, file: &RemoteFile, range: Range<u64>) -> Result<Body, Failure> {
        self.client.get(&self.uri, &file.locator, range, file.size, self.token.as_ref(), file.version.as_deref()).await
    }
}
