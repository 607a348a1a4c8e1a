//! The initializer's settings from Trainer's environment contract
//! (reference/kubeflow.md 4.2) and the command line: `STORAGE_URI`,
//! `IGNORE_PATTERNS`, `ACCESS_TOKEN`/`HF_TOKEN`, `ENDPOINT`/`HF_ENDPOINT`,
//! `ACCESS_KEY_ID`, `SECRET_ACCESS_KEY`, `REGION`, with Trainer's defaults.

use std::path::PathBuf;

use crate::error::InitError;
use crate::pattern::Filter;

/// Which initializer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `trainlet init dataset` (Trainer's dataset-initializer).
    Dataset,
    /// `trainlet init model` (Trainer's model-initializer).
    Model,
}

impl Kind {
    /// Trainer's output directory.
    pub fn default_output(self) -> PathBuf {
        PathBuf::from(match self {
            Kind::Dataset => "/workspace/dataset",
            Kind::Model => "/workspace/model",
        })
    }
}

/// Where the files come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `hf://org/name[@revision]`: a Hub repo.
    Hf {
        /// `org/name`.
        repo: String,
        /// Branch, tag or commit (default `main`).
        revision: String,
    },
    /// `s3://bucket/prefix`.
    S3 {
        /// Bucket.
        bucket: String,
        /// Key prefix (may be empty).
        prefix: String,
    },
    /// `http(s)://...`: one file.
    Http(String),
    /// `file:///path`: a local file or directory.
    File(PathBuf),
}

impl Source {
    /// The scheme, for messages.
    pub fn scheme(&self) -> &'static str {
        match self {
            Source::Hf { .. } => "hf://",
            Source::S3 { .. } => "s3://",
            Source::Http(_) => "http(s)://",
            Source::File(_) => "file://",
        }
    }

    /// Parse a storage URI for `kind`.
    pub fn parse(uri: &str, kind: Kind) -> Result<Self, InitError> {
        let bad = |what: &str| InitError::Config(format!("storage URI {uri:?}: {what}"));
        let (scheme, rest) = uri
            .split_once("://")
            .ok_or_else(|| bad("expected SCHEME://..., e.g. hf://org/name or s3://bucket/prefix"))?;
        match scheme.to_ascii_lowercase().as_str() {
            "hf" => {
                let (path, revision) = match rest.rsplit_once('@') {
                    Some((p, r)) if !r.is_empty() && !r.contains('/') => (p, r.to_string()),
                    _ => (rest, "main".to_string()),
                };
                let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
                if parts.len() < 2 {
                    return Err(bad("expected hf://ORG/NAME"));
                }
                // Trainer's dataset initializer downloads the repo named by the
                // first path segment, whole; the model one the whole path.
                let repo = match kind {
                    Kind::Dataset => parts[..2].join("/"),
                    Kind::Model => parts.join("/"),
                };
                Ok(Source::Hf { repo, revision })
            }
            "s3" => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(bad("expected s3://BUCKET/PREFIX"));
                }
                Ok(Source::S3 { bucket: bucket.to_string(), prefix: prefix.trim_start_matches('/').to_string() })
            }
            "http" | "https" => {
                if rest.is_empty() || rest.starts_with('/') {
                    return Err(bad("expected http(s)://HOST/PATH"));
                }
                Ok(Source::Http(uri.to_string()))
            }
            "file" => {
                if !rest.starts_with('/') {
                    return Err(bad("expected an absolute path, file:///PATH"));
                }
                Ok(Source::File(PathBuf::from(rest)))
            }
            other => Err(bad(&format!("unsupported scheme {other}://; use hf://, s3://, http(s):// or file://"))),
        }
    }
}

/// A credential: never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Everything one run needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Dataset or model.
    pub kind: Kind,
    /// The storage URI as given (for http(s), without its query string).
    pub uri: String,
    /// Parsed.
    pub source: Source,
    /// Which files.
    pub filter: Filter,
    /// Where they go.
    pub output: PathBuf,
    /// Hub token (ACCESS_TOKEN, else HF_TOKEN).
    pub token: Option<Secret>,
    /// Custom endpoint (ENDPOINT; HF_ENDPOINT for the Hub).
    pub endpoint: Option<String>,
    /// S3 access key id.
    pub access_key_id: Option<Secret>,
    /// S3 secret.
    pub secret_access_key: Option<Secret>,
    /// S3 region (default `auto`, as Trainer's).
    pub region: String,
    /// Silence of the lock holder's heartbeat after which another pod
    /// takes the volume over (TRAINLET_INIT_STALE_SECS, default 30 s).
    pub stale_after: std::time::Duration,
    /// This pod's host name, named in the lock file ([`Config::with_host`];
    /// empty when unknown).
    pub host: String,
}

