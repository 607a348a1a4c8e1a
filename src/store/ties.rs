//! Keys tied to the connection that last SET them (`State::tie`): the
//! agents' store ties each agent's heartbeat key to its heartbeat
//! connection. When that connection is closed by its peer (EOF or a reset:
//! the process died, its kernel closed its sockets) the key's value becomes
//! [`LOST`], its waiters wake, and `State::losses` counts it, so that the
//! store host learns of a death at once instead of after the heartbeat
//! timeout. This is the bookkeeping: which connection holds which keys.

use std::collections::HashMap;

/// A connection of the store (the store's own connection id).
type ConnId = u64;

/// The value a tied key takes when its connection is closed by its peer.
pub const LOST: &[u8] = b"lost";

/// Most keys one connection holds tied: an agent's heartbeat connection
/// sets one; a client that sets more holds no more ties (their keys stay
/// as written), so ties never grow past this per connection, and a store
/// holds at most this many per open connection.
pub const TIES_PER_CONN: usize = 8;

/// Longest key tied: an agent's heartbeat key is well under it; a longer
/// key SET by a client is stored but never tied (ties are outside the
/// store's memory budget, so each is small: at most `TIES_PER_CONN` times
/// twice this per open connection).
pub const MAX_TIED_KEY: usize = 1024;

/// Which SETs tie their key to the connection: `(key, value)` -> tie
/// (true) or untie (false: e.g. a heartbeat's `bye`, its agent left).
pub type TieRule = fn(&[u8], &[u8]) -> bool;

/// Which connection each tied key is tied to, both ways.
#[derive(Debug, Default)]
pub(super) struct Ties {
    by_key: HashMap<Vec<u8>, ConnId>,
    by_conn: HashMap<ConnId, Vec<Vec<u8>>>,
}

impl Ties {
    /// `conn` set `key` to a value the rule ties (`tie`) or unties: the key
    /// is tied to `conn` now (room allowing), or to nobody. A tie never
    /// moves back to an older connection (ids rise with each connection):
    /// a SET still in flight on a connection its agent has replaced may be
    /// read after the new connection's, and that old connection's close
    /// must not take the key.
    pub(super) fn set(&mut self, conn: ConnId, key: &[u8], tie: bool) {
        let before = self.by_key.get(key).copied();
        if tie && before.is_some_and(|b| b >= conn) {
            return;
        }
        self.forget(key);
        let held = self.by_conn.get(&conn).map_or(0, Vec::len);
        if tie && held < TIES_PER_CONN && key.len() <= MAX_TIED_KEY {
            self.by_conn.entry(conn).or_default().push(key.to_vec());
            self.by_key.insert(key.to_vec(), conn);
        }
    }

    /// `key` is tied to nobody (it was deleted, or is tied anew).
    pub(super) fn forget(&mut self, key: &[u8]) {
        if let Some(conn) = self.by_key.remove(key)
            && let Some(keys) = self.by_conn.get_mut(&conn)
        {
            keys.retain(|k| k != key);
            if keys.is_empty() {
                self.by_conn.remove(&conn);
            }
        }
    }

    /// The keys tied to `conn`, untied (it closed).
    pub(super) fn take(&mut self, conn: ConnId) -> Vec<Vec<u8>> {
        let keys = self.by_conn.remove(&conn).unwrap_or_default();
        for k in &keys {
            self.by_key.remove(k);
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tie_follows_the_last_writer_and_an_untying_value_frees_it() {
        let mut t = Ties::default();
        t.set(1, b"hb/x", true);
        t.set(1, b"hb/x", true);
        // Reconnected: the new connection beats; the old one holds nothing.
        t.set(2, b"hb/x", true);
        assert!(t.take(1).is_empty());
        // `bye` from any connection unties.
        t.set(3, b"hb/x", false);
        assert!(t.take(2).is_empty());
        assert!(t.take(3).is_empty());
        // At most TIES_PER_CONN per connection.
        for i in 0..TIES_PER_CONN + 3 {
            t.set(4, format!("hb/{i}").as_bytes(), true);
        }
        assert_eq!(t.take(4).len(), TIES_PER_CONN);
        assert!(t.by_key.is_empty() && t.by_conn.is_empty());
    }

    #[test]
    fn a_tie_never_moves_back_to_an_older_connection() {
        let mut t = Ties::default();
        t.set(5, b"hb/x", true);
        // Its agent redialled: the new connection's beat is read first,
        // then one still in flight on the old connection.
        t.set(9, b"hb/x", true);
        t.set(5, b"hb/x", true);
        assert!(t.take(5).is_empty(), "the old connection's close takes nothing");
        assert_eq!(t.take(9), vec![b"hb/x".to_vec()]);
    }

    #[test]
    fn long_keys_are_not_tied_and_a_deleted_key_is_untied() {
        let mut t = Ties::default();
        t.set(1, &vec![b'k'; MAX_TIED_KEY + 1], true);
        assert!(t.take(1).is_empty());
        t.set(2, b"hb/a", true);
        t.set(2, b"hb/b", true);
        t.forget(b"hb/a");
        assert_eq!(t.take(2), vec![b"hb/b".to_vec()]);
        t.forget(b"hb/none");
        assert!(t.by_key.is_empty() && t.by_conn.is_empty());
    }
}
