//! TCPStore framing: one query-type byte, then little-endian fields.
//!
//! Strings and byte values are a `u64` length and raw bytes; key lists are a
//! `u64` count and that many strings; integers are `i64`. Decoding is
//! check-then-parse over a borrowed buffer: it either returns a whole
//! [`Command`] and how many bytes it used, or says the frame is
//! [`DecodeError::Incomplete`] (read more) or [`DecodeError::Invalid`] (close
//! the connection). Lengths are checked against the libuv limits before any
//! allocation, so a hostile length cannot make the server reserve memory.
//!
//! The server does not re-decode a frame that arrives in pieces: a
//! [`Scanner`] walks it once, field by field, remembering where it stopped,
//! and refuses it as soon as a length field would take it past
//! [`MAX_FRAME_LEN`], before the bytes arrive. Only a whole frame is then
//! decoded (once).

/// The u32 every client sends in VALIDATE (`validationMagicNumber`).
pub const MAGIC: u32 = 0x3C85_F7CE;
/// Longest key the libuv backend accepts (`MAX_STRING_LEN`).
pub const MAX_KEY_LEN: u64 = 8 * 1024;
/// Longest value the libuv backend accepts (`MAX_PAYLOAD_LEN`).
pub const MAX_VALUE_LEN: u64 = 8 * 1024 * 1024;
/// Most keys in one CHECK/WAIT/MULTI_GET/MULTI_SET (`MAX_KEY_COUNT`).
pub const MAX_KEY_COUNT: u64 = 128 * 1024;
/// Most bytes in one frame: room for a COMPARE_SET of two largest values,
/// or a MULTI_SET of many values, and a bound on what one connection can
/// make the server buffer.
pub const MAX_FRAME_LEN: u64 = 64 * 1024 * 1024;

/// One request, as decoded from the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// 0: handshake; must be the first message on a connection.
    Validate(u32),
    /// 1: overwrite a key (no reply).
    Set {
        /// Key bytes.
        key: Vec<u8>,
        /// Value bytes.
        value: Vec<u8>,
    },
    /// 2: compare-and-set; replies with the resulting or current value.
    CompareSet {
        /// Key bytes.
        key: Vec<u8>,
        /// Value the caller expects.
        expected: Vec<u8>,
        /// Value to store on a match.
        desired: Vec<u8>,
    },
    /// 3: read a key; a missing key reads as empty bytes (libuv).
    Get(Vec<u8>),
    /// 4: add to an ASCII-decimal counter; replies with the new value.
    Add {
        /// Key bytes.
        key: Vec<u8>,
        /// Amount to add.
        delta: i64,
    },
    /// 5: are all keys present?
    Check(Vec<Vec<u8>>),
    /// 6: reply once all keys are present.
    Wait(Vec<Vec<u8>>),
    /// 7: number of keys.
    GetNumKeys,
    /// 8: delete a key; replies 0 or 1.
    DeleteKey(Vec<u8>),
    /// 9: append to a value (no reply).
    Append {
        /// Key bytes.
        key: Vec<u8>,
        /// Value bytes.
        value: Vec<u8>,
    },
    /// 10: read several keys.
    MultiGet(Vec<Vec<u8>>),
    /// 11: write several keys (no reply).
    MultiSet(Vec<(Vec<u8>, Vec<u8>)>),
    /// 12: drop this connection's parked waits.
    CancelWait,
    /// 13: liveness; echoes the nonce.
    Ping(u32),
    /// 14: push onto a FIFO (no reply).
    QueuePush {
        /// Key bytes.
        key: Vec<u8>,
        /// Value bytes.
        value: Vec<u8>,
    },
    /// 15: pop from a FIFO.
    QueuePop(Vec<u8>),
    /// 16: FIFO length.
    QueueLen(Vec<u8>),
    /// 17: every key.
    ListKeys,
    /// 18: count arrivals at `key`; reply when `world_size` have arrived.
    Barrier {
        /// Key bytes.
        key: Vec<u8>,
        /// Arrivals that release the barrier.
        world_size: i64,
    },
    /// 64 (trainlet's, not torch's): a step of a guarded store's
    /// handshake (`crate::store::Guard`): a nonce, then a proof.
    Auth(Vec<u8>),
}

