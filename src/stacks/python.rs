//! CPython's stacks read from outside the process, as py-spy does: find
//! `_PyRuntime` in the interpreter's ELF file, follow the interpreter's
//! thread states to each thread's current frame, and walk the frames'
//! code objects (file, qualified name, line from the location table).
//! The process runs on while it is read, so every pointer is checked by
//! the read that follows it and every walk is bounded; a torn read gives
//! a shorter or odd stack, never a crash or a hang.
//!
//! The struct offsets are CPython's own, per minor version: 3.11 and 3.12
//! from `offsetof` over their internal headers (`Py_BUILD_CORE`, x86-64,
//! default build), 3.13 from the `_Py_DebugOffsets` table at the head of
//! `_PyRuntime` (which CPython keeps for debuggers), with the header
//! values as the fallback for the parts it does not list.

use std::collections::HashMap;

use super::budget::Budget;
use super::elf::Elf;
use super::maps::{Mapping, Mem, file_of};
use super::{Error, Frame, Limits};

/// Where CPython keeps what the walk follows, for one minor version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    interpreters_head: u64,
    threads_head: u64,
    tstate_next: u64,
    native_thread_id: u64,
    /// 3.11 and 3.12: `tstate->cframe->current_frame`; 3.13: `tstate->current_frame`.
    cframe: Option<u64>,
    current_frame: u64,
    frame_code: u64,
    frame_instr: u64,
    frame_previous: u64,
    frame_owner: u64,
    /// `FRAME_OWNED_BY_CSTACK` (3.12+): a shim frame with no code of its own.
    owner_cstack: Option<u8>,
    code_filename: u64,
    code_qualname: u64,
    code_firstlineno: u64,
    code_linetable: u64,
    code_adaptive: u64,
    ascii_size: u64,
    compact_size: u64,
}

const PY311: Layout = Layout {
    interpreters_head: 40,
    threads_head: 16,
    tstate_next: 8,
    native_thread_id: 160,
    cframe: Some(56),
    current_frame: 8,
    frame_code: 32,
    frame_instr: 56,
    frame_previous: 48,
    frame_owner: 69,
    owner_cstack: None,
    code_filename: 112,
    code_qualname: 128,
    code_firstlineno: 72,
    code_linetable: 136,
    code_adaptive: 184,
    ascii_size: 48,
    compact_size: 72,
};

const PY312: Layout = Layout {
    interpreters_head: 40,
    threads_head: 72,
    tstate_next: 8,
    native_thread_id: 144,
    cframe: Some(56),
    current_frame: 0,
    frame_code: 0,
    frame_instr: 56,
    frame_previous: 8,
    frame_owner: 70,
    owner_cstack: Some(3),
    code_filename: 112,
    code_qualname: 128,
    code_firstlineno: 68,
    code_linetable: 136,
    code_adaptive: 192,
    ascii_size: 40,
    compact_size: 56,
};

const PY313: Layout = Layout {
    interpreters_head: 632,
    threads_head: 7344,
    tstate_next: 8,
    native_thread_id: 160,
    cframe: None,
    current_frame: 72,
    frame_code: 0,
    frame_instr: 56,
    frame_previous: 8,
    frame_owner: 70,
    owner_cstack: Some(3),
    code_filename: 112,
    code_qualname: 128,
    code_firstlineno: 68,
    code_linetable: 136,
    code_adaptive: 200,
    ascii_size: 40,
    compact_size: 56,
};

/// The versions read, for messages.
pub const SUPPORTED: &str = "3.11, 3.12 and 3.13";

/// Most files looked at for the interpreter.
const MAX_CANDIDATES: usize = 4;
/// Most thread states followed.
const MAX_THREADS: usize = 256;
/// Longest string read (a file name, a function name).
const MAX_STR: u64 = 4096;
/// Largest location table read (CPython's own are a few KiB at most).
const MAX_LINETABLE: usize = 64 << 10;
/// Most bytes of location tables one walk reads.
const MAX_TABLES: usize = 4 << 20;

/// The interpreter found in a process: where `_PyRuntime` is and how to read it.
#[derive(Debug, Clone)]
pub struct Interpreter {
    /// `major.minor.micro`.
    pub version: String,
    runtime: u64,
    layout: Layout,
}

