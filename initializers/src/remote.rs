//! What every remote source gives the fetch engine: a listing of files
//! (relative path, size, what to verify them against) and ranged reads of
//! each, as a stream of byte chunks. The sources, each in a file of its
//! own that imports this one, are picked in [`crate::sources`]:
//! [`crate::hub`] (Hugging Face Hub REST API over reqwest), [`crate::s3`]
//! (OpenDAL's S3 service) and [`crate::http`] (one URL over reqwest).
//!
//! Failures carry a verdict: [`Failure::Retry`] (connection dropped, 5xx,
//! 429, timeout: the engine retries the rest of the range with backoff) or
//! [`Failure::Fatal`] (401/403/404, a changed object: retrying cannot help).

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;

use crate::config::Secret;
use crate::error::InitError;

/// What a file is checked against before it is published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// SHA-256 of the content, lowercase hex (Hub LFS files).
    Sha256(String),
    /// Git blob SHA-1 (`sha1("blob <size>\0" + content)`), lowercase hex
    /// (Hub files stored in git, not LFS).
    GitSha1(String),
    /// MD5 of the content, lowercase hex (an S3 ETag of a single-part upload).
    Md5(String),
    /// The size only; the string is the source's version tag (ETag), if any,
    /// so a changed object is not taken for the one already fetched.
    Size(Option<String>),
}

impl Check {
    /// `sha256:...`, `git-sha1:...`, `md5:...`, `etag:...` or `size`: how the
    /// marker and the journal record it.
    pub fn label(&self) -> String {
        match (self.digest(), self) {
            (Some((algorithm, hex)), _) => format!("{algorithm}:{hex}"),
            (None, Check::Size(Some(t))) => format!("etag:{t}"),
            (None, _) => "size".into(),
        }
    }

    /// The content digest the source publishes: algorithm name and hex.
    pub fn digest(&self) -> Option<(&'static str, &str)> {
        match self {
            Check::Sha256(h) => Some(("sha256", h)),
            Check::GitSha1(h) => Some(("git-sha1", h)),
            Check::Md5(h) => Some(("md5", h)),
            Check::Size(_) => None,
        }
    }

    /// Whether a file already on the volume can be trusted by this record
    /// alone (a content hash or a version tag, not the size only).
    pub fn identifies(&self) -> bool {
        !matches!(self, Check::Size(None))
    }
}

/// One file of the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    /// Path under the output directory, `/`-separated, validated.
    pub rel: String,
    /// Size in bytes.
    pub size: u64,
    /// What it is verified against.
    pub check: Check,
    /// Where the source reads it from (a URL or an object key).
    pub locator: String,
    /// A version tag that reads must match (`If-Match`), where the source has one.
    pub version: Option<String>,
    /// Whether the source serves byte ranges (else one stream, restarted
    /// from the start after a failure).
    pub ranges: bool,
}

/// The source's files, at one revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    /// The commit the files belong to (the Hub), if any.
    pub commit: Option<String>,
    /// Every file, before filtering.
    pub files: Vec<RemoteFile>,
}

/// A failed remote operation.
#[derive(Debug)]
pub enum Failure {
    /// Transient: try the rest again.
    Retry(String),
    /// Final.
    Fatal(InitError),
}

/// An open ranged read.
pub enum Body {
    /// A reqwest response body.
    Http(reqwest::Response),
    /// An OpenDAL byte stream.
    Store(opendal::FuturesBytesStream),
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Body::Http(_) => "Body::Http",
            Body::Store(_) => "Body::Store",
        })
    }
}

impl Body {
    /// The next chunk, `None` at the end; `timeout` bounds the wait for it,
    /// so a stalled connection is a retry, not a hang.
    pub async fn chunk(&mut self, timeout: Duration) -> Result<Option<Bytes>, Failure> {
        let next = async {
            match self {
                Body::Http(r) => r.chunk().await.map_err(|e| Failure::Retry(describe(&e))),
                Body::Store(s) => s.next().await.transpose().map_err(|e| Failure::Retry(e.to_string())),
            }
        };
        tokio::time::timeout(timeout, next)
            .await
            .map_err(|_| Failure::Retry(format!("no data for {}s", timeout.as_secs_f64())))?
    }
}

