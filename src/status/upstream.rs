//! POSTs to Trainer's status endpoint: the bearer token re-read from its
//! file before every request (the projected token rotates), TLS verified
//! against the CA file alone (re-read too; the client is rebuilt when the
//! file changes), a 10 s bound on each request. Throttling and backoff
//! are the caller's ([`super::relay`]).

use std::time::Duration;

use crate::config::Upstream;

/// Bound on one POST, connect included.
const REQUEST_TIME: Duration = Duration::from_secs(10);

/// A client for one status endpoint.
#[derive(Debug)]
pub struct Poster {
    cfg: Upstream,
    client: Option<(Vec<u8>, reqwest::Client)>,
}

impl Poster {
    /// A poster for `cfg`; nothing is read or dialled yet.
    pub fn new(cfg: Upstream) -> Self {
        Self { cfg, client: None }
    }

    /// Where it posts.
    pub fn url(&self) -> &str {
        &self.cfg.url
    }

    /// The client for the CA file as it is now.
    fn client(&mut self) -> Result<reqwest::Client, String> {
        let https = self.cfg.url.starts_with("https://");
        let ca = if https {
            std::fs::read(&self.cfg.ca_file)
                .map_err(|e| format!("cannot read the CA file {}: {e}", self.cfg.ca_file.display()))?
        } else {
            Vec::new()
        };
        if let Some((seen, client)) = &self.client
            && *seen == ca
        {
            return Ok(client.clone());
        }
        initializers::remote::install_crypto();
        let mut b = reqwest::Client::builder()
            .user_agent(concat!("trainlet/", env!("CARGO_PKG_VERSION")))
            .timeout(REQUEST_TIME)
            .redirect(reqwest::redirect::Policy::none());
        if https {
            let certs = reqwest::Certificate::from_pem_bundle(&ca)
                .map_err(|e| format!("no certificate in the CA file {}: {e}", self.cfg.ca_file.display()))?;
            if certs.is_empty() {
                return Err(format!("no certificate in the CA file {}", self.cfg.ca_file.display()));
            }
            b = b.tls_certs_only(certs);
        }
        let client =
            b.build().map_err(|e| format!("cannot build the HTTPS client: {}", crate::error::error_chain(&e)))?;
        self.client = Some((ca, client.clone()));
        Ok(client)
    }

    /// POST `{"trainerStatus": status}` with the token as it is now.
    pub async fn post(&mut self, status: &super::Status) -> Result<(), String> {
        let token = std::fs::read_to_string(&self.cfg.token_file)
            .map_err(|e| format!("cannot read the token file {}: {e}", self.cfg.token_file.display()))?;
        let token = token.trim();
        if token.is_empty() {
            return Err(format!("the token file {} is empty", self.cfg.token_file.display()));
        }
        let client = self.client()?;
        let body = serde_json::to_vec(&serde_json::json!({ "trainerStatus": status })).unwrap_or_default();
        let resp = client
            .post(&self.cfg.url)
            .bearer_auth(token)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| crate::error::error_chain(&e))?;
        let code = resp.status();
        if code.is_success() {
            return Ok(());
        }
        // The server's words are data: printable ASCII, bounded.
        let text = resp.text().await.unwrap_or_default();
        let shown: String = text.chars().filter(|c| c.is_ascii_graphic() || *c == ' ').take(200).collect();
        Err(format!("HTTP {code}: {shown}"))
    }
}
