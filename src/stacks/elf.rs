//! Just enough of ELF64 (little-endian) to find a symbol's address in a
//! mapped file and to name the function around an address: the program
//! headers (for the load bias), the section headers, and the symbol tables
//! (`.dynsym`, then `.symtab` when the file has one). Every read is bounded
//! and checked: a file is data, never trusted.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

/// Most section headers read from one file.
const MAX_SECTIONS: usize = 4096;
/// Most program headers read from one file.
const MAX_SEGMENTS: usize = 256;
/// Largest symbol or string table read (libtorch's `.dynsym` is ~20 MiB).
const MAX_TABLE: u64 = 64 << 20;

const SHT_SYMTAB: u32 = 2;
const SHT_DYNSYM: u32 = 11;
const PT_LOAD: u32 = 1;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;

/// One section's header.
#[derive(Debug, Clone)]
pub struct Section {
    /// Its name from `.shstrtab`.
    pub name: String,
    /// `sh_type`.
    pub kind: u32,
    /// Its address in the file's own address space.
    pub addr: u64,
    /// Where its bytes are in the file.
    pub offset: u64,
    /// How many bytes.
    pub size: u64,
    /// The index of its linked section (a symbol table's strings).
    pub link: u32,
    /// Where its name is in `.shstrtab`.
    name_at: u32,
}

/// One loadable segment's header.
#[derive(Debug, Clone, Copy)]
struct Segment {
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

/// A function or object symbol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Symbol {
    /// Its name (mangled as stored).
    pub name: String,
    /// Its address in the file's own address space.
    pub addr: u64,
    /// Its size in bytes (0: unknown).
    pub size: u64,
}

/// An opened ELF file.
#[derive(Debug)]
pub struct Elf {
    file: File,
    sections: Vec<Section>,
    segments: Vec<Segment>,
    /// Walks of its symbol tables stop here (the read's time bound).
    deadline: Option<Instant>,
}

fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not a usable ELF64 file: {what}"))
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Longest symbol name read (C++ names run to a few hundred bytes; a
/// longer one is skipped, so a crafted table costs at most this per entry).
const MAX_NAME: usize = 1024;
/// Most bytes of names one file's function list keeps.
const MAX_NAMES: usize = 32 << 20;
/// Symbols walked between two looks at the deadline.
const DEADLINE_EVERY: usize = 4096;

/// The NUL-terminated string at `at` of a string table, at most
/// [`MAX_NAME`] bytes before its NUL.
fn str_at(table: &[u8], at: usize) -> Option<&str> {
    // `CStr`'s search is std's own, optimized even in a debug build, where
    // a byte-by-byte search made most of the time to read libtorch's tables.
    let rest = table.get(at..)?;
    let head = rest.get(..MAX_NAME + 1).unwrap_or(rest);
    std::ffi::CStr::from_bytes_until_nul(head).ok()?.to_str().ok()
}

impl Elf {
    /// Open `path` and read its headers.
    pub fn open(path: &Path) -> std::io::Result<Elf> {
        let file = File::open(path)?;
        let mut head = [0u8; 64];
        file.read_exact_at(&mut head, 0)?;
        if &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
            return Err(invalid("not ELF64 little-endian"));
        }
        let field = |v: Option<u64>| v.ok_or_else(|| invalid("short header"));
        let phoff = field(u64_at(&head, 32))?;
        let shoff = field(u64_at(&head, 40))?;
        let phentsize = field(u16_at(&head, 54).map(u64::from))?;
        let phnum = field(u16_at(&head, 56).map(u64::from))?;
        let shentsize = field(u16_at(&head, 58).map(u64::from))?;
        let shnum = field(u16_at(&head, 60).map(u64::from))?;
        let shstrndx = usize::from(u16_at(&head, 62).ok_or_else(|| invalid("short header"))?);
        let segments = read_segments(&file, phoff, phentsize, phnum)?;
        let mut sections = read_sections(&file, shoff, shentsize, shnum)?;
        if let Some(names) = sections.get(shstrndx).cloned() {
            let table = read_bytes(&file, names.offset, names.size.min(1 << 20))?;
            for s in &mut sections {
                s.name = str_at(&table, usize::try_from(s.name_at).unwrap_or(usize::MAX)).unwrap_or("").to_string();
            }
        }
        Ok(Elf { file, sections, segments, deadline: None })
    }

    /// The same file, its symbol walks bounded by `deadline`.
    pub fn until(mut self, deadline: Option<Instant>) -> Elf {
        self.deadline = deadline;
        self
    }

    /// The section named `name`.
    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|s| s.name == name)
    }

    /// A section's bytes, at most `max`.
    pub fn section_bytes(&self, s: &Section, max: u64) -> std::io::Result<Vec<u8>> {
        if s.size > max {
            return Err(invalid("section too large"));
        }
        read_bytes(&self.file, s.offset, s.size)
    }

    /// The load bias of a mapping of this file at `start` from file offset
    /// `offset`: what to add to the file's addresses to get the process's.
    pub fn bias(&self, start: u64, offset: u64) -> Option<u64> {
        // Segments that are not page-aligned in the file share a page (a
        // static PIE's read-only segment ends in the page its code starts
        // in): the one mapped at `offset` is the last that covers it.
        let seg = self
            .segments
            .iter()
            .filter(|s| offset >= s.offset & !0xfff && offset < s.offset + s.filesz.max(1))
            .max_by_key(|s| s.offset)?;
        // File offset `offset` is address `seg.vaddr + (offset - seg.offset)`.
        let file_addr = seg.vaddr.wrapping_add(offset).wrapping_sub(seg.offset);
        Some(start.wrapping_sub(file_addr))
    }

    /// The address (in the file's space) of the symbol `name`, from
    /// `.dynsym`, else `.symtab`.
    pub fn symbol(&self, name: &str) -> Option<u64> {
        for kind in [SHT_DYNSYM, SHT_SYMTAB] {
            let found = self.each_symbol(kind, |sym_name, _, _, _| sym_name == name).ok().flatten();
            if let Some(s) = found {
                return Some(s.addr);
            }
        }
        None
    }

    /// Every named function with an address, sorted by address, from
    /// `.symtab` when the file has one (it names static functions too),
    /// else `.dynsym`.
    pub fn functions(&self) -> Vec<Symbol> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        for kind in [SHT_SYMTAB, SHT_DYNSYM] {
            let _ = self.each_symbol(kind, |name, info, addr, size| {
                if info & 0xf == STT_FUNC && addr != 0 && !name.is_empty() {
                    bytes += name.len();
                    out.push(Symbol { name: name.to_string(), addr, size });
                }
                bytes > MAX_NAMES
            });
            if !out.is_empty() {
                break;
            }
        }
        out.sort_by_key(|s| s.addr);
        out.dedup_by_key(|s| s.addr);
        out
    }

    /// Walk the symbols of the first table of `kind` until `stop` says so;
    /// the symbol it stopped at.
    fn each_symbol(
        &self,
        kind: u32,
        mut stop: impl FnMut(&str, u8, u64, u64) -> bool,
    ) -> std::io::Result<Option<Symbol>> {
        let Some(table) = self.sections.iter().find(|s| s.kind == kind) else { return Ok(None) };
        let strings = self
            .sections
            .get(usize::try_from(table.link).unwrap_or(usize::MAX))
            .ok_or_else(|| invalid("symbol strings"))?;
        if table.size > MAX_TABLE || strings.size > MAX_TABLE {
            return Err(invalid("symbol table too large"));
        }
        let syms = read_bytes(&self.file, table.offset, table.size)?;
        let names = read_bytes(&self.file, strings.offset, strings.size)?;
        for (i, entry) in syms.chunks_exact(24).enumerate() {
            if i % DEADLINE_EVERY == DEADLINE_EVERY - 1 && self.deadline.is_some_and(|d| Instant::now() > d) {
                return Err(std::io::Error::from(std::io::ErrorKind::TimedOut));
            }
            let (Some(name_at), Some(&info), Some(value), Some(size)) =
                (u32_at(entry, 0), entry.get(4), u64_at(entry, 8), u64_at(entry, 16))
            else {
                continue;
            };
            let kind = info & 0xf;
            if kind != STT_FUNC && kind != STT_OBJECT {
                continue;
            }
            let Some(name) = str_at(&names, usize::try_from(name_at).unwrap_or(usize::MAX)) else { continue };
            if stop(name, info, value, size) {
                return Ok(Some(Symbol { name: name.to_string(), addr: value, size }));
            }
        }
        Ok(None)
    }
}

