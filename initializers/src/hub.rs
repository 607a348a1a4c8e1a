//! `hf://` sources: the Hugging Face Hub's REST API, the calls
//! `huggingface_hub.snapshot_download` makes (Trainer's initializer), over
//! reqwest with rustls.
//!
//! 1. `GET /api/{models|datasets}/ORG/NAME/revision/REV` resolves the
//!    branch or tag to a commit, so every file comes from one commit.
//! 2. `GET /api/.../tree/COMMIT?recursive=true` lists the files, page by
//!    page (`Link: <...>; rel="next"`), with each file's size, git blob id
//!    and, for LFS files, SHA-256: what the download is verified against.
//! 3. `GET /[datasets/]ORG/NAME/resolve/COMMIT/PATH` with `Range` reads a
//!    file; LFS files redirect to the CDN (reqwest follows, dropping the
//!    token when the host changes).
//!
//! The token (`ACCESS_TOKEN`/`HF_TOKEN`) goes in `Authorization: Bearer`.
//! Errors follow the Hub's `X-Error-Code` header (`RepoNotFound`,
//! `RevisionNotFound`, `GatedRepo`, `EntryNotFound`).

use std::ops::Range;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde::Deserialize;

use crate::config::{Config, Kind, Secret};
use crate::error::InitError;
use crate::remote::{Body, Check, Client, Failure, Listing, RemoteFile, describe, status_failure};

/// The public Hub, when neither ENDPOINT nor HF_ENDPOINT is set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// What `huggingface_hub` leaves unescaped in a revision (nothing but
/// the unreserved characters).
const REVISION: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');
/// In a file path, `/` stays.
const PATH: &AsciiSet = &REVISION.remove(b'/');

/// A Hub repository at a revision.
#[derive(Debug)]
pub struct Hub {
    uri: String,
    client: Client,
    endpoint: String,
    /// `models` or `datasets`, as in the API paths.
    kind: &'static str,
    repo: String,
    revision: String,
    token: Option<Secret>,
}

#[derive(Debug, Deserialize)]
struct RevisionInfo {
    sha: Option<String>,
}

#[derive(Debug, Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    oid: Option<String>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Debug, Deserialize)]
struct Lfs {
    oid: String,
    size: u64,
}

impl Hub {
    /// `repo` at `revision` on cfg's endpoint.
    pub fn new(cfg: &Config, client: &Client, repo: &str, revision: &str) -> Self {
        Hub {
            uri: cfg.uri.clone(),
            client: client.clone(),
            endpoint: cfg.endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT).trim_end_matches('/').to_string(),
            kind: match cfg.kind {
                Kind::Dataset => "datasets",
                Kind::Model => "models",
            },
            repo: repo.to_string(),
            revision: revision.to_string(),
            token: cfg.token.clone(),
        }
    }

    async fn json<T: serde::de::DeserializeOwned>(&self, url: &str) -> Result<(T, Option<String>), InitError> {
        let mut tries = 0;
        loop {
            match self.json_once(url).await {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Retry(why)) if tries >= 4 => {
                    return Err(InitError::Source { uri: self.uri.clone(), what: format!("{why} (after 5 tries)") });
                }
                Err(Failure::Retry(why)) => {
                    tries += 1;
                    tracing::warn!(uri = %self.uri, %why, "Hub API call failed; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(250 << tries)).await;
                }
            }
        }
    }

    async fn json_once<T: serde::de::DeserializeOwned>(&self, url: &str) -> Result<(T, Option<String>), Failure> {
        let mut req = self.client.inner().get(url);
        // The token goes only to the endpoint's origin: a pagination link
        // may name another host, which gets the request without it.
        if let Some(t) = &self.token {
            if same_origin(url, &self.endpoint) {
                req = req.bearer_auth(&t.0);
            } else {
                tracing::warn!(uri = %self.uri, "a Hub page link leaves the endpoint's host; following it without the token");
            }
        }
        let resp = req.send().await.map_err(|e| Failure::Retry(describe(&e)))?;
        let status = resp.status();
        if !status.is_success() {
            let code = resp.headers().get("x-error-code").and_then(|v| v.to_str().ok()).unwrap_or_default();
            if code == "RevisionNotFound" {
                return Err(Failure::Fatal(InitError::NotFound {
                    uri: self.uri.clone(),
                    what: format!("revision {:?} not found in {}", self.revision, self.repo),
                }));
            }
            return Err(status_failure(&self.uri, url, status, resp.headers()));
        }
        let next = resp
            .headers()
            .get_all(reqwest::header::LINK)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find_map(next_link)
            .map(|l| self.absolute(&l));
        let body = resp.bytes().await.map_err(|e| Failure::Retry(describe(&e)))?;
        let v = serde_json::from_slice(&body).map_err(|e| {
            Failure::Fatal(InitError::Source {
                uri: self.uri.clone(),
                what: format!("unexpected answer from {url}: {e}"),
            })
        })?;
        Ok((v, next))
    }

    fn absolute(&self, link: &str) -> String {
        if link.starts_with("http://") || link.starts_with("https://") {
            link.to_string()
        } else {
            format!("{}/{}", self.endpoint, link.trim_start_matches('/'))
        }
    }

    fn repo_path(&self) -> String {
        utf8_percent_encode(&self.repo, PATH).to_string()
    }

    /// The commit, then every file of it.
    pub async fn list(&self) -> Result<Listing, InitError> {
        let url = format!(
            "{}/api/{}/{}/revision/{}",
            self.endpoint,
            self.kind,
            self.repo_path(),
            utf8_percent_encode(&self.revision, REVISION)
        );
        let (info, _): (RevisionInfo, _) = self.json(&url).await?;
        let commit = info.sha.ok_or_else(|| InitError::Source {
            uri: self.uri.clone(),
            what: format!("{url} gave no commit sha for revision {:?}", self.revision),
        })?;
        let mut next = Some(format!(
            "{}/api/{}/{}/tree/{commit}?recursive=true&expand=false",
            self.endpoint,
            self.kind,
            self.repo_path()
        ));
        let mut files = Vec::new();
        while let Some(url) = next.take() {
            let (page, more): (Vec<TreeEntry>, _) = self.json(&url).await?;
            for e in page.into_iter().filter(|e| e.kind == "file") {
                let (size, check) = match (e.lfs, e.oid) {
                    (Some(l), _) => (l.size, Check::Sha256(l.oid.to_ascii_lowercase())),
                    (None, Some(oid)) => (e.size, Check::GitSha1(oid.to_ascii_lowercase())),
                    (None, None) => (e.size, Check::Size(None)),
                };
                let locator = format!(
                    "{}/{}{}/resolve/{commit}/{}",
                    self.endpoint,
                    if self.kind == "datasets" { "datasets/" } else { "" },
                    self.repo_path(),
                    utf8_percent_encode(&e.path, PATH)
                );
                files.push(RemoteFile { rel: e.path, size, check, locator, version: None, ranges: true });
            }
            next = more;
        }
        Ok(Listing { commit: Some(commit), files })
    }

    /// Read `range` of `file` (its resolve URL, at the listed commit).
    pub async fn open(&self, file: &RemoteFile, range: Range<u64>) -> Result<Body, Failure> {
        self.client.get(&self.uri, &file.locator, range, file.size, self.token.as_ref(), None).await
    }
}

