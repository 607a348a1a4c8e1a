//! A bounded waiting room for connections that have not yet proved a
//! credential (the control API's clients before their token, the guarded
//! store's before its handshake): at most `cap`, and a new connection
//! evicts the oldest, so that a flood of idle or slow connections holds at
//! most `cap` descriptors and never locks out a client that proves itself
//! at once.

use tokio_util::sync::CancellationToken;

/// The connections that have not yet shown a credential, at most `cap`:
/// a new one evicts the oldest. Against many idle or slow connections this
/// keeps a place for a client that sends its head at once (its head is
/// read and judged long before `cap` newer connections come), where a
/// plain limit would refuse everyone until the slow ones time out.
#[derive(Debug)]
pub struct Lobby {
    cap: usize,
    /// Oldest first: (ticket number, evicts it).
    waiting: std::sync::Mutex<(u64, std::collections::VecDeque<(u64, CancellationToken)>)>,
}

/// A place in a [`Lobby`], given up when dropped.
#[derive(Debug)]
pub struct Ticket {
    lobby: std::sync::Arc<Lobby>,
    number: u64,
    evicted: CancellationToken,
}

impl Lobby {
    /// A lobby of at most `cap` connections.
    pub fn new(cap: usize) -> std::sync::Arc<Lobby> {
        std::sync::Arc::new(Lobby { cap, waiting: std::sync::Mutex::default() })
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, (u64, std::collections::VecDeque<(u64, CancellationToken)>)> {
        self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a new connection, evicting the oldest when full.
    pub fn enter(self: &std::sync::Arc<Self>) -> Ticket {
        let evicted = CancellationToken::new();
        let mut w = self.waiting();
        while w.1.len() >= self.cap.max(1) {
            if let Some((_, oldest)) = w.1.pop_front() {
                oldest.cancel();
            }
        }
        w.0 += 1;
        let number = w.0;
        w.1.push_back((number, evicted.clone()));
        drop(w);
        Ticket { lobby: std::sync::Arc::clone(self), number, evicted }
    }
}

impl Ticket {
    /// Returns once a newer connection has taken this one's place.
    pub async fn evicted(&self) {
        self.evicted.cancelled().await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut w = self.lobby.waiting();
        if let Some(i) = w.1.iter().position(|(n, _)| *n == self.number) {
            w.1.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_lobby_evicts_its_oldest() {
        let lobby = Lobby::new(2);
        let (a, b, c) = (lobby.enter(), lobby.enter(), lobby.enter());
        assert!(a.evicted.is_cancelled() && !b.evicted.is_cancelled() && !c.evicted.is_cancelled());
        a.evicted().await;
        drop(b);
        let d = lobby.enter();
        assert!(!c.evicted.is_cancelled() && !d.evicted.is_cancelled(), "a place given up is taken first");
        drop((a, c, d));
        assert!(lobby.waiting().1.is_empty());
    }
}