/// Trainer's model allow patterns (Hub only).
pub const MODEL_ALLOW: [&str; 5] = ["*.json", "*.safetensors", "*.model", "*.txt", "*.gguf"];
/// Trainer's model ignore patterns.
pub const MODEL_IGNORE: [&str; 5] = ["*.msgpack", "*.h5", "*.bin", "*.pt", "*.pth"];

impl Config {
    /// From the flags (`storage_uri`, `output`) and the environment (`get`).
    pub fn resolve(
        kind: Kind,
        storage_uri: Option<&str>,
        output: Option<PathBuf>,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, InitError> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let uri = storage_uri.map(str::to_string).or_else(|| get("STORAGE_URI")).ok_or_else(|| {
            InitError::Config(
                "no storage URI: set STORAGE_URI (Trainer does, from spec.initializer.*.storageUri) or --storage-uri"
                    .into(),
            )
        })?;
        let source = Source::parse(uri.trim(), kind)?;
        let list =
            |v: String| v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect::<Vec<_>>();
        let ignore = match (get("IGNORE_PATTERNS"), kind) {
            (Some(v), _) => list(v),
            (None, Kind::Model) => MODEL_IGNORE.iter().map(ToString::to_string).collect(),
            (None, Kind::Dataset) => Vec::new(),
        };
        let allow = match (&source, kind) {
            (Source::Hf { .. }, Kind::Model) => MODEL_ALLOW.iter().map(ToString::to_string).collect(),
            _ => Vec::new(),
        };
        let stale_after = match get("TRAINLET_INIT_STALE_SECS") {
            None => std::time::Duration::from_secs(30),
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(std::time::Duration::from_secs_f64)
                .ok_or_else(|| {
                    InitError::Config(format!(
                        "invalid TRAINLET_INIT_STALE_SECS value {v:?}: expected a number of seconds > 0"
                    ))
                })?,
        };
        let endpoint = match &source {
            Source::Hf { .. } => get("ENDPOINT").or_else(|| get("HF_ENDPOINT")),
            _ => get("ENDPOINT"),
        };
        Ok(Config {
            kind,
            // A presigned URL's query is a credential: kept in the source,
            // never in messages or the marker.
            uri: match &source {
                Source::Http(_) => uri.trim().split(['?', '#']).next().unwrap_or_default().to_string(),
                _ => uri.trim().to_string(),
            },
            source,
            filter: Filter { allow, ignore },
            output: output.unwrap_or_else(|| kind.default_output()),
            token: get("ACCESS_TOKEN").or_else(|| get("HF_TOKEN")).map(Secret),
            endpoint,
            access_key_id: get("ACCESS_KEY_ID").map(Secret),
            secret_access_key: get("SECRET_ACCESS_KEY").map(Secret),
            region: get("REGION").unwrap_or_else(|| "auto".to_string()),
            stale_after,
            host: String::new(),
        })
    }

    /// Name this pod's host in the lock file (the agent knows it; this
    /// crate reads no system state of its own for it).
    pub fn with_host(mut self, host: Option<String>) -> Self {
        self.host = host.unwrap_or_default();
        self
    }

    /// Take the Hub revision from an option (`--revision`) instead of the
    /// URI's `@REV`; both given and different is an error, as is a revision
    /// for a source that has none.
    pub fn with_revision(mut self, rev: Option<&str>) -> Result<Self, InitError> {
        let Some(rev) = rev.map(str::trim).filter(|r| !r.is_empty()) else { return Ok(self) };
        let in_uri = self.uri.rsplit_once('@').is_some_and(|(_, r)| !r.contains('/'));
        match &mut self.source {
            Source::Hf { revision, .. } if in_uri && revision != rev => Err(InitError::Config(format!(
                "{}: the URI names revision {revision:?} and --revision {rev:?}; give one",
                self.uri
            ))),
            Source::Hf { revision, .. } => {
                *revision = rev.to_string();
                Ok(self)
            }
            other => Err(InitError::Config(format!(
                "{}: --revision applies to hf:// sources, not {}",
                self.uri,
                other.scheme()
            ))),
        }
    }

