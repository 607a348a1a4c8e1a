//! A bounded reader of the pickles PyTorch's Flight Recorder writes (the
//! data opcodes of protocols 2 to 4: dicts, lists, tuples, strings,
//! integers, floats, booleans, None and the memo), from a file another
//! process wrote, so hostile input. Nothing is ever called or imported:
//! an opcode that would (GLOBAL, REDUCE, BUILD, ...) is an error. Values
//! live in one arena and the memo holds indices into it, so a memo entry
//! used a million times costs nothing and a list changed after it was
//! memoized is seen changed, as Python's unpickler sees it. The input and
//! the pushes are bounded: every push onto the stack (a new value, DUP, a
//! memo reference) counts, so the stack, the arena and the containers'
//! items together hold at most [`MAX_PUSHES`] entries.

/// Most pushes onto the stack in one pickle.
pub const MAX_PUSHES: usize = 1 << 20;
/// Items of a dict a field lookup looks at.
pub const MAX_FIELDS: usize = 64;
/// Deepest nesting of MARKs.
const MAX_MARKS: usize = 256;

/// Why a pickle could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// It ends before STOP.
    #[error("the pickle is cut short")]
    Truncated,
    /// An opcode this reader does not run (it never calls or imports).
    #[error("the pickle uses opcode {0:#04x}, which is not plain data")]
    Opcode(u8),
    /// Structure that no pickler writes (a pop of an empty stack, a key
    /// with no value, a memo index never put, a length past the end).
    #[error("the pickle is malformed: {0}")]
    Malformed(&'static str),
    /// More pushes than [`MAX_PUSHES`], or MARKs nested deeper than 256.
    #[error("the pickle is too large")]
    TooLarge,
}

/// One value of the arena; containers hold indices.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// None.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer that fits 64 bits (a wider LONG1 is [`Value::BigInt`]).
    Int(i64),
    /// An integer wider than 64 bits (its value is not kept).
    BigInt,
    /// A float.
    Float(f64),
    /// A str (lossily decoded) or bytes (as Latin-1 would not help: kept lossy too).
    Str(String),
    /// A list.
    List(Vec<usize>),
    /// A tuple.
    Tuple(Vec<usize>),
    /// A dict, in insertion order.
    Dict(Vec<(usize, usize)>),
}

/// A read pickle: the arena and the index of the top value.
#[derive(Debug)]
pub struct Pickle {
    values: Vec<Value>,
    top: usize,
}

impl Pickle {
    /// The top value.
    pub fn top(&self) -> usize {
        self.top
    }

    /// The value at `i`.
    pub fn get(&self, i: usize) -> &Value {
        self.values.get(i).unwrap_or(&Value::None)
    }

    /// `dict[key]` for a str key, when `i` is a dict that has it among its
    /// first [`MAX_FIELDS`] items (a lookup costs at most that many).
    pub fn field(&self, i: usize, key: &str) -> Option<usize> {
        match self.get(i) {
            Value::Dict(items) => items
                .iter()
                .take(MAX_FIELDS)
                .find(|(k, _)| matches!(self.get(*k), Value::Str(s) if s == key))
                .map(|(_, v)| *v),
            _ => None,
        }
    }