/// The query type of [`Command::Auth`], far from torch's.
pub const AUTH: u8 = 64;

/// Why a buffer does not hold a whole valid frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// The frame continues past the end of the buffer.
    Incomplete,
    /// The bytes can never become a valid frame.
    Invalid(Invalid),
}

/// What made a frame invalid; logged when the connection is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    /// The first byte is not a known query type.
    #[error("unknown query type {0}")]
    UnknownQuery(u8),
    /// A key longer than [`MAX_KEY_LEN`].
    #[error("key of {0} bytes exceeds the 8 KiB limit")]
    KeyTooLong(u64),
    /// A value longer than [`MAX_VALUE_LEN`].
    #[error("value of {0} bytes exceeds the 8 MiB limit")]
    ValueTooLong(u64),
    /// More keys than [`MAX_KEY_COUNT`] in one request.
    #[error("{0} keys in one request exceed the limit of 131072")]
    TooManyKeys(u64),
    /// A frame whose length fields add up past [`MAX_FRAME_LEN`].
    #[error("a frame of at least {0} bytes exceeds the 64 MiB limit")]
    FrameTooLong(u64),
}

/// One field of a frame, as the [`Scanner`] walks it.
#[derive(Debug, Clone, Copy)]
enum Field {
    U32,
    I64,
    Key,
    Value,
    /// A count, then that many keys.
    Keys,
    /// A count, then that many (key, value) pairs.
    Pairs,
}

/// The fields after the query-type byte.
fn layout(query: u8) -> Result<&'static [Field], Invalid> {
    use Field::{I64, Key, Keys, Pairs, U32, Value};
    Ok(match query {
        0 | 13 => &[U32],
        1 | 9 | 14 => &[Key, Value],
        2 => &[Key, Value, Value],
        3 | 8 | 15 | 16 | AUTH => &[Key],
        4 | 18 => &[Key, I64],
        5 | 6 | 10 => &[Keys],
        7 | 12 | 17 => &[],
        11 => &[Pairs],
        other => return Err(Invalid::UnknownQuery(other)),
    })
}

/// Finds where a frame ends without decoding it, resuming where the last
/// call stopped, so a frame that arrives in many pieces is walked once
/// (linear time) instead of re-decoded from its start on every read.
#[derive(Debug, Default)]
pub struct Scanner {
    /// Bytes of the frame accepted so far (whole fields only).
    pos: usize,
    /// Fields done.
    field: usize,
    /// Items left in the current list, once its count is read.
    items: Option<u64>,
    /// Inside a pair: its key is done.
    half: bool,
}

impl Scanner {
    /// Walk on through the frame at the front of `buf` (the same frame as
    /// the last call, with more bytes). Some(length) once it is whole;
    /// the scanner is then reset for the next frame.
    pub fn scan(&mut self, buf: &[u8]) -> Result<Option<usize>, Invalid> {
        let Some(&query) = buf.first() else { return Ok(None) };
        let fields = layout(query)?;
        self.pos = self.pos.max(1);
        while let Some(&field) = fields.get(self.field) {
            let done = match field {
                Field::U32 => self.fixed(buf, 4)?,
                Field::I64 => self.fixed(buf, 8)?,
                Field::Key => self.string(buf, MAX_KEY_LEN, Invalid::KeyTooLong)?,
                Field::Value => self.string(buf, MAX_VALUE_LEN, Invalid::ValueTooLong)?,
                Field::Keys | Field::Pairs => self.list(buf, matches!(field, Field::Pairs))?,
            };
            if !done {
                return Ok(None);
            }
            self.field += 1;
        }
        let len = self.pos;
        *self = Self::default();
        Ok(Some(len))
    }

    /// Bytes of the current frame already known to be well formed.
    pub fn scanned(&self) -> usize {
        self.pos
    }

