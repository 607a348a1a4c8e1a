//! `s3://bucket/prefix` sources through Apache OpenDAL's S3 service (the
//! library Trainer's own Python initializer wraps): SigV4 signing, the
//! ListObjectsV2 pages, ranged `GetObject`s with `If-Match` on the listed
//! ETag, so an object replaced mid-download fails instead of mixing two
//! versions. With `ENDPOINT` set, requests are path-style (MinIO, Ceph,
//! R2, moto); without it, AWS, with the bucket's region detected when
//! `REGION` is unset or `auto`. Credentials come from `ACCESS_KEY_ID` and
//! `SECRET_ACCESS_KEY` only (nothing from `~/.aws` or the instance);
//! neither set means anonymous requests (public buckets).

use std::ops::Range;

use futures_util::TryStreamExt;
use opendal::{ErrorKind, HttpTransporter, OperationContext, Operator, services};
use opendal_http_transport_reqwest::ReqwestTransport;

use crate::config::Config;
use crate::error::InitError;
use crate::remote::{Body, Check, Client, Failure, Listing, RemoteFile};

/// A bucket and key prefix.
#[derive(Debug)]
pub struct S3 {
    uri: String,
    bucket: String,
    prefix: String,
    endpoint: Option<String>,
    region: String,
    creds: Option<(String, String)>,
    client: Client,
    op: tokio::sync::OnceCell<Operator>,
}

impl S3 {
    /// From cfg's settings; a half-given credential is refused here.
    pub fn new(cfg: &Config, client: &Client, bucket: &str, prefix: &str) -> Result<Self, InitError> {
        let creds = match (&cfg.access_key_id, &cfg.secret_access_key) {
            (Some(id), Some(secret)) => Some((id.0.clone(), secret.0.clone())),
            (None, None) => None,
            (Some(_), None) => {
                return Err(InitError::Config(format!(
                    "{}: ACCESS_KEY_ID is set but SECRET_ACCESS_KEY is not; set both (or neither, for a public bucket)",
                    cfg.uri
                )));
            }
            (None, Some(_)) => {
                return Err(InitError::Config(format!(
                    "{}: SECRET_ACCESS_KEY is set but ACCESS_KEY_ID is not; set both (or neither, for a public bucket)",
                    cfg.uri
                )));
            }
        };
        Ok(S3 {
            uri: cfg.uri.clone(),
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            endpoint: cfg.endpoint.clone(),
            region: cfg.region.clone(),
            creds,
            client: client.clone(),
            op: tokio::sync::OnceCell::new(),
        })
    }

    async fn operator(&self) -> Result<&Operator, InitError> {
        self.op
            .get_or_try_init(|| async {
                let mut b =
                    services::S3::default().bucket(&self.bucket).root("/").disable_config_load().disable_ec2_metadata();
                let region = match (&self.endpoint, self.region.as_str()) {
                    (None, "auto" | "") => services::S3::detect_region("https://s3.amazonaws.com", &self.bucket)
                        .await
                        .unwrap_or_else(|| "us-east-1".to_string()),
                    (Some(_), "") => "auto".to_string(),
                    (_, r) => r.to_string(),
                };
                b = b.region(&region);
                if let Some(ep) = &self.endpoint {
                    b = b.endpoint(ep);
                }
                b = match &self.creds {
                    Some((id, secret)) => b.access_key_id(id).secret_access_key(secret),
                    None => {
                        tracing::info!(uri = %self.uri, "no ACCESS_KEY_ID/SECRET_ACCESS_KEY: anonymous requests");
                        b.skip_signature()
                    }
                };
                let op = Operator::new(b)
                    .map_err(|e| InitError::Config(format!("{}: cannot configure S3: {}", self.uri, e.message())))?;
                // Requests go through the client the other sources use: one
                // TLS setup (rustls, ring), one connection pool.
                let transport = HttpTransporter::new(Canonical(ReqwestTransport::new(self.client.inner().clone())));
                Ok(op.with_context(OperationContext::new().with_http_transport(transport)))
            })
            .await
    }

    fn fatal(&self, e: &opendal::Error, what: &str) -> InitError {
        let detail = e.to_string();
        if detail.contains("\"NoSuchBucket\"") {
            return InitError::NotFound {
                uri: self.uri.clone(),
                what: format!("bucket {:?} does not exist", self.bucket),
            };
        }
        match e.kind() {
            ErrorKind::NotFound if detail.contains("NoSuchBucket") => {
                InitError::NotFound { uri: self.uri.clone(), what: format!("bucket {:?} does not exist", self.bucket) }
            }
            ErrorKind::NotFound => InitError::NotFound { uri: self.uri.clone(), what: format!("{what}: not found") },
            ErrorKind::PermissionDenied => InitError::Denied {
                uri: self.uri.clone(),
                what: format!(
                    "{what}: access denied ({}); check ACCESS_KEY_ID, SECRET_ACCESS_KEY and REGION",
                    s3_code(&detail).unwrap_or("403")
                ),
            },
            ErrorKind::ConditionNotMatch => InitError::Source {
                uri: self.uri.clone(),
                what: format!("{what}: the object changed while it was being downloaded; run again"),
            },
            _ => InitError::Source { uri: self.uri.clone(), what: format!("{what}: {}", e.message()) },
        }
    }