/// Find the interpreter among `maps`: the executable or a `libpython`
/// with `_PyRuntime`. The load bias comes from the file's executable
/// mapping: a process may also map the file as data (a reader of its own
/// debug information), at another bias. The files' tables are counted
/// against `budget`.
pub fn find(mem: &Mem, maps: &[Mapping], budget: &Budget) -> Result<Interpreter, Error> {
    let candidates = maps.iter().filter(|m| m.exec).filter(|m| {
        let name = m.path.rsplit('/').next().unwrap_or("");
        name.starts_with("libpython3") || name.starts_with("python3") || name == "python"
    });
    let mut seen = Vec::new();
    for m in candidates {
        if seen.contains(&&m.path) {
            continue;
        }
        if seen.len() >= MAX_CANDIDATES {
            break;
        }
        seen.push(&m.path);
        // A file replaced while it runs is shown "(deleted)"; its new
        // version at the path is tried (a mismatch fails the reads after).
        let path = m.path.strip_suffix(" (deleted)").unwrap_or(&m.path);
        let Ok(elf) = Elf::open(&file_of(mem.pid, path), budget) else { continue };
        let Some(runtime) = elf.symbol("_PyRuntime") else { continue };
        let Some(bias) = elf.bias(m.start, m.offset) else { continue };
        let version = match elf.symbol("Py_Version") {
            Some(v) => mem.u32(v.wrapping_add(bias))?,
            None => return Err(Error::Unsupported(format!("Python before 3.11 ({})", super::clean(&m.path)))),
        };
        let runtime = runtime.wrapping_add(bias);
        let (major, minor, micro) = (version >> 24, (version >> 16) & 0xff, (version >> 8) & 0xff);
        let text = format!("{major}.{minor}.{micro}");
        let layout = match (major, minor) {
            (3, 11) => PY311,
            (3, 12) => PY312,
            (3, 13) => debug_offsets(mem, runtime)?,
            _ => return Err(Error::Unsupported(format!("Python {text} (stacks are read for {SUPPORTED})"))),
        };
        return Ok(Interpreter { version: text, runtime, layout });
    }
    Err(Error::NotPython)
}

/// 3.13's layout from the `_Py_DebugOffsets` at the head of `_PyRuntime`
/// (`cookie`, `version`, `free_threaded`, then one `size` and the offsets
/// per struct, all u64), checked against its cookie.
fn debug_offsets(mem: &Mem, runtime: u64) -> Result<Layout, Error> {
    let raw = mem.bytes(runtime, 44 * 8)?;
    let word = |i: usize| raw.get(i * 8..i * 8 + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    if raw.get(..8) != Some(b"xdebugpy".as_slice()) {
        return Err(Error::Unsupported("Python 3.13 without its debug offsets".into()));
    }
    if word(2) != Some(0) {
        return Err(Error::Unsupported("a free-threaded Python build".into()));
    }
    let mut l = PY313;
    let set = |field: &mut u64, i: usize| {
        if let Some(v) = word(i).filter(|v| *v < 1 << 20) {
            *field = v;
        }
    };
    set(&mut l.interpreters_head, 5);
    set(&mut l.threads_head, 9);
    set(&mut l.tstate_next, 21);
    set(&mut l.current_frame, 23);
    set(&mut l.native_thread_id, 25);
    set(&mut l.frame_previous, 29);
    set(&mut l.frame_code, 30);
    set(&mut l.frame_instr, 31);
    set(&mut l.frame_owner, 33);
    set(&mut l.code_filename, 35);
    set(&mut l.code_qualname, 37);
    set(&mut l.code_linetable, 38);
    set(&mut l.code_firstlineno, 39);
    set(&mut l.code_adaptive, 43);
    Ok(l)
}

/// One Python thread's frames, innermost first.
#[derive(Debug, Clone)]
pub struct PyThread {
    /// Its kernel thread id.
    pub tid: i32,
    /// Its frames, innermost first.
    pub frames: Vec<Frame>,
    /// The walk stopped at a bound (frames or time).
    pub truncated: bool,
}

/// A code object's name, file and line table, read once per walk.
#[derive(Debug, Clone)]
struct Code {
    function: String,
    file: String,
    first_line: i32,
    table: Vec<u8>,
}

/// Every thread's stack. Addresses come from the worker, so every sum
/// with one wraps rather than overflows (a wrong address fails its read);
/// a thread state that cannot be read ends the list with what was read,
/// and so does the read's budget (time, or the bytes of the names and
/// tables kept).
pub fn threads(mem: &Mem, py: &Interpreter, limits: &Limits, budget: &Budget) -> Result<Vec<PyThread>, Error> {
    let l = &py.layout;
    let interp = mem.u64(py.runtime.wrapping_add(l.interpreters_head))?;
    let mut tstate = mem.u64(interp.wrapping_add(l.threads_head))?;
    let mut out = Vec::new();
    let mut codes = Codes::default();
    while tstate != 0 && out.len() < MAX_THREADS && !budget.late() {
        let Ok(tid) = mem.u64(tstate.wrapping_add(l.native_thread_id)) else { break };
        let tid = i32::try_from(tid).unwrap_or(0);
        let mut frame = match l.cframe {
            Some(at) => match mem.u64(tstate.wrapping_add(at)) {
                Ok(cframe) if cframe != 0 => mem.u64(cframe.wrapping_add(l.current_frame)).unwrap_or(0),
                _ => 0,
            },
            None => mem.u64(tstate.wrapping_add(l.current_frame)).unwrap_or(0),
        };
        let mut frames = Vec::new();
        let mut truncated = false;
        while frame != 0 {
            if frames.len() >= limits.frames || budget.late() {
                truncated = true;
                break;
            }
            let Ok(head) = mem.bytes(frame, 72) else { break };
            let word = |at: u64| {
                let at = usize::try_from(at).unwrap_or(usize::MAX);
                head.get(at..at.saturating_add(8)).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).unwrap_or(0)
            };
            let owner = head.get(usize::try_from(l.frame_owner).unwrap_or(usize::MAX)).copied();
            let (code_at, instr, previous) = (word(l.frame_code), word(l.frame_instr), word(l.frame_previous));
            if (l.owner_cstack.is_none() || owner != l.owner_cstack)
                && let Some(c) = codes.get(mem, l, code_at, budget)
            {
                let first = code_at.wrapping_add(l.code_adaptive);
                let line = instr.checked_sub(first).map(|b| b / 2).and_then(|i| line_at(&c.table, c.first_line, i));
                let line = line.or(u32::try_from(c.first_line).ok());
                // Each frame keeps its own copy of the names: counted.
                if budget.charge(held(c.function.len() + c.file.len() + FRAME_BYTES)).is_err() {
                    truncated = true;
                    break;
                }
                frames.push(Frame { function: c.function.clone(), file: c.file.clone(), line });
            }
            if previous == frame {
                break;
            }
            frame = previous;
        }
        out.push(PyThread { tid, frames, truncated });
        let Ok(next) = mem.u64(tstate.wrapping_add(l.tstate_next)) else { break };
        if next == tstate {
            break;
        }
        tstate = next;
    }
    Ok(out)
}