    /// Accept `n` more bytes of the frame if they are in `buf`, never past the frame limit.
    fn take(&mut self, buf: &[u8], n: u64) -> Result<bool, Invalid> {
        let end = (self.pos as u64).saturating_add(n);
        if end > MAX_FRAME_LEN {
            return Err(Invalid::FrameTooLong(end));
        }
        // `end` <= MAX_FRAME_LEN fits in usize on every supported target.
        let end = usize::try_from(end).map_err(|_| Invalid::FrameTooLong(end))?;
        if buf.len() < end {
            return Ok(false);
        }
        self.pos = end;
        Ok(true)
    }

    fn fixed(&mut self, buf: &[u8], n: u64) -> Result<bool, Invalid> {
        self.take(buf, n)
    }

    /// The u64 at the scan position, if it has arrived.
    fn peek_u64(&self, buf: &[u8]) -> Option<u64> {
        let raw = buf.get(self.pos..self.pos.checked_add(8)?)?;
        let mut b = [0u8; 8];
        b.copy_from_slice(raw);
        Some(u64::from_le_bytes(b))
    }

    /// A length-prefixed string, accepted whole or not at all; its length
    /// is checked against `limit` and the frame limit as soon as it arrives.
    fn string(&mut self, buf: &[u8], limit: u64, too_long: fn(u64) -> Invalid) -> Result<bool, Invalid> {
        let Some(len) = self.peek_u64(buf) else { return Ok(false) };
        if len > limit {
            return Err(too_long(len));
        }
        self.take(buf, 8 + len)
    }