    /// The revision recorded in the marker.
    pub fn revision(&self) -> Option<&str> {
        match &self.source {
            Source::Hf { revision, .. } => Some(revision),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("hf://meta-llama/Llama-3.2-1B", Kind::Model, Source::Hf { repo: "meta-llama/Llama-3.2-1B".into(), revision: "main".into() }; "hf model")]
    #[test_case("hf://org/name@v1.0", Kind::Model, Source::Hf { repo: "org/name".into(), revision: "v1.0".into() }; "hf revision")]
    #[test_case("hf://tatsu-lab/alpaca/data/train.parquet", Kind::Dataset, Source::Hf { repo: "tatsu-lab/alpaca".into(), revision: "main".into() }; "hf dataset first segment")]
    #[test_case("s3://bucket/a/b", Kind::Dataset, Source::S3 { bucket: "bucket".into(), prefix: "a/b".into() }; "s3")]
    #[test_case("s3://bucket", Kind::Model, Source::S3 { bucket: "bucket".into(), prefix: String::new() }; "s3 whole bucket")]
    #[test_case("https://host/f.bin", Kind::Model, Source::Http("https://host/f.bin".into()); "https")]
    #[test_case("file:///data/x", Kind::Dataset, Source::File("/data/x".into()); "file")]
    fn uris(uri: &str, kind: Kind, want: Source) {
        assert_eq!(Source::parse(uri, kind).expect("parses"), want);
    }

    #[test_case("gs://b/p", "unsupported scheme gs://"; "unknown scheme")]
    #[test_case("hf://onlyorg", "expected hf://ORG/NAME"; "hf without name")]
    #[test_case("s3:///p", "expected s3://BUCKET/PREFIX"; "s3 without bucket")]
    #[test_case("file://rel/path", "absolute path"; "relative file")]
    #[test_case("no-scheme", "expected SCHEME://"; "no scheme")]
    fn bad_uris_name_the_uri(uri: &str, want: &str) {
        let e = Source::parse(uri, Kind::Model).expect_err("refused").to_string();
        assert!(e.contains(&format!("{uri:?}")) && e.contains(want), "{e}");
    }

    #[test]
    fn a_revision_comes_from_the_uri_or_the_option_not_both() {
        let env = |_: &str| None;
        let c = Config::resolve(Kind::Model, Some("hf://o/m"), None, env).expect("cfg");
        assert_eq!(c.with_revision(Some("v2")).expect("rev").revision(), Some("v2"));
        let c = Config::resolve(Kind::Model, Some("hf://o/m@v1"), None, env).expect("cfg");
        assert_eq!(c.clone().with_revision(Some("v1")).expect("same").revision(), Some("v1"));
        let e = c.with_revision(Some("v2")).expect_err("conflict").to_string();
        assert!(e.contains("names revision \"v1\" and --revision \"v2\""), "{e}");
        let c = Config::resolve(Kind::Model, Some("s3://b/p"), None, env).expect("cfg");
        assert!(c.with_revision(Some("v1")).expect_err("s3").to_string().contains("applies to hf://"));
    }

    #[test]
    fn trainer_defaults_and_overrides() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let c =
            Config::resolve(Kind::Model, None, None, env(&[("STORAGE_URI", "hf://o/m"), ("HF_TOKEN", "hf_secret")]))
                .expect("cfg");
        assert_eq!(c.filter.allow.len(), 5);
        assert_eq!(c.filter.ignore, MODEL_IGNORE);
        assert_eq!(c.output, PathBuf::from("/workspace/model"));
        assert!(!format!("{c:?}").contains("hf_secret"), "tokens are never printed");
        let c = Config::resolve(
            Kind::Dataset,
            Some("s3://b/p"),
            Some("/out".into()),
            env(&[("IGNORE_PATTERNS", "*.tmp, logs/*")]),
        )
        .expect("cfg");
        assert_eq!(
            (c.filter.allow.len(), c.filter.ignore.clone()),
            (0, vec!["*.tmp".to_string(), "logs/*".to_string()])
        );
        assert_eq!(c.region, "auto");
        let e = Config::resolve(Kind::Dataset, None, None, env(&[])).expect_err("no uri").to_string();
        assert!(e.contains("STORAGE_URI"), "{e}");
    }

    /// The stale time is read through the given environment, never the
    /// process's, and a bad value is a configuration error naming it.
    #[test]
    fn the_stale_time_comes_from_the_given_env_and_a_bad_one_is_named() {
        let with = |v: &'static str| move |k: &str| (k == "TRAINLET_INIT_STALE_SECS").then(|| v.to_string());
        let c = Config::resolve(Kind::Dataset, Some("s3://b/p"), None, with("2.5")).expect("valid");
        assert_eq!(c.stale_after, std::time::Duration::from_millis(2500));
        let c = Config::resolve(Kind::Dataset, Some("s3://b/p"), None, |_: &str| None).expect("valid");
        assert_eq!(c.stale_after, std::time::Duration::from_secs(30));
        let e = Config::resolve(Kind::Dataset, Some("s3://b/p"), None, with("soon")).expect_err("refused");
        assert!(e.to_string().contains("TRAINLET_INIT_STALE_SECS"), "{e}");
        assert_eq!(e.exit_code(), crate::exit::CONFIG);
    }
}