    /// Every object under the prefix (or the one object it names).
    pub async fn list(&self) -> Result<Listing, InitError> {
        let op = self.operator().await?;
        let dir = if self.prefix.is_empty() || self.prefix.ends_with('/') {
            self.prefix.clone()
        } else {
            format!("{}/", self.prefix)
        };
        let mut files = Vec::new();
        let mut lister = op
            .lister_with(&dir)
            .recursive(true)
            .await
            .map_err(|e| self.fatal(&e, &format!("listing s3://{}/{dir}", self.bucket)))?;
        while let Some(entry) =
            lister.try_next().await.map_err(|e| self.fatal(&e, &format!("listing s3://{}/{dir}", self.bucket)))?
        {
            let meta = entry.metadata();
            if !meta.mode().is_file() || entry.path().ends_with('/') {
                continue;
            }
            let rel = entry.path().strip_prefix(&dir).unwrap_or(entry.path()).to_string();
            files.push(self.file(rel, entry.path(), meta.content_length(), meta.etag()));
        }
        if files.is_empty() && !self.prefix.is_empty() && !self.prefix.ends_with('/') {
            // `s3://bucket/path/to/object`: one object.
            match op.stat(&self.prefix).await {
                Ok(meta) if meta.mode().is_file() => {
                    let name = self.prefix.rsplit('/').next().unwrap_or(&self.prefix).to_string();
                    files.push(self.file(name, &self.prefix, meta.content_length(), meta.etag()));
                }
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(self.fatal(&e, &format!("reading s3://{}/{}", self.bucket, self.prefix))),
            }
        }
        if files.is_empty() {
            return Err(InitError::NotFound {
                uri: self.uri.clone(),
                what: format!("no object under s3://{}/{}", self.bucket, self.prefix),
            });
        }
        Ok(Listing { commit: None, files })
    }

    fn file(&self, rel: String, key: &str, size: u64, etag: Option<&str>) -> RemoteFile {
        let bare = etag.map(|t| t.trim_matches('"').to_ascii_lowercase());
        // A single-part upload's ETag is the content's MD5; a multipart one
        // ("<md5 of md5s>-<parts>") identifies the version only.
        let check = match &bare {
            Some(t) if t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit()) => Check::Md5(t.clone()),
            _ => Check::Size(etag.map(str::to_string)),
        };
        RemoteFile { rel, size, check, locator: key.to_string(), version: etag.map(str::to_string), ranges: true }
    }

    /// Read `range` of `file`.
    pub async fn open(&self, file: &RemoteFile, range: Range<u64>) -> Result<Body, Failure> {
        let op = self.operator().await.map_err(Failure::Fatal)?;
        let what = format!("reading s3://{}/{}", self.bucket, file.locator);
        let classify = |e: opendal::Error| match e.kind() {
            ErrorKind::NotFound | ErrorKind::PermissionDenied | ErrorKind::ConditionNotMatch => {
                Failure::Fatal(self.fatal(&e, &what))
            }
            _ => Failure::Retry(format!("{what}: {}", e.message())),
        };
        let mut r = op.reader_with(&file.locator);
        if let Some(v) = &file.version {
            r = r.if_match(v);
        }
        let reader = r.await.map_err(classify)?;
        let stream = reader.into_bytes_stream(range).await.map_err(classify)?;
        Ok(Body::Store(stream))
    }
}

/// OpenDAL's reqwest transport, sending each query string in the form it
/// is signed in: `/` in a value as `%2F`, as SigV4's canonical request
/// has it. AWS accepts either form, but S3-compatible servers that check
/// the signature against the query as received (moto, some gateways)
/// refuse a raw `/` in `prefix=a/b/`.
struct Canonical(ReqwestTransport);

impl opendal::HttpTransport for Canonical {
    async fn fetch(
        &self,
        mut req: http::Request<opendal::Buffer>,
    ) -> opendal::Result<http::Response<opendal::HttpBody>> {
        if let Some(q) = req.uri().query().filter(|q| q.contains('/')) {
            let fixed = format!("{}?{}", req.uri().path(), q.replace('/', "%2F"));
            let mut parts = req.uri().clone().into_parts();
            if let Ok(pq) = fixed.parse() {
                parts.path_and_query = Some(pq);
                if let Ok(uri) = http::Uri::from_parts(parts) {
                    *req.uri_mut() = uri;
                }
            }
        }
        self.0.fetch(req).await
    }
}

/// The S3 error code (`InvalidAccessKeyId`, `SignatureDoesNotMatch`, ...)
/// in OpenDAL's error text, if any.
fn s3_code(detail: &str) -> Option<&str> {
    let at = detail.find("code: \"")? + "code: \"".len();
    let end = detail[at..].find('"')?;
    Some(&detail[at..at + end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_error_codes_are_named() {
        assert_eq!(
            s3_code(r#"... => S3Error { code: "InvalidAccessKeyId", message: "x" }"#),
            Some("InvalidAccessKeyId")
        );
        assert_eq!(s3_code("nothing"), None);
    }
}