/// Do `url` and `endpoint` have the same scheme, host and port?
pub(crate) fn same_origin(url: &str, endpoint: &str) -> bool {
    let origin = |u: &str| {
        reqwest::Url::parse(u)
            .ok()
            .map(|u| (u.scheme().to_string(), u.host_str().map(str::to_ascii_lowercase), u.port_or_known_default()))
    };
    matches!((origin(url), origin(endpoint)), (Some(a), Some(b)) if a == b)
}

/// The URL of a `Link` header's `rel="next"`, if any.
fn next_link(header: &str) -> Option<String> {
    header.split(',').find_map(|part| {
        let (url, params) = part.trim().split_once(';')?;
        let rel_next = params.split(';').any(|p| {
            let p = p.trim().replace(' ', "");
            p == "rel=\"next\"" || p == "rel=next" || p == "rel='next'"
        });
        rel_next.then(|| url.trim().trim_start_matches('<').trim_end_matches('>').to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_compare_scheme_host_and_port() {
        let ep = "https://huggingface.co";
        assert!(same_origin("https://huggingface.co/api/models/a/b/tree/x?cursor=1", ep));
        assert!(same_origin("https://HuggingFace.co:443/api", ep));
        assert!(!same_origin("https://evil.example/api", ep));
        assert!(!same_origin("http://huggingface.co/api", ep));
        assert!(!same_origin("https://huggingface.co:8443/api", ep));
        assert!(!same_origin("https://huggingface.co.evil.example/api", ep));
        assert!(!same_origin("not a url", ep));
    }

    #[test]
    fn link_headers_give_the_next_page() {
        assert_eq!(
            next_link(r#"<https://hub/api/models/a/b/tree/x?cursor=Q>; rel="next""#).as_deref(),
            Some("https://hub/api/models/a/b/tree/x?cursor=Q")
        );
        assert_eq!(next_link(r#"</p?c=1>; rel="prev", </p?c=3>; rel="next""#).as_deref(), Some("/p?c=3"));
        assert_eq!(next_link(r#"<https://hub/x>; rel="prev""#), None);
    }

    #[test]
    fn revisions_and_paths_are_escaped_as_huggingface_hub_does() {
        assert_eq!(utf8_percent_encode("refs/pr/1", REVISION).to_string(), "refs%2Fpr%2F1");
        assert_eq!(utf8_percent_encode("a dir/f+1.json", PATH).to_string(), "a%20dir/f%2B1.json");
    }
}