fn read_bytes(file: &File, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let len = usize::try_from(len).map_err(|_| invalid("size"))?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, offset)?;
    Ok(buf)
}

fn read_segments(file: &File, off: u64, entsize: u64, num: u64) -> std::io::Result<Vec<Segment>> {
    if entsize < 56 || num > MAX_SEGMENTS as u64 {
        return Err(invalid("program headers"));
    }
    let table = read_bytes(file, off, entsize * num)?;
    let step = usize::try_from(entsize).map_err(|_| invalid("program headers"))?;
    Ok(table
        .chunks_exact(step)
        .filter(|e| u32_at(e, 0) == Some(PT_LOAD))
        .filter_map(|e| Some(Segment { offset: u64_at(e, 8)?, vaddr: u64_at(e, 16)?, filesz: u64_at(e, 32)? }))
        .collect())
}

fn read_sections(file: &File, off: u64, entsize: u64, num: u64) -> std::io::Result<Vec<Section>> {
    if num == 0 {
        return Ok(Vec::new());
    }
    if entsize < 64 || num > MAX_SECTIONS as u64 {
        return Err(invalid("section headers"));
    }
    let table = read_bytes(file, off, entsize * num)?;
    let step = usize::try_from(entsize).map_err(|_| invalid("section headers"))?;
    Ok(table
        .chunks_exact(step)
        .filter_map(|e| {
            Some(Section {
                name: String::new(),
                name_at: u32_at(e, 0)?,
                kind: u32_at(e, 4)?,
                addr: u64_at(e, 16)?,
                offset: u64_at(e, 24)?,
                size: u64_at(e, 32)?,
                link: u32_at(e, 40)?,
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_its_own_symbols_and_bias() {
        // The test binary itself: a static PIE with a symbol table.
        let exe = std::env::current_exe().expect("exe");
        let elf = Elf::open(&exe).expect("open");
        assert!(elf.section(".text").is_some());
        let fns = elf.functions();
        assert!(fns.len() > 100, "{}", fns.len());
        assert!(fns.windows(2).all(|w| w[0].addr < w[1].addr));
        assert!(Elf::open(Path::new("/proc/self/status")).is_err());
    }

    /// Every mapping of the loaded image (the run of mappings around the
    /// executable one; std's backtraces may map the file again as data).
    #[test]
    fn every_mapping_of_a_file_has_one_bias() {
        let exe = std::env::current_exe().expect("exe");
        let elf = Elf::open(&exe).expect("open");
        let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
        let exe = exe.to_string_lossy();
        let mine: Vec<(u64, u64, u64, bool)> = maps
            .lines()
            .filter(|l| l.ends_with(&*exe))
            .filter_map(|l| {
                let mut f = l.split(' ');
                let (a, b) = f.next()?.split_once('-')?;
                let exec = f.next()?.contains('x');
                let offset = u64::from_str_radix(f.next()?, 16).ok()?;
                Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?, offset, exec))
            })
            .collect();
        let x = mine.iter().position(|m| m.3).expect("the executable mapping");
        let (mut lo, mut hi) = (x, x);
        while lo > 0 && mine[lo - 1].1 == mine[lo].0 {
            lo -= 1;
        }
        while hi + 1 < mine.len() && mine[hi].1 == mine[hi + 1].0 {
            hi += 1;
        }
        let biases: Vec<u64> = mine[lo..=hi].iter().filter_map(|m| elf.bias(m.0, m.2)).collect();
        assert!(biases.len() > 1, "{biases:?}");
        assert!(biases.iter().all(|b| *b == biases[0]), "{biases:x?}");
    }

    #[test]
    fn strings_are_bounded_to_their_table() {
        assert_eq!(str_at(b"ab\0cd\0", 3), Some("cd"));
        assert_eq!(str_at(b"ab", 0), None);
        assert_eq!(str_at(b"ab\0", 9), None);
        // A name longer than MAX_NAME is skipped, however long its table.
        let mut long = vec![b'A'; MAX_NAME + 10];
        long.push(0);
        assert_eq!(str_at(&long, 0), None);
        assert_eq!(str_at(&long, 20).map(str::len), Some(MAX_NAME - 10));
    }
}