    fn list(&mut self, buf: &[u8], pairs: bool) -> Result<bool, Invalid> {
        let mut left = match self.items {
            Some(n) => n,
            None => {
                let Some(n) = self.peek_u64(buf) else { return Ok(false) };
                if n > MAX_KEY_COUNT {
                    return Err(Invalid::TooManyKeys(n));
                }
                // Every item needs at least one (pairs: two) length prefixes.
                let least = n.saturating_mul(if pairs { 16 } else { 8 });
                let end = (self.pos as u64).saturating_add(8).saturating_add(least);
                if end > MAX_FRAME_LEN {
                    return Err(Invalid::FrameTooLong(end));
                }
                self.take(buf, 8)?;
                n
            }
        };
        while left > 0 {
            if pairs && !self.half {
                if !self.string(buf, MAX_KEY_LEN, Invalid::KeyTooLong)? {
                    self.items = Some(left);
                    return Ok(false);
                }
                self.half = true;
            }
            let (limit, too_long): (u64, fn(u64) -> Invalid) =
                if pairs { (MAX_VALUE_LEN, Invalid::ValueTooLong) } else { (MAX_KEY_LEN, Invalid::KeyTooLong) };
            if !self.string(buf, limit, too_long)? {
                self.items = Some(left);
                return Ok(false);
            }
            self.half = false;
            left -= 1;
        }
        self.items = None;
        Ok(true)
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Incomplete)?;
        let slice = self.buf.get(self.pos..end).ok_or(DecodeError::Incomplete)?;
        self.pos = end;
        Ok(slice)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(raw))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(raw))
    }

    fn i64(&mut self) -> Result<i64, DecodeError> {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(self.take(8)?);
        Ok(i64::from_le_bytes(raw))
    }

    fn sized(&mut self, limit: u64, too_long: fn(u64) -> Invalid) -> Result<Vec<u8>, DecodeError> {
        let len = self.u64()?;
        if len > limit {
            return Err(DecodeError::Invalid(too_long(len)));
        }
        // The limit keeps `len` far below usize::MAX on every supported target.
        let len = usize::try_from(len).map_err(|_| DecodeError::Invalid(too_long(len)))?;
        Ok(self.take(len)?.to_vec())
    }

    fn key(&mut self) -> Result<Vec<u8>, DecodeError> {
        self.sized(MAX_KEY_LEN, Invalid::KeyTooLong)
    }

    fn value(&mut self) -> Result<Vec<u8>, DecodeError> {
        self.sized(MAX_VALUE_LEN, Invalid::ValueTooLong)
    }

    fn count(&mut self) -> Result<usize, DecodeError> {
        let n = self.u64()?;
        if n > MAX_KEY_COUNT {
            return Err(DecodeError::Invalid(Invalid::TooManyKeys(n)));
        }
        usize::try_from(n).map_err(|_| DecodeError::Invalid(Invalid::TooManyKeys(n)))
    }

    fn keys(&mut self) -> Result<Vec<Vec<u8>>, DecodeError> {
        let n = self.count()?;
        // Do not trust `n` for the allocation: each key needs at least 8 bytes.
        let mut keys = Vec::with_capacity(n.min(self.buf.len() / 8 + 1));
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

impl Command {
    /// Decode one frame from the front of `buf`; returns it and its length.
    pub fn decode(buf: &[u8]) -> Result<(Command, usize), DecodeError> {
        let mut c = Cursor { buf, pos: 0 };
        let cmd = match c.u8()? {
            0 => Command::Validate(c.u32()?),
            1 => Command::Set { key: c.key()?, value: c.value()? },
            2 => Command::CompareSet { key: c.key()?, expected: c.value()?, desired: c.value()? },
            3 => Command::Get(c.key()?),
            4 => Command::Add { key: c.key()?, delta: c.i64()? },
            5 => Command::Check(c.keys()?),
            6 => Command::Wait(c.keys()?),
            7 => Command::GetNumKeys,
            8 => Command::DeleteKey(c.key()?),
            9 => Command::Append { key: c.key()?, value: c.value()? },
            10 => Command::MultiGet(c.keys()?),
            11 => {
                let n = c.count()?;
                let mut pairs = Vec::with_capacity(n.min(buf.len() / 16 + 1));
                for _ in 0..n {
                    pairs.push((c.key()?, c.value()?));
                }
                Command::MultiSet(pairs)
            }
            12 => Command::CancelWait,
            13 => Command::Ping(c.u32()?),
            14 => Command::QueuePush { key: c.key()?, value: c.value()? },
            15 => Command::QueuePop(c.key()?),
            16 => Command::QueueLen(c.key()?),
            17 => Command::ListKeys,
            18 => Command::Barrier { key: c.key()?, world_size: c.i64()? },
            AUTH => Command::Auth(c.key()?),
            other => return Err(DecodeError::Invalid(Invalid::UnknownQuery(other))),
        };
        Ok((cmd, c.pos))
    }

    /// Append this request's wire form to `out` (used by the client).
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Command::Validate(magic) => {
                out.push(0);
                out.extend_from_slice(&magic.to_le_bytes());
            }
            Command::Set { key, value } => pair(out, 1, key, value),
            Command::CompareSet { key, expected, desired } => {
                out.push(2);
                put_bytes(out, key);
                put_bytes(out, expected);
                put_bytes(out, desired);
            }
            Command::Get(key) => single(out, 3, key),
            Command::Add { key, delta } => {
                single(out, 4, key);
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Command::Check(keys) => list(out, 5, keys),
            Command::Wait(keys) => list(out, 6, keys),
            Command::GetNumKeys => out.push(7),
            Command::DeleteKey(key) => single(out, 8, key),
            Command::Append { key, value } => pair(out, 9, key, value),
            Command::MultiGet(keys) => list(out, 10, keys),
            Command::MultiSet(pairs) => {
                out.push(11);
                put_u64(out, pairs.len());
                for (k, v) in pairs {
                    put_bytes(out, k);
                    put_bytes(out, v);
                }
            }
            Command::CancelWait => out.push(12),
            Command::Ping(nonce) => {
                out.push(13);
                out.extend_from_slice(&nonce.to_le_bytes());
            }
            Command::QueuePush { key, value } => pair(out, 14, key, value),
            Command::QueuePop(key) => single(out, 15, key),
            Command::QueueLen(key) => single(out, 16, key),
            Command::ListKeys => out.push(17),
            Command::Barrier { key, world_size } => {
                single(out, 18, key);
                out.extend_from_slice(&world_size.to_le_bytes());
            }
            Command::Auth(step) => single(out, AUTH, step),
        }
    }
}