    /// The str at `i`.
    pub fn str(&self, i: usize) -> Option<&str> {
        match self.get(i) {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer at `i` (a bool counts as 0 or 1).
    pub fn int(&self, i: usize) -> Option<i64> {
        match self.get(i) {
            Value::Int(n) => Some(*n),
            Value::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    /// The items of the list or tuple at `i` (none for anything else).
    pub fn items(&self, i: usize) -> &[usize] {
        match self.get(i) {
            Value::List(v) | Value::Tuple(v) => v,
            _ => &[],
        }
    }
}

/// A cursor over the input.
struct Input<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Input<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len()).ok_or(Error::Truncated)?;
        let out = &self.data[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }

    /// The next N bytes as an array (in the order given: callers decode the
    /// endianness each opcode has).
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len32(&mut self) -> Result<usize, Error> {
        usize::try_from(u32::from_le_bytes(self.array()?)).map_err(|_| Error::TooLarge)
    }

    fn len64(&mut self) -> Result<usize, Error> {
        usize::try_from(u64::from_le_bytes(self.array()?)).map_err(|_| Error::Truncated)
    }
}

/// The machine: the arena, the stack (indices), the marks, the memo.
#[derive(Default)]
struct Machine {
    values: Vec<Value>,
    stack: Vec<usize>,
    marks: Vec<usize>,
    memo: std::collections::HashMap<u64, usize>,
    pushes: usize,
}

impl Machine {
    /// Push index `i` (a value already in the arena), within the budget.
    fn push_index(&mut self, i: usize) -> Result<(), Error> {
        self.pushes += 1;
        if self.pushes > MAX_PUSHES {
            return Err(Error::TooLarge);
        }
        self.stack.push(i);
        Ok(())
    }

    fn push(&mut self, v: Value) -> Result<(), Error> {
        self.values.push(v);
        self.push_index(self.values.len() - 1)
    }

    fn pop(&mut self) -> Result<usize, Error> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(Error::Malformed("a pop below the mark"));
        }
        self.stack.pop().ok_or(Error::Malformed("a pop of an empty stack"))
    }

    /// The items pushed since the last MARK, which is dropped.
    fn pop_mark(&mut self) -> Result<Vec<usize>, Error> {
        let mark = self.marks.pop().ok_or(Error::Malformed("no MARK"))?;
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    /// The top item, above the last MARK (Python's unpickler starts a new
    /// stack at each MARK).
    fn top(&self) -> Result<usize, Error> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) {
            return Err(Error::Malformed("an empty stack"));
        }
        self.stack.last().copied().ok_or(Error::Malformed("an empty stack"))
    }

    fn extend(&mut self, target: usize, items: Vec<usize>) -> Result<(), Error> {
        match self.values.get_mut(target) {
            Some(Value::List(v)) => {
                v.extend(items);
                Ok(())
            }
            _ => Err(Error::Malformed("APPEND to something not a list")),
        }
    }

    fn set_items(&mut self, target: usize, items: &[usize]) -> Result<(), Error> {
        if !items.len().is_multiple_of(2) {
            return Err(Error::Malformed("a key with no value"));
        }
        match self.values.get_mut(target) {
            Some(Value::Dict(d)) => {
                d.extend(items.chunks_exact(2).map(|kv| (kv[0], kv[1])));
                Ok(())
            }
            _ => Err(Error::Malformed("SETITEM on something not a dict")),
        }
    }

    fn memo_put(&mut self, key: u64) -> Result<(), Error> {
        let top = self.top()?;
        if self.memo.insert(key, top).is_none() && self.memo.len() > MAX_PUSHES {
            return Err(Error::TooLarge);
        }
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), Error> {
        let i = *self.memo.get(&key).ok_or(Error::Malformed("a memo index never put"))?;
        self.push_index(i)
    }
}

fn text(bytes: &[u8]) -> Value {
    Value::Str(String::from_utf8_lossy(bytes).into_owned())
}

