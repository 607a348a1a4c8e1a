//! A service of the round that one pod runs for every worker (XGBoost's
//! tracker): the store host's agent says when it is up, the others wait
//! for that before starting workers that would dial it.

use std::time::Duration;

use super::Error;
use super::session::{Round, Session, wait_on};

impl Session {
    /// Where round `r`'s PMI fences keep their keys (`--framework mpi`):
    /// under the round, so a new round has a fresh key-value space.
    pub fn pmi_keys(&self, r: u64) -> crate::keys::PmiKeys {
        self.keys.round_keys(r).pmi()
    }

    /// Say whether the round's service is up: `ready`, or why not.
    pub async fn publish_service(&mut self, r: u64, state: Result<(), String>) -> Result<(), Error> {
        let value = match state {
            Ok(()) => "ready".to_string(),
            Err(why) => format!("failed: {why}"),
        };
        let key = self.keys.round_keys(r).service();
        self.store.client.set(&key, value.as_bytes()).await.map_err(|e| self.lost(e))
    }

    /// Wait up to `limit` for the round's service, or for the round's end
    /// (its host failed or stopped first). `Ok(None)` when the limit passed.
    pub async fn wait_service(&mut self, round: &Round, limit: Duration) -> Result<Option<String>, Error> {
        let service = self.keys.round_keys(round.number).service();
        let end = self.keys.round_keys(round.number).end();
        let (dial, s, e) = (self.dial(), std::slice::from_ref(&service), std::slice::from_ref(&end));
        let up = tokio::select! {
            up = wait_on(dial.clone(), s, limit) => up,
            ended = wait_on(dial.clone(), e, limit) => ended,
        }
        .map_err(|e| self.lost(e))?;
        if !up {
            return Ok(None);
        }
        let v = self.get(&service).await?;
        Ok(Some(if v.is_empty() {
            "the round ended first".to_string()
        } else {
            String::from_utf8_lossy(&v).into_owned()
        }))
    }
}