/// Append a `u64` length prefix.
pub(crate) fn put_u64(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&(n as u64).to_le_bytes());
}

/// Append a length-prefixed byte string.
pub(crate) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u64(out, bytes.len());
    out.extend_from_slice(bytes);
}

/// Append an `i64`.
pub(crate) fn put_i64(out: &mut Vec<u8>, n: i64) {
    out.extend_from_slice(&n.to_le_bytes());
}

fn single(out: &mut Vec<u8>, code: u8, key: &[u8]) {
    out.push(code);
    put_bytes(out, key);
}

fn pair(out: &mut Vec<u8>, code: u8, key: &[u8], value: &[u8]) {
    single(out, code, key);
    put_bytes(out, value);
}

fn list(out: &mut Vec<u8>, code: u8, keys: &[Vec<u8>]) {
    out.push(code);
    put_u64(out, keys.len());
    for k in keys {
        put_bytes(out, k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
    }

    // Byte captures from reference/torch.md section 1.5 (torch 2.15 client).
    #[test_case("00 cef7853c", Command::Validate(MAGIC); "validate")]
    #[test_case("0d 363f0000", Command::Ping(0x3f36); "ping")]
    #[test_case("01 0200000000000000 2f6b 0100000000000000 76",
        Command::Set { key: b"/k".to_vec(), value: b"v".to_vec() }; "set")]
    #[test_case("06 0100000000000000 0200000000000000 2f6b",
        Command::Wait(vec![b"/k".to_vec()]); "wait")]
    #[test_case("04 0400000000000000 2f636e74 0500000000000000",
        Command::Add { key: b"/cnt".to_vec(), delta: 5 }; "add")]
    #[test_case("0c", Command::CancelWait; "cancel wait")]
    #[test_case("11", Command::ListKeys; "list keys")]
    #[test_case("0b 0200000000000000 0300000000000000 2f6d31 0200000000000000 7831 0300000000000000 2f6d32 0300000000000000 793232",
        Command::MultiSet(vec![(b"/m1".to_vec(), b"x1".to_vec()), (b"/m2".to_vec(), b"y22".to_vec())]); "multi set")]
    fn decodes_captured_frames(bytes: &str, want: Command) {
        let raw = hex(bytes);
        let (got, used) = Command::decode(&raw).expect("decode");
        assert_eq!(got, want);
        assert_eq!(used, raw.len());
        let mut again = Vec::new();
        got.encode(&mut again);
        assert_eq!(again, raw, "encode must reproduce the capture");
    }

    #[test]
    fn every_strict_prefix_is_incomplete() {
        let mut raw = Vec::new();
        Command::CompareSet { key: b"/k".to_vec(), expected: b"v".to_vec(), desired: b"w".to_vec() }.encode(&mut raw);
        for cut in 0..raw.len() {
            assert_eq!(Command::decode(&raw[..cut]), Err(DecodeError::Incomplete), "cut at {cut}");
        }
    }

    #[test]
    fn pipelined_frames_decode_one_at_a_time() {
        let mut raw = Vec::new();
        Command::Set { key: b"a".to_vec(), value: b"1".to_vec() }.encode(&mut raw);
        Command::GetNumKeys.encode(&mut raw);
        let (first, used) = Command::decode(&raw).expect("first");
        assert!(matches!(first, Command::Set { .. }));
        assert_eq!(Command::decode(&raw[used..]), Ok((Command::GetNumKeys, 1)));
    }

    #[test_case(&[0xff], Invalid::UnknownQuery(0xff); "unknown type")]
    #[test_case(&[0x13], Invalid::UnknownQuery(0x13); "type after barrier")]
    fn rejects_unknown_types(raw: &[u8], want: Invalid) {
        assert_eq!(Command::decode(raw), Err(DecodeError::Invalid(want)));
    }

    fn frames() -> Vec<Vec<u8>> {
        let cmds = [
            Command::Validate(MAGIC),
            Command::CompareSet { key: b"/k".to_vec(), expected: b"v".to_vec(), desired: b"w".to_vec() },
            Command::Add { key: b"/n".to_vec(), delta: -3 },
            Command::Wait(vec![b"a".to_vec(), b"bb".to_vec(), Vec::new()]),
            Command::MultiSet(vec![(b"/m1".to_vec(), b"x1".to_vec()), (b"/m2".to_vec(), vec![7; 300])]),
            Command::MultiGet(Vec::new()),
            Command::ListKeys,
            Command::Barrier { key: b"/b".to_vec(), world_size: 4 },
        ];
        cmds.iter()
            .map(|c| {
                let mut raw = Vec::new();
                c.encode(&mut raw);
                raw
            })
            .collect()
    }

    #[test]
    fn the_scanner_finds_every_frame_end_fed_all_at_once_or_byte_by_byte() {
        for raw in frames() {
            let mut whole = Scanner::default();
            assert_eq!(whole.scan(&raw), Ok(Some(raw.len())), "{raw:?}");
            // One byte at a time: the scanner resumes where it stopped and
            // its progress (whole fields) only moves forward.
            let mut s = Scanner::default();
            let mut last = 0;
            for cut in 0..raw.len() {
                assert_eq!(s.scan(&raw[..cut]), Ok(None), "cut at {cut} of {raw:?}");
                assert!(s.scanned() >= last && s.scanned() <= cut, "progress went back at {cut}");
                last = s.scanned();
            }
            assert_eq!(s.scan(&raw), Ok(Some(raw.len())));
            assert_eq!(s.scanned(), 0, "reset for the next frame");
        }
    }

    #[test]
    fn the_scanner_refuses_a_frame_past_the_limit_as_soon_as_a_length_says_so() {
        // A MULTI_SET whose eighth 8 MiB value would pass 64 MiB: refused
        // when that value's length arrives, before its bytes.
        let mut raw = vec![11];
        raw.extend_from_slice(&9u64.to_le_bytes());
        let value = vec![0u8; 8 << 20];
        let mut s = Scanner::default();
        let mut refused = None;
        for i in 0..9 {
            put_bytes(&mut raw, format!("k{i}").as_bytes());
            raw.extend_from_slice(&MAX_VALUE_LEN.to_le_bytes());
            if let Err(e) = s.scan(&raw) {
                refused = Some((i, e));
                break;
            }
            raw.extend_from_slice(&value);
            assert_eq!(s.scan(&raw), Ok(None));
        }
        assert!(matches!(refused, Some((7, Invalid::FrameTooLong(_)))), "{refused:?}");
        // A count that cannot fit is refused at the count.
        let mut raw = vec![11];
        raw.extend_from_slice(&MAX_KEY_COUNT.to_le_bytes());
        assert_eq!(Scanner::default().scan(&raw), Ok(None), "128Ki pairs of 16 bytes fit");
        let mut raw = vec![2];
        put_bytes(&mut raw, b"k");
        raw.extend_from_slice(&(MAX_VALUE_LEN + 1).to_le_bytes());
        assert_eq!(Scanner::default().scan(&raw), Err(Invalid::ValueTooLong(MAX_VALUE_LEN + 1)));
        assert_eq!(Scanner::default().scan(&[0x42]), Err(Invalid::UnknownQuery(0x42)));
    }

    #[test]
    fn rejects_oversized_lengths_before_reading_them() {
        let mut raw = vec![3];
        raw.extend_from_slice(&(MAX_KEY_LEN + 1).to_le_bytes());
        assert_eq!(Command::decode(&raw), Err(DecodeError::Invalid(Invalid::KeyTooLong(MAX_KEY_LEN + 1))));
        let mut raw = vec![1];
        put_bytes(&mut raw, b"k");
        raw.extend_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(Command::decode(&raw), Err(DecodeError::Invalid(Invalid::ValueTooLong(u64::MAX))));
        let mut raw = vec![6];
        raw.extend_from_slice(&(MAX_KEY_COUNT + 1).to_le_bytes());
        assert_eq!(Command::decode(&raw), Err(DecodeError::Invalid(Invalid::TooManyKeys(MAX_KEY_COUNT + 1))));
    }
}