/// Little-endian two's complement of 1 to 8 bytes (LONG1).
fn long(bytes: &[u8]) -> Value {
    if bytes.is_empty() {
        return Value::Int(0);
    }
    if bytes.len() > 8 {
        return Value::BigInt;
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let mut buf = [if negative { 0xff } else { 0 }; 8];
    buf[..bytes.len()].copy_from_slice(bytes);
    Value::Int(i64::from_le_bytes(buf))
}

/// Read a whole pickle.
pub fn read(data: &[u8]) -> Result<Pickle, Error> {
    let mut input = Input { data, at: 0 };
    let mut m = Machine::default();
    loop {
        let op = input.byte()?;
        match op {
            0x80 => {
                input.byte()?; // PROTO n
            }
            0x95 => {
                input.array::<8>()?; // FRAME: a length hint
            }
            b'.' => {
                let top = m.pop()?;
                return Ok(Pickle { values: m.values, top });
            }
            b'(' => {
                if m.marks.len() >= MAX_MARKS {
                    return Err(Error::TooLarge);
                }
                m.marks.push(m.stack.len());
            }
            b'0' => {
                m.pop()?;
            }
            b'2' => {
                let top = m.top()?;
                m.push_index(top)?;
            }
            b'}' => m.push(Value::Dict(Vec::new()))?,
            b']' => m.push(Value::List(Vec::new()))?,
            b')' => m.push(Value::Tuple(Vec::new()))?,
            b'N' => m.push(Value::None)?,
            0x88 => m.push(Value::Bool(true))?,
            0x89 => m.push(Value::Bool(false))?,
            b'J' => m.push(Value::Int(i64::from(i32::from_le_bytes(input.array()?))))?,
            b'K' => m.push(Value::Int(i64::from(input.byte()?)))?,
            b'M' => m.push(Value::Int(i64::from(u16::from_le_bytes(input.array()?))))?,
            0x8a => {
                let n = usize::from(input.byte()?);
                m.push(long(input.take(n)?))?;
            }
            b'G' => m.push(Value::Float(f64::from_be_bytes(input.array()?)))?,
            b'X' | b'B' => {
                let n = input.len32()?;
                m.push(text(input.take(n)?))?;
            }
            0x8c | b'C' => {
                let n = usize::from(input.byte()?);
                m.push(text(input.take(n)?))?;
            }
            0x8d | 0x8e => {
                let n = input.len64()?;
                m.push(text(input.take(n)?))?;
            }
            b't' => {
                let items = m.pop_mark()?;
                m.push(Value::Tuple(items))?;
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                if m.stack.len() < n + m.marks.last().copied().unwrap_or(0) {
                    return Err(Error::Malformed("a tuple of more items than the stack has"));
                }
                let items = m.stack.split_off(m.stack.len() - n);
                m.push(Value::Tuple(items))?;
            }
            b'l' => {
                let items = m.pop_mark()?;
                m.push(Value::List(items))?;
            }
            b'd' => {
                let items = m.pop_mark()?;
                m.push(Value::Dict(Vec::new()))?;
                let top = m.top()?;
                m.set_items(top, &items)?;
            }
            b'a' => {
                let item = m.pop()?;
                let target = m.top()?;
                m.extend(target, vec![item])?;
            }
            b'e' => {
                let items = m.pop_mark()?;
                let target = m.top()?;
                m.extend(target, items)?;
            }
            b's' => {
                let v = m.pop()?;
                let k = m.pop()?;
                let target = m.top()?;
                m.set_items(target, &[k, v])?;
            }
            b'u' => {
                let items = m.pop_mark()?;
                let target = m.top()?;
                m.set_items(target, &items)?;
            }
            b'q' => m.memo_put(u64::from(input.byte()?))?,
            b'r' => m.memo_put(u64::from(u32::from_le_bytes(input.array()?)))?,
            0x94 => {
                let next = m.memo.len() as u64;
                m.memo_put(next)?;
            }
            b'h' => m.memo_get(u64::from(input.byte()?))?,
            b'j' => m.memo_get(u64::from(u32::from_le_bytes(input.array()?)))?,
            other => return Err(Error::Opcode(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pickle.dumps({"a": [1, -2, 70000, 2**40], "b": ("x", None, True), "c": 1.5}, protocol=2)`
    /// with the memo ops Python writes, by hand.
    #[test]
    fn plain_data_is_read() {
        let mut p = vec![0x80, 2, b'}', b'q', 0, b'('];
        p.extend([b'X', 1, 0, 0, 0, b'a', b'q', 1, b']', b'q', 2, b'(']);
        p.extend([b'K', 1, b'J', 0xfe, 0xff, 0xff, 0xff, b'J', 0x70, 0x11, 1, 0]);
        p.extend([0x8a, 6, 0, 0, 0, 0, 0, 1, b'e']);
        p.extend([b'X', 1, 0, 0, 0, b'b', b'h', 1, b'N', 0x88, 0x87]);
        p.extend([b'X', 1, 0, 0, 0, b'c', b'G', 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, b'u', b'.']);
        let got = read(&p).expect("read");
        let top = got.top();
        let a = got.field(top, "a").expect("a");
        let ints: Vec<i64> = got.items(a).iter().filter_map(|&i| got.int(i)).collect();
        assert_eq!(ints, vec![1, -2, 70000, 1 << 40]);
        let b = got.field(top, "b").expect("b");
        assert_eq!(got.items(b).len(), 3);
        assert_eq!(got.str(got.items(b)[0]), Some("a"), "BINGET 1 is the memoized 'a'");
        assert_eq!(got.int(got.items(b)[2]), Some(1));
        assert_eq!(got.get(got.field(top, "c").expect("c")), &Value::Float(1.5));
        assert_eq!(got.field(top, "d"), None);
    }

    #[test]
    fn a_list_changed_after_its_memo_is_seen_changed() {
        // [] memo 0; APPEND 7; then a tuple of (memo 0,) -> ([7],)
        let p = [0x80, 2, b']', b'q', 0, b'K', 7, b'a', b'h', 0, 0x85, b'.'];
        let got = read(&p).expect("read");
        let inner = got.items(got.top())[0];
        assert_eq!(got.items(inner).iter().filter_map(|&i| got.int(i)).collect::<Vec<_>>(), vec![7]);
    }

    #[test]
    fn code_and_bad_input_are_errors_not_panics() {
        // GLOBAL 'os\nsystem\n' and REDUCE are never run.
        assert_eq!(read(b"\x80\x02cos\nsystem\n").expect_err("an error"), Error::Opcode(b'c'));
        assert_eq!(read(b"\x80\x02N").expect_err("an error"), Error::Truncated);
        assert_eq!(read(b"\x80\x02X\xff\xff\xff\x7fab").expect_err("an error"), Error::Truncated);
        assert!(matches!(read(b"\x80\x02."), Err(Error::Malformed(_))));
        assert!(matches!(read(b"\x80\x02h\x05."), Err(Error::Malformed(_))));
        assert!(matches!(read(b"\x80\x02K\x01K\x02s."), Err(Error::Malformed(_))));
        assert!(matches!(read(b"\x80\x02(K\x01(\x86."), Err(Error::Malformed(_))));
        assert!(matches!(read(b"\x80\x02}(K\x01u."), Err(Error::Malformed(_))));
        assert!(matches!(read(b"\x80\x02e."), Err(Error::Malformed(_))));
        assert!(matches!(read(b"\x80\x02](K\x01a."), Err(Error::Malformed(_))), "APPEND to a list below the MARK");
        assert_eq!(read(&[b'('; 300]).expect_err("an error"), Error::TooLarge);
        // Every prefix of a good pickle fails cleanly.
        let good = [0x80, 2, b'}', b'q', 0, b'(', b'K', 1, b'K', 2, b'u', b'.'];
        for n in 0..good.len() {
            assert!(read(&good[..n]).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn every_push_counts_against_the_bound() {
        let mut values = vec![0x80, 2];
        values.extend(std::iter::repeat_n(b']', MAX_PUSHES + 1));
        assert_eq!(read(&values).expect_err("an error"), Error::TooLarge);
        // DUPs and memo references add no value but are pushes all the same.
        let mut dups = vec![0x80, 2, b']', b'(', b'N'];
        dups.extend(std::iter::repeat_n(b'2', MAX_PUSHES));
        dups.extend([b'e', b'.']);
        assert_eq!(read(&dups).expect_err("an error"), Error::TooLarge);
        let mut refs = vec![0x80, 2, b']', b'(', b'N', b'q', 0];
        refs.extend(std::iter::repeat_n([b'h', 0], MAX_PUSHES).flatten());
        refs.extend([b'e', b'.']);
        assert_eq!(read(&refs).expect_err("an error"), Error::TooLarge);
    }
}