/// The HTTP client shared by the Hub and plain URLs: rustls with ring
/// (no OpenSSL), system roots, HTTP/1.1 and HTTP/2, redirects followed
/// (reqwest drops `Authorization` when a redirect leaves the host, as the
/// Hub's CDN redirects do).
#[derive(Debug, Clone)]
pub struct Client {
    inner: reqwest::Client,
}

/// rustls needs one process-wide crypto provider; ring is the one russh
/// already brings, so no second implementation is linked.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl Client {
    /// A client with trainlet's user agent and a connect timeout.
    pub fn new() -> Result<Self, InitError> {
        install_crypto();
        let inner = reqwest::Client::builder()
            .user_agent(concat!("trainlet/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(15))
            .redirect(reqwest::redirect::Policy::limited(10))
            .pool_max_idle_per_host(64)
            .build()
            .map_err(|e| InitError::Config(format!("cannot build the HTTP client: {}", describe(&e))))?;
        Ok(Client { inner })
    }

    /// A GET of `range` of `url` (the whole file when `range` covers it),
    /// with a bearer token when given and `If-Match` on `version`.
    pub async fn get(
        &self,
        uri: &str,
        url: &str,
        range: Range<u64>,
        size: u64,
        token: Option<&Secret>,
        version: Option<&str>,
    ) -> Result<Body, Failure> {
        let mut req = self.inner.get(url).header(reqwest::header::ACCEPT_ENCODING, "identity");
        let whole = range.start == 0 && range.end == size;
        if !whole {
            req = req.header(reqwest::header::RANGE, format!("bytes={}-{}", range.start, range.end.saturating_sub(1)));
        }
        if let Some(t) = token {
            req = req.bearer_auth(&t.0);
        }
        if let Some(v) = version {
            req = req.header(reqwest::header::IF_MATCH, v);
        }
        let resp = req.send().await.map_err(|e| Failure::Retry(describe(&e)))?;
        let status = resp.status();
        match status.as_u16() {
            200 if whole => Ok(Body::Http(resp)),
            200 => Err(Failure::Fatal(InitError::Source {
                uri: uri.to_string(),
                what: format!("{url} ignored the Range header (200 instead of 206); cannot read it in parts"),
            })),
            206 => {
                let start = resp
                    .headers()
                    .get(reqwest::header::CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes "))
                    .and_then(|v| v.split('-').next())
                    .and_then(|v| v.parse::<u64>().ok());
                if start == Some(range.start) {
                    Ok(Body::Http(resp))
                } else {
                    Err(Failure::Retry(format!("{url}: asked for bytes from {}, got {start:?}", range.start)))
                }
            }
            _ => Err(status_failure(uri, url, status, resp.headers())),
        }
    }

    /// The underlying client.
    pub fn inner(&self) -> &reqwest::Client {
        &self.inner
    }
}

/// What an HTTP error status means for a download of `url`.
pub fn status_failure(
    uri: &str,
    url: &str,
    status: reqwest::StatusCode,
    headers: &reqwest::header::HeaderMap,
) -> Failure {
    let code = headers.get("x-error-code").and_then(|v| v.to_str().ok()).unwrap_or_default();
    let uri = uri.to_string();
    match status.as_u16() {
        401 | 403 if code == "RepoNotFound" => Failure::Fatal(InitError::NotFound {
            uri,
            what: "repository not found (or private: set ACCESS_TOKEN to a token that can read it)".into(),
        }),
        401 | 403 if code == "GatedRepo" => Failure::Fatal(InitError::Denied {
            uri,
            what: format!(
                "gated repository ({status}): accept its terms on the Hub and set ACCESS_TOKEN to a token of that account"
            ),
        }),
        401 | 403 => Failure::Fatal(InitError::Denied {
            uri,
            what: format!("{status} for {url}: the credentials are missing, wrong or lack access"),
        }),
        404 | 410 => Failure::Fatal(InitError::NotFound { uri, what: format!("{status} for {url}") }),
        412 | 416 => Failure::Fatal(InitError::Source {
            uri,
            what: format!("{status} for {url}: the file changed while it was being downloaded; run again"),
        }),
        _ => Failure::Retry(format!("{status} for {url}")),
    }
}

/// A reqwest error with its causes, without the URL's query (a presigned
/// URL's signature is a credential).
pub fn describe(e: &reqwest::Error) -> String {
    let mut out = e.to_string();
    if let Some(url) = e.url()
        && url.query().is_some()
    {
        let mut bare = url.clone();
        bare.set_query(None);
        out = out.replace(url.as_str(), bare.as_str());
    }
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// Whether `rel` (from a remote listing) is a safe path under the output
/// directory: relative, no `.`/`..`/empty components, not one of trainlet's
/// own bookkeeping names, no control characters, and every component short
/// enough for its temporary names.
pub fn safe_rel(rel: &str) -> bool {
    check_rel(rel).is_ok()
}

/// Longest file name component Linux filesystems take (NAME_MAX).
const NAME_MAX: usize = 255;

/// Why `rel` cannot be written under the output directory, if it cannot.
pub fn check_rel(rel: &str) -> Result<(), &'static str> {
    if rel.is_empty()
        || rel.starts_with('/')
        || rel.contains('\0')
        || !rel.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
    {
        return Err("its path would leave the output directory");
    }
    if rel.split('/').any(|c| c.starts_with(".trainlet-") || crate::volume::is_temp(c)) {
        return Err("its name is one of trainlet's own bookkeeping names");
    }
    if rel.chars().any(char::is_control) {
        return Err("its name holds control characters");
    }
    // `.NAME.trainlet-state` is the longest name written for a component.
    let extra = 1 + crate::volume::PART.len().max(crate::volume::STATE.len());
    if rel.split('/').any(|c| c.len() + extra > NAME_MAX) {
        return Err("its name is too long for its temporary name (255 bytes at most)");
    }
    Ok(())
}

/// `name` with control characters escaped (`\n`, `\u{1b}`), for log and
/// error lines: a remote name never starts a line of its own.
pub fn escaped(name: &str) -> String {
    if name.chars().any(char::is_control) {
        name.chars().flat_map(char::escape_debug).collect()
    } else {
        name.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("a.json", true; "plain")]
    #[test_case("sub/dir/x.safetensors", true; "nested")]
    #[test_case("../etc/passwd", false; "parent")]
    #[test_case("a/../../b", false; "parent inside")]
    #[test_case("/abs", false; "absolute")]
    #[test_case("a//b", false; "empty component")]
    #[test_case("./a", false; "dot")]
    #[test_case(".trainlet-complete.json", false; "our marker")]
    #[test_case("x/.f.trainlet-part", false; "our partial")]
    #[test_case("", false; "empty")]
    #[test_case("a\nINFO forged", false; "newline")]
    #[test_case("a\u{1b}[31m", false; "escape sequence")]
    #[test_case(&"n".repeat(239), true; "long but fits")]
    #[test_case(&"n".repeat(240), false; "temporary name too long")]
    #[test_case(&format!("d/{}", "n".repeat(250)), false; "long last component")]
    fn remote_paths_stay_inside_the_output(rel: &str, ok: bool) {
        assert_eq!(safe_rel(rel), ok);
    }

    #[test]
    fn escaping_keeps_names_on_one_line() {
        assert_eq!(escaped("a\nINFO x"), "a\\nINFO x");
        assert_eq!(escaped("plain/ü.json"), "plain/ü.json");
    }

    #[test]
    fn checks_label_themselves() {
        assert_eq!(Check::Sha256("ab".into()).label(), "sha256:ab");
        assert_eq!(Check::Size(Some("\"e\"".into())).label(), "etag:\"e\"");
        assert!(!Check::Size(None).identifies());
        assert!(Check::Md5("00".into()).identifies());
    }
}
