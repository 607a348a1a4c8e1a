//! A bounded waiting room for connections that have not yet proved a
//! credential (the control API's clients before their token, the guarded
//! store's before its handshake): at most `cap`, and when it is full a new
//! connection evicts the oldest of the source (an IPv4 address, an IPv6
//! /64) that holds the most places, so that a flood of idle or slow
//! connections holds at most `cap` descriptors, never locks out a client
//! that proves itself at once, and from one source (or a few) never
//! evicts a client from another, however long its head takes to arrive
//! (a client behind a port-forward over a WAN). A Unix socket's peers are
//! told apart by their process ([`Source::process`]). Like OpenSSH's
//! `PerSourceMaxStartups`, without refusing anyone outright.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

use tokio_util::sync::CancellationToken;

/// Where connections come from, as the lobby shares its places: an IPv4
/// address, or an IPv6 address's /64 (what one host can hold).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source(u128);

impl Source {
    /// A local process (a Unix socket's peer, by its pid): never equal to
    /// an address.
    pub fn process(pid: i32) -> Self {
        Source((1 << 127) | u128::from(pid.unsigned_abs()))
    }
}

impl From<IpAddr> for Source {
    fn from(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Source(u128::from(u32::from(v4))),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source(u128::from(u32::from(v4))),
                None => Source((u128::from(v6) & !u128::from(u64::MAX)) | (1 << 32)),
            },
        }
    }
}

/// The connections that have not yet shown a credential, at most `cap`
/// (see the module doc). Against many idle or slow connections this keeps
/// a place for a client that sends its head at once (its head is read and
/// judged long before `cap` newer connections come), and for every client
/// of a source other than the flood's; a plain limit would refuse
/// everyone until the slow ones time out.
#[derive(Debug)]
pub struct Lobby {
    cap: usize,
    waiting: std::sync::Mutex<Waiting>,
}

/// The lobby's places: oldest first, and how many each source holds.
#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    queue: VecDeque<(u64, Source, CancellationToken)>,
    held: HashMap<Source, usize>,
}

impl Waiting {
    fn remove_at(&mut self, i: usize) -> Option<CancellationToken> {
        let (_, source, token) = self.queue.remove(i)?;
        if let Some(n) = self.held.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&source);
            }
        }
        Some(token)
    }

    /// The oldest place of the source holding the most: `from`'s own when
    /// it is among the largest (a source evicts itself before another),
    /// else the oldest place of any of them.
    fn to_evict(&self, from: Source) -> Option<usize> {
        let most = self.held.values().copied().max()?;
        let victim =
            |s: &Source| if self.held.get(&from) == Some(&most) { *s == from } else { self.held.get(s) == Some(&most) };
        self.queue.iter().position(|(_, s, _)| victim(s))
    }
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

    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a new connection from `from`, evicting when full.
    pub fn enter(self: &std::sync::Arc<Self>, from: impl Into<Source>) -> Ticket {
        let from = from.into();
        let evicted = CancellationToken::new();
        let mut w = self.waiting();
        while w.queue.len() >= self.cap.max(1) {
            let Some(i) = w.to_evict(from) else { break };
            if let Some(token) = w.remove_at(i) {
                token.cancel();
            }
        }
        w.next += 1;
        let number = w.next;
        w.queue.push_back((number, from, evicted.clone()));
        *w.held.entry(from).or_default() += 1;
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
        if let Some(i) = w.queue.iter().position(|(n, _, _)| *n == self.number) {
            w.remove_at(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[tokio::test]
    async fn a_full_lobby_evicts_its_oldest() {
        let lobby = Lobby::new(2);
        let one = ip("10.0.0.1");
        let (a, b, c) = (lobby.enter(one), lobby.enter(one), lobby.enter(one));
        assert!(a.evicted.is_cancelled() && !b.evicted.is_cancelled() && !c.evicted.is_cancelled());
        a.evicted().await;
        drop(b);
        let d = lobby.enter(one);
        assert!(!c.evicted.is_cancelled() && !d.evicted.is_cancelled(), "a place given up is taken first");
        drop((a, c, d));
        assert!(lobby.waiting().queue.is_empty() && lobby.waiting().held.is_empty());
    }

    #[tokio::test]
    async fn a_flood_from_one_source_evicts_only_its_own() {
        let lobby = Lobby::new(4);
        let client = lobby.enter(ip("10.0.0.9"));
        let flood: Vec<Ticket> = (0..1000).map(|_| lobby.enter(ip("10.0.0.1"))).collect();
        assert!(!client.evicted.is_cancelled(), "the other source's connection keeps its place");
        assert_eq!(flood.iter().filter(|t| !t.evicted.is_cancelled()).count(), 3);
        // Two flooding sources share what the client leaves; a source
        // holding the most evicts itself first.
        let other: Vec<Ticket> = (0..10).map(|_| lobby.enter(ip("10.0.0.2"))).collect();
        assert!(!client.evicted.is_cancelled());
        let live = |t: &[Ticket]| t.iter().filter(|t| !t.evicted.is_cancelled()).count();
        assert_eq!((live(&flood), live(&other)), (1, 2), "the newest source evicted the largest");
        // An IPv6 /64 is one source; an IPv4-mapped address is its IPv4 one.
        assert_eq!(Source::from(ip("2001:db8::1")), Source::from(ip("2001:db8::ffff:1")));
        assert_ne!(Source::from(ip("2001:db8::1")), Source::from(ip("2001:db8:0:1::1")));
        assert_eq!(Source::from(ip("::ffff:10.0.0.1")), Source::from(ip("10.0.0.1")));
        assert_ne!(Source::from(ip("::a00:1")), Source::from(ip("10.0.0.1")), "v6 never meets v4");
        drop((client, flood, other));
        assert!(lobby.waiting().queue.is_empty() && lobby.waiting().held.is_empty());
    }

    #[tokio::test]
    async fn of_the_sources_holding_the_most_the_oldest_place_goes() {
        let lobby = Lobby::new(4);
        let (a, b) = (ip("10.0.1.1"), ip("10.0.1.2"));
        let (a1, b1, a2, b2) = (lobby.enter(a), lobby.enter(b), lobby.enter(a), lobby.enter(b));
        let c = lobby.enter(ip("10.0.1.3"));
        let d = lobby.enter(ip("10.0.1.4"));
        let gone: Vec<bool> = [&a1, &b1, &a2, &b2, &c, &d].iter().map(|t| t.evicted.is_cancelled()).collect();
        assert_eq!(gone, [true, true, false, false, false, false], "a1, then b1 (B held the most)");
    }
}