/// What a [`Frame`] itself takes, besides its names.
const FRAME_BYTES: usize = std::mem::size_of::<Frame>();

fn held(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// The code objects read in one walk, and the bytes of location tables
/// they hold (bounded by [`MAX_TABLES`], and with their names by the
/// read's budget).
#[derive(Debug, Default)]
struct Codes {
    read: HashMap<u64, Option<Code>>,
    table_bytes: usize,
    code_type: Option<u64>,
}

impl Codes {
    /// The code object at `at` (None: it is not one, or it would take
    /// the read past its budget).
    fn get(&mut self, mem: &Mem, l: &Layout, at: u64, budget: &Budget) -> Option<&Code> {
        if !self.read.contains_key(&at) {
            let room = MAX_TABLES.saturating_sub(self.table_bytes);
            let code = read_code(mem, l, at, &mut self.code_type, room);
            let cost = code.as_ref().map_or(0, |c| c.table.len() + c.function.len() + c.file.len());
            budget.charge(held(cost + std::mem::size_of::<Code>() + 8)).ok()?;
            self.table_bytes += code.as_ref().map_or(0, |c| c.table.len());
            self.read.insert(at, code);
        }
        self.read.get(&at)?.as_ref()
    }
}

/// A code object's name, file and line table (a table over `budget`
/// bytes is left out: the frame gets its function's first line); None
/// when `at` is not a code object.
fn read_code(mem: &Mem, l: &Layout, at: u64, code_type: &mut Option<u64>, budget: usize) -> Option<Code> {
    let ty = mem.u64(at.wrapping_add(8)).ok()?;
    if *code_type != Some(ty) {
        // tp_name is the type's C string, "code" for code objects.
        let name = mem.bytes(mem.u64(ty.wrapping_add(24)).ok()?, 5).ok()?;
        if name != b"code\0" {
            return None;
        }
        *code_type = Some(ty);
    }
    // Names are cut to what is shown of them before they are kept (a
    // frame per thread and depth copies them).
    let name = |s: Option<String>| s.map_or_else(|| "<unknown>".into(), |s| super::clean(&s));
    let file = name(string(mem, l, mem.u64(at.wrapping_add(l.code_filename)).ok()?));
    let function = name(string(mem, l, mem.u64(at.wrapping_add(l.code_qualname)).ok()?));
    let first_line = i32::try_from(mem.u32(at.wrapping_add(l.code_firstlineno)).ok()?).ok()?;
    let table = mem.u64(at.wrapping_add(l.code_linetable)).ok().and_then(|t| bytes_object(mem, t, budget));
    Some(Code { function, file, first_line, table: table.unwrap_or_default() })
}

/// A `str` object's text (compact ones: every string a code object
/// holds), cut at [`MAX_STR`] characters.
fn string(mem: &Mem, l: &Layout, at: u64) -> Option<String> {
    let head = mem.bytes(at, 40).ok()?;
    let length = u64::from_le_bytes(head.get(16..24)?.try_into().ok()?);
    let state = u32::from_le_bytes(head.get(32..36)?.try_into().ok()?);
    let (kind, compact, ascii) = ((state >> 2) & 7, (state >> 5) & 1 == 1, (state >> 6) & 1 == 1);
    if !compact {
        return None;
    }
    let data = at.wrapping_add(if ascii { l.ascii_size } else { l.compact_size });
    let n = usize::try_from(length.min(MAX_STR)).ok()?;
    let width = usize::try_from(kind).ok().filter(|k| matches!(k, 1 | 2 | 4))?;
    let raw = mem.bytes(data, n * width).ok()?;
    let chars = raw.chunks_exact(width).map(|c| {
        let mut w = [0u8; 4];
        w[..width].copy_from_slice(c);
        char::from_u32(u32::from_le_bytes(w)).unwrap_or('\u{fffd}')
    });
    Some(chars.collect())
}

/// A `bytes` object's contents, when at most `budget` (and
/// [`MAX_LINETABLE`]) bytes.
fn bytes_object(mem: &Mem, at: u64, budget: usize) -> Option<Vec<u8>> {
    let size = usize::try_from(mem.u64(at.wrapping_add(16)).ok()?).ok()?;
    if size > MAX_LINETABLE || size > budget {
        return None;
    }
    mem.bytes(at.wrapping_add(32), size).ok()
}

/// The line of code unit `index` from a 3.11+ location table
/// (`Objects/locations.md`): entries of `1 code:4 length-1:3` and a
/// code-dependent tail; the line moves by each entry's delta.
pub fn line_at(table: &[u8], first_line: i32, index: u64) -> Option<u32> {
    let mut line = i64::from(first_line);
    let mut addr = 0u64;
    let mut i = 0usize;
    let varint = |i: &mut usize| -> Option<u64> {
        let mut b = *table.get(*i)?;
        *i += 1;
        let mut v = u64::from(b & 63);
        let mut shift = 0;
        while b & 64 != 0 {
            b = *table.get(*i)?;
            *i += 1;
            shift += 6;
            if shift > 60 {
                return None;
            }
            v |= u64::from(b & 63) << shift;
        }
        Some(v)
    };
    let signed = |v: u64| -> i64 {
        let half = i64::try_from(v >> 1).unwrap_or(0);
        if v & 1 == 1 { -half } else { half }
    };
    while i < table.len() {
        let b = table[i];
        i += 1;
        if b & 0x80 == 0 {
            return None;
        }
        let code = (b >> 3) & 15;
        let length = u64::from(b & 7) + 1;
        let delta = match code {
            15 => 0,
            14 => {
                let d = signed(varint(&mut i)?);
                for _ in 0..3 {
                    varint(&mut i)?;
                }
                d
            }
            13 => signed(varint(&mut i)?),
            10..=12 => {
                i += 2;
                i64::from(code) - 10
            }
            _ => {
                i += 1;
                0
            }
        };
        line = line.saturating_add(delta);
        addr = addr.saturating_add(length);
        if index < addr {
            return if code == 15 { None } else { u32::try_from(line).ok() };
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_tables_give_lines() {
        // Entries: a short form (line +0, 2 units), a one-line form +1 (1
        // unit), a no-column form -1 (svarint 3), a long form +5 (svarint
        // 10, then end line, columns), a no-location entry.
        let table = [
            0x80 | 1,
            0x00,
            0x80 | (11 << 3),
            1,
            2,
            0x80 | (13 << 3),
            3,
            0x80 | (14 << 3),
            10,
            0,
            1,
            2,
            0x80 | (15 << 3),
        ];
        assert_eq!(line_at(&table, 10, 0), Some(10));
        assert_eq!(line_at(&table, 10, 1), Some(10));
        assert_eq!(line_at(&table, 10, 2), Some(11));
        assert_eq!(line_at(&table, 10, 3), Some(10));
        assert_eq!(line_at(&table, 10, 4), Some(15));
        assert_eq!(line_at(&table, 10, 5), None);
        assert_eq!(line_at(&table, 10, 99), None);
        // Torn or hostile tables end, they do not panic.
        assert_eq!(line_at(&[0x80 | (14 << 3), 0xff], 1, 0), None);
        assert_eq!(line_at(&[0x7f], 1, 0), None);
        assert_eq!(line_at(&[0x80 | (14 << 3)].repeat(3), 1, 7), None);
        // Deltas of i64::MAX, again and again: the line saturates, no overflow.
        let mut huge = vec![0x80 | (13 << 3) | 7];
        huge.extend([0x7f; 10]);
        huge.push(0x3f);
        assert!(line_at(&huge.repeat(200), 1, 8 * 199).is_none_or(|l| l == u32::MAX));
    }
}
