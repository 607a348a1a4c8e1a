//! TCPStore framing: one query-type byte, then little-endian fields.
//!
//! Strings and byte values are a `u64` length and raw bytes; key lists are a
//! `u64` count and that many strings; integers are `i64`. Decoding is
//! check-then-parse over a borrowed buffer: it either returns a whole
//! [`Command`] and how many bytes it used, or says the frame is
//! [`DecodeError::Incomplete`] (read more) or [`DecodeError::Invalid`] (close
//! the connection). Lengths are checked against the libuv limits before any
//! allocation, so a hostile length cannot make the server reserve memory.

/// The u32 every client sends in VALIDATE (`validationMagicNumber`).
pub const MAGIC: u32 = 0x3C85_F7CE;
/// Longest key the libuv backend accepts (`MAX_STRING_LEN`).
pub const MAX_KEY_LEN: u64 = 8 * 1024;
/// Longest value the libuv backend accepts (`MAX_PAYLOAD_LEN`).
pub const MAX_VALUE_LEN: u64 = 8 * 1024 * 1024;
/// Most keys in one CHECK/WAIT/MULTI_GET/MULTI_SET (`MAX_KEY_COUNT`).
pub const MAX_KEY_COUNT: u64 = 128 * 1024;

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
}

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
