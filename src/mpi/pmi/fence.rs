//! The job-wide fence over the agents' store: each pod writes its puts as
//! one value, one store BARRIER waits for every pod, one MULTI_GET reads
//! every pod's value. Three round trips per pod per fence, whatever the
//! number of ranks and keys (issue 29).

use super::server::Fence;
use crate::keys::PmiKeys;
use crate::store::{Client, Dial};

/// The most bytes of one key or value in a pod's blob (a hostile or broken
/// pod's value is checked, never trusted).
const MAX_FIELD: usize = 1 << 20;

/// A fence of pod `node` of `nnodes`, on keys under `prefix` (one prefix
/// per run and attempt: a restarted attempt starts from a fresh space).
pub struct StoreFence {
    /// How to reach the job's store.
    pub dial: Dial,
    /// The connection, made at the first fence (its own: the agent's
    /// session is busy with the round).
    pub client: Option<Client>,
    /// Its keys: under `trainlet/<run>/j<jobset attempt>/r<round>/pmi`.
    pub keys: PmiKeys,
    /// This pod's node rank.
    pub node: usize,
    /// Pods in the job.
    pub nnodes: usize,
}

/// `puts` as one value: for each, the key's and the value's length (u32,
/// big-endian) and bytes.
pub fn encode(puts: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in puts {
        for field in [k, v] {
            out.extend_from_slice(&u32::try_from(field.len()).unwrap_or(u32::MAX).to_be_bytes());
            out.extend_from_slice(field.as_bytes());
        }
    }
    out
}

/// The puts of one pod's value, or why it is not one.
pub fn decode(mut blob: &[u8]) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let field = |blob: &mut &[u8]| -> Result<String, String> {
        let (len, rest) = blob.split_first_chunk::<4>().ok_or("a length cut short")?;
        let len = u32::from_be_bytes(*len) as usize;
        if len > MAX_FIELD || len > rest.len() {
            return Err(format!("a field of {len} bytes where {} are left", rest.len()));
        }
        let (text, rest) = rest.split_at(len);
        *blob = rest;
        String::from_utf8(text.to_vec()).map_err(|_| "a field that is not UTF-8".to_string())
    };
    while !blob.is_empty() {
        let k = field(&mut blob)?;
        let v = field(&mut blob)?;
        out.push((k, v));
    }
    Ok(out)
}

impl Fence for StoreFence {
    async fn fence(&mut self, seq: u64, puts: Vec<(String, String)>) -> Result<Vec<(String, String)>, String> {
        let key = |n: usize| self.keys.puts(seq, n);
        let why = |e: crate::store::ClientError| format!("PMI fence {seq}: {}", crate::error::error_chain(&e));
        let blob = encode(&puts);
        if blob.len() as u64 > crate::store::MAX_VALUE_LEN {
            return Err(format!(
                "PMI fence {seq}: this pod's {} puts take {} bytes, over the store's 8 MiB for one value",
                puts.len(),
                blob.len()
            ));
        }
        let client = match &mut self.client {
            Some(c) => c,
            None => self.client.insert(self.dial.connect().await.map_err(why)?),
        };
        client.set(&key(self.node), &blob).await.map_err(why)?;
        let pods = i64::try_from(self.nnodes).unwrap_or(i64::MAX);
        client.barrier(&self.keys.barrier(seq), pods).await.map_err(why)?;
        // Every pod came to this barrier after its reads of the last fence:
        // that fence's keys can go (the store stays small however many
        // fences the ranks make).
        if let Some(last) = seq.checked_sub(1) {
            client.delete_key(&self.keys.puts(last, self.node)).await.map_err(why)?;
            if self.node == 0 {
                client.delete_key(&self.keys.barrier(last)).await.map_err(why)?;
            }
        }
        let keys: Vec<String> = (0..self.nnodes).map(key).collect();
        let values = client.multi_get(&keys).await.map_err(why)?;
        let mut all = Vec::new();
        for (n, v) in values.iter().enumerate() {
            all.extend(decode(v).map_err(|e| format!("PMI fence {seq}: pod {n}'s puts: {e}"))?);
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::store::{Budget, StoreServer, bind_listener};

    #[test]
    fn blobs_round_trip_and_broken_ones_are_refused() {
        let puts = vec![("card-0".to_string(), "a b;c".to_string()), (String::new(), "é".to_string())];
        assert_eq!(decode(&encode(&puts)), Ok(puts));
        assert_eq!(decode(&[]), Ok(Vec::new()));
        assert!(decode(&[0, 0, 0]).is_err());
        assert!(decode(&[0, 0, 0, 9, b'x']).is_err());
        assert!(decode(&[0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(decode(&[0, 0, 0, 1, 0xff, 0, 0, 0, 0]).is_err());
        assert!(decode(&[0, 0, 0, 1, b'k']).is_err(), "a key without its value");
    }

    #[tokio::test]
    async fn three_pods_see_every_pods_puts_after_one_fence_each() {
        let cancel = CancellationToken::new();
        let listener = bind_listener(Some("127.0.0.1".parse().expect("ip")), 0).expect("bind");
        let server =
            StoreServer::start(listener, Arc::new(Budget::new(64 << 20)), cancel.child_token()).expect("serve");
        let addr = server.local_addr();
        let mut pods = Vec::new();
        for node in 0..3 {
            let dial = Dial { addr, guard: None };
            let mut fence = StoreFence {
                dial,
                client: None,
                keys: crate::keys::JobKeys::under("trainlet/r/j0").round_keys(0).pmi(),
                node,
                nnodes: 3,
            };
            pods.push(tokio::spawn(async move {
                let mine = vec![(format!("card-{node}"), format!("addr-{node}"))];
                let first = fence.fence(0, mine).await;
                let second = fence.fence(1, Vec::new()).await;
                (first, second)
            }));
        }
        for pod in pods {
            let (first, second) = pod.await.expect("pod");
            let mut first = first.expect("fence 0");
            first.sort();
            assert_eq!(first, (0..3).map(|n| (format!("card-{n}"), format!("addr-{n}"))).collect::<Vec<_>>());
            assert_eq!(second, Ok(Vec::new()));
        }
        cancel.cancel();
    }
}
