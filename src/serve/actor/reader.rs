//! The reader of an actor's operations on one pod: from the agents' store,
//! in order, each checked (sealed by this job's control API for this
//! serving session, this actor and this number) and handed to the bridge.

use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;
use tokio_util::sync::CancellationToken;

use super::event::{Event, Place};
use super::{Keys, OP_KIND, Op};
use crate::serve::Link;

/// How long the reader waits on one key before it looks whether the
/// control API removed it (a call that none of this pod's ranks ran).
const OP_POLL: Duration = Duration::from_secs(2);

/// Read the actor's operations in order, from the first of `round` (or,
/// when the control API has none for it yet, the next one it writes).
pub(super) async fn read_ops(
    place: Place,
    keys: Keys,
    (seq, round): (u64, u64),
    tx: UnboundedSender<Event>,
    cancel: CancellationToken,
) {
    let mut link = Link::new(place.dial.clone(), &place.base);
    let count = |v: Vec<u8>| std::str::from_utf8(&v).ok().and_then(|s| s.trim().parse::<u64>().ok()).unwrap_or(0);
    let mut n = {
        let ops = link.get(&keys.ops()).await.map(count).unwrap_or(0);
        match link.get(&keys.first(round)).await.map(count) {
            Ok(first) if first > 0 => first,
            _ => ops + 1,
        }
    };
    let mut warned = false;
    let mut token = crate::serve::read_token(&place.token_file).unwrap_or_default();
    // One connection while it answers; a wait cut short leaves a reply
    // pending on it, so it is dropped then.
    let mut conn: Option<crate::store::Client> = None;
    loop {
        let key = keys.op(n);
        let waited = async {
            let mut c = match conn.take() {
                Some(c) => c,
                None => place.dial.connect().await?,
            };
            c.wait(std::slice::from_ref(&key)).await?;
            let v = c.get(&key).await?;
            Ok::<_, crate::store::ClientError>((c, v))
        };
        let waited = tokio::select! {
            () = cancel.cancelled() => return,
            w = tokio::time::timeout(OP_POLL, waited) => w,
        };
        let value = match waited {
            Ok(Ok((c, v))) if !v.is_empty() => {
                conn = Some(c);
                v
            }
            Ok(Err(e)) => {
                if !std::mem::replace(&mut warned, true) {
                    tracing::warn!(actor = seq, error = %crate::error::error_chain(&e), "cannot read the actor's calls from the store; retrying");
                }
                tokio::time::sleep(OP_POLL).await;
                continue;
            }
            // Not there: removed (a call none of this pod's ranks ran), or
            // not written yet.
            _ => {
                if link.get(&keys.ops()).await.map(count).unwrap_or(0) >= n && !link.exists(&key).await.unwrap_or(true)
                {
                    n += 1;
                }
                continue;
            }
        };
        warned = false;
        if crate::serve::unseal(&token, &place.scope, OP_KIND, n, &value).is_err() {
            // The token may have been rotated since.
            token = crate::serve::read_token(&place.token_file).unwrap_or_default();
        }
        let op = crate::serve::unseal(&token, &place.scope, OP_KIND, n, &value)
            .map_err(str::to_string)
            .and_then(|p| serde_json::from_slice::<Op>(p).map_err(|e| e.to_string()))
            .and_then(
                |op| if op.actor == seq && op.n == n { Ok(op) } else { Err("for another actor or number".into()) },
            );
        match op {
            Ok(op) => {
                if tx.send(Event::Op(op)).is_err() {
                    return;
                }
            }
            Err(why) => {
                tracing::error!(actor = seq, op = n, reason = %why, "refused an actor operation in the store: not this job's control API's")
            }
        }
        n += 1;
    }
}
