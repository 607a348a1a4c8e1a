//! Just enough of ELF64 (little-endian) to find a symbol's address in a
//! mapped file and to name the function around an address: the program
//! headers (for the load bias), the section headers, and the symbol tables
//! (`.dynsym`, then `.symtab` when the file has one). Every read is bounded
//! and checked: a file is data, never trusted. Every size and count the
//! file states is bounded from both sides before anything is allocated for
//! it, and what is kept is counted against the read's [`Budget`] first.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use super::budget::{Budget, Spent, over};

/// Most section headers read from one file.
const MAX_SECTIONS: u64 = 4096;
/// Most program headers read from one file.
const MAX_SEGMENTS: u64 = 256;
/// Largest header entry accepted (ELF64's are 64 bytes for sections and 56
/// for segments; a larger size is allowed for extensions, not for making
/// the table huge: at most 4096 x 256 bytes, 1 MiB, of section headers).
const MAX_ENTRY: u64 = 256;
/// Largest symbol or string table read (libtorch's `.dynsym` is ~20 MiB).
const MAX_TABLE: u64 = 64 << 20;
/// Largest section-name table read.
const MAX_SHSTRTAB: u64 = 1 << 20;
/// One symbol table entry (`Elf64_Sym`).
const SYM: usize = 24;
/// Symbols read from the file at once (1 MiB).
const SYMS_AT_ONCE: usize = 43_690;

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

/// A function of a file's index: where it is and where its name is (the
/// name is read from the file when a frame needs it, so the index costs
/// 16 bytes a function, not the name's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Func {
    /// Its address in the file's own address space.
    pub addr: u64,
    /// Its size in bytes (0: unknown; saturated at 4 GiB).
    pub size: u32,
    /// Where its name is in the table's strings.
    name_at: u32,
}

/// A file's functions, sorted by address, and where their names are.
#[derive(Debug, Default)]
pub struct Functions {
    /// The functions.
    pub all: Vec<Func>,
    /// The string table's offset and size in the file.
    strings: (u64, u64),
}

/// An opened ELF file.
#[derive(Debug)]
pub struct Elf {
    file: File,
    sections: Vec<Section>,
    segments: Vec<Segment>,
    /// What the read may still keep, and until when.
    budget: Budget,
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

/// `num` entries of `entsize` bytes: both bounded (`entsize` from below by
/// what is parsed of an entry, from above by [`MAX_ENTRY`]; `num` by `max`).
fn table_len(entsize: u64, num: u64, min_entry: u64, max: u64, what: &str) -> std::io::Result<u64> {
    if !(min_entry..=MAX_ENTRY).contains(&entsize) || num > max {
        return Err(invalid(what));
    }
    Ok(entsize * num)
}

impl Elf {
    /// Open `path` and read its headers, counted against `budget`.
    pub fn open(path: &Path, budget: &Budget) -> std::io::Result<Elf> {
        if budget.late() {
            return Err(over(Spent::Time));
        }
        // The path is the worker's to choose (a FIFO or a device where its
        // mapped file was): opened without blocking, and read only when it
        // is a regular file, so that an open or a read never waits on it.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
            .open(path)?;
        if !file.metadata()?.is_file() {
            return Err(invalid("not a regular file"));
        }
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
        let segments = read_segments(&file, budget, phoff, phentsize, phnum)?;
        let mut sections = read_sections(&file, budget, shoff, shentsize, shnum)?;
        if let Some(names) = sections.get(shstrndx).cloned() {
            let table = budget.read_file(&file, names.offset, names.size.min(MAX_SHSTRTAB))?;
            for s in &mut sections {
                let name = str_at(&table, usize::try_from(s.name_at).unwrap_or(usize::MAX)).unwrap_or("");
                budget.charge(u64::try_from(name.len()).unwrap_or(u64::MAX))?;
                s.name = name.to_string();
            }
        }
        Ok(Elf { file, sections, segments, budget: budget.clone() })
    }

    /// The section named `name`.
    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|s| s.name == name)
    }

    /// A section's bytes, at most `max`, counted against the budget.
    pub fn section_bytes(&self, s: &Section, max: u64) -> std::io::Result<Vec<u8>> {
        if s.size > max {
            return Err(invalid("section too large"));
        }
        self.budget.read_file(&self.file, s.offset, s.size)
    }

    /// The bytes of sections that are of use only together, each at most
    /// `max`: all counted before any is read (so none is read in vain).
    pub fn sections_bytes(&self, all: &[&Section], max: u64) -> std::io::Result<Vec<Vec<u8>>> {
        if all.iter().any(|s| s.size > max) {
            return Err(invalid("section too large"));
        }
        self.budget.charge(all.iter().fold(0u64, |n, s| n.saturating_add(s.size)))?;
        all.iter().map(|s| self.budget.read_counted(&self.file, s.offset, s.size)).collect()
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
            .filter(|s| offset >= s.offset & !0xfff && offset < s.offset.saturating_add(s.filesz.max(1)))
            .max_by_key(|s| s.offset)?;
        // File offset `offset` is address `seg.vaddr + (offset - seg.offset)`.
        let file_addr = seg.vaddr.wrapping_add(offset).wrapping_sub(seg.offset);
        Some(start.wrapping_sub(file_addr))
    }

    /// The address (in the file's space) of the symbol `name`, from
    /// `.dynsym`, else `.symtab`.
    pub fn symbol(&self, name: &str) -> Option<u64> {
        for kind in [SHT_DYNSYM, SHT_SYMTAB] {
            let Some((table, strings)) = self.symbol_table(kind).ok().flatten() else { continue };
            let Ok(names) = self.budget.read_file(&self.file, strings.offset, strings.size) else { continue };
            let mut found = None;
            let _ = self.each_symbol(table, |name_at, _, addr, _| {
                let hit = str_at(&names, usize::try_from(name_at).unwrap_or(usize::MAX)) == Some(name);
                if hit {
                    found = Some(addr);
                }
                hit
            });
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// Every function with an address, sorted by address, from `.symtab`
    /// when the file has one (it names static functions too), else
    /// `.dynsym`; the index is counted against the budget as it grows
    /// (an error: none, rather than a part that names frames wrongly).
    pub fn functions(&self) -> std::io::Result<Functions> {
        for kind in [SHT_SYMTAB, SHT_DYNSYM] {
            let Some((table, strings)) = self.symbol_table(kind)? else { continue };
            let mut all: Vec<Func> = Vec::new();
            let mut failed = None;
            self.each_symbol(table, |name_at, info, addr, size| {
                if info & 0xf != STT_FUNC || addr == 0 || name_at == 0 {
                    return false;
                }
                if all.len() == all.capacity() {
                    // Grow by what is counted first.
                    let more = all.capacity().max(1024);
                    let bytes = u64::try_from(more * std::mem::size_of::<Func>()).unwrap_or(u64::MAX);
                    if let Err(e) = self.budget.charge(bytes) {
                        failed = Some(e);
                        return true;
                    }
                    all.reserve_exact(more);
                }
                all.push(Func { addr, size: u32::try_from(size).unwrap_or(u32::MAX), name_at });
                false
            })?;
            if let Some(e) = failed {
                return Err(e);
            }
            if !all.is_empty() {
                all.sort_unstable_by_key(|f| f.addr);
                all.dedup_by_key(|f| f.addr);
                return Ok(Functions { all, strings: (strings.offset, strings.size) });
            }
        }
        Ok(Functions::default())
    }

    /// The name of `f`, one of [`Self::functions`]'s, read from the file.
    pub fn name_of(&self, functions: &Functions, f: &Func) -> Option<String> {
        let (offset, size) = functions.strings;
        let at = u64::from(f.name_at);
        let len = size.checked_sub(at)?.min(u64::try_from(MAX_NAME + 1).unwrap_or(u64::MAX));
        let mut buf = vec![0u8; usize::try_from(len).ok()?];
        let n = self.file.read_at(&mut buf, offset.checked_add(at)?).ok()?;
        str_at(buf.get(..n)?, 0).map(str::to_string)
    }

    /// The first symbol table of `kind` and its strings, both bounded.
    fn symbol_table(&self, kind: u32) -> std::io::Result<Option<(&Section, &Section)>> {
        let Some(table) = self.sections.iter().find(|s| s.kind == kind) else { return Ok(None) };
        let strings = self
            .sections
            .get(usize::try_from(table.link).unwrap_or(usize::MAX))
            .ok_or_else(|| invalid("symbol strings"))?;
        if table.size > MAX_TABLE || strings.size > MAX_TABLE {
            return Err(invalid("symbol table too large"));
        }
        Ok(Some((table, strings)))
    }

    /// Walk the function and object symbols of `table` (`name_at, info,
    /// value, size`) until
    /// `stop` says so, reading the table a piece at a time (one piece's
    /// buffer is counted) and looking at the deadline as it goes.
    fn each_symbol(&self, table: &Section, mut stop: impl FnMut(u32, u8, u64, u64) -> bool) -> std::io::Result<()> {
        let piece = u64::try_from(SYM * SYMS_AT_ONCE).unwrap_or(u64::MAX);
        let mut buf = Vec::new();
        let mut at = 0u64;
        let mut walked = 0usize;
        while at < table.size {
            if self.budget.late() {
                return Err(over(Spent::Time));
            }
            let len = piece.min(table.size - at);
            if buf.is_empty() {
                self.budget.charge(len)?;
            }
            buf.resize(usize::try_from(len).map_err(|_| invalid("size"))?, 0);
            self.file.read_exact_at(&mut buf, table.offset.checked_add(at).ok_or_else(|| invalid("offset"))?)?;
            at += len;
            for entry in buf.chunks_exact(SYM) {
                walked += 1;
                if walked.is_multiple_of(DEADLINE_EVERY) && self.budget.late() {
                    return Err(over(Spent::Time));
                }
                // Only functions and objects are asked for: the others
                // (most of a table, all of a crafted one of zeros) are
                // passed over before they are parsed.
                if !entry.get(4).is_some_and(|i| matches!(i & 0xf, STT_FUNC | STT_OBJECT)) {
                    continue;
                }
                let (Some(name_at), Some(&info), Some(value), Some(size)) =
                    (u32_at(entry, 0), entry.get(4), u64_at(entry, 8), u64_at(entry, 16))
                else {
                    continue;
                };
                if stop(name_at, info, value, size) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

fn read_segments(file: &File, budget: &Budget, off: u64, entsize: u64, num: u64) -> std::io::Result<Vec<Segment>> {
    let len = table_len(entsize, num, 56, MAX_SEGMENTS, "program headers")?;
    let table = budget.read_file(file, off, len)?;
    let step = usize::try_from(entsize).map_err(|_| invalid("program headers"))?;
    budget.charge(num * u64::try_from(std::mem::size_of::<Segment>()).unwrap_or(u64::MAX))?;
    Ok(table
        .chunks_exact(step)
        .filter(|e| u32_at(e, 0) == Some(PT_LOAD))
        .filter_map(|e| Some(Segment { offset: u64_at(e, 8)?, vaddr: u64_at(e, 16)?, filesz: u64_at(e, 32)? }))
        .collect())
}

fn read_sections(file: &File, budget: &Budget, off: u64, entsize: u64, num: u64) -> std::io::Result<Vec<Section>> {
    if num == 0 {
        return Ok(Vec::new());
    }
    let len = table_len(entsize, num, 64, MAX_SECTIONS, "section headers")?;
    let table = budget.read_file(file, off, len)?;
    let step = usize::try_from(entsize).map_err(|_| invalid("section headers"))?;
    budget.charge(num * u64::try_from(std::mem::size_of::<Section>()).unwrap_or(u64::MAX))?;
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

    fn unbounded() -> Budget {
        Budget::new(u64::MAX, None)
    }

    /// A sparse ELF64 header: `shentsize` x `shnum` section headers at
    /// `shoff`, the file `len` bytes long (holes cost no disk).
    fn crafted(shentsize: u16, shnum: u16, shoff: u64, len: u64) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().expect("tmp");
        let mut head = [0u8; 64];
        head[..6].copy_from_slice(b"\x7fELF\x02\x01");
        head[40..48].copy_from_slice(&shoff.to_le_bytes());
        head[54..56].copy_from_slice(&56u16.to_le_bytes());
        head[58..60].copy_from_slice(&shentsize.to_le_bytes());
        head[60..62].copy_from_slice(&shnum.to_le_bytes());
        f.as_file().write_all_at(&head, 0).expect("write");
        f.as_file().set_len(len).expect("len");
        f
    }

    /// Section header `i` of a table of 64-byte entries at `shoff`:
    /// `(kind, offset, size, link)`.
    fn section(f: &File, shoff: u64, i: u64, (kind, offset, size, link): (u32, u64, u64, u32)) {
        let mut e = [0u8; 64];
        e[4..8].copy_from_slice(&kind.to_le_bytes());
        e[24..32].copy_from_slice(&offset.to_le_bytes());
        e[32..40].copy_from_slice(&size.to_le_bytes());
        e[40..44].copy_from_slice(&link.to_le_bytes());
        f.write_all_at(&e, shoff + i * 64).expect("write");
    }

    /// Issue 53: an entry size of 65535 with 4096 entries (a 256 MiB table)
    /// passed a bound checked only from below; it is refused before
    /// anything is read, and so is a table past the budget.
    #[test]
    fn header_tables_are_bounded_from_both_sides() {
        let huge = crafted(65535, 4096, 4096, 4096 + 65535 * 4096);
        let budget = Budget::new(u64::MAX, None);
        let e = Elf::open(huge.path(), &budget).expect_err("a 256 MiB table");
        assert!(e.to_string().contains("section headers"), "{e}");
        assert_eq!(budget.used(), 0);
        assert!(Elf::open(crafted(63, 4, 64, 4096).path(), &budget).is_err());
        let fine = crafted(64, 4096, 64, 64 + 64 * 4096);
        assert!(Elf::open(fine.path(), &unbounded()).is_ok());
        let small = Budget::new(64 << 10, None);
        let e = Elf::open(fine.path(), &small).expect_err("256 KiB of headers on a 64 KiB budget");
        assert!(e.get_ref().is_some_and(|e| e.is::<super::super::budget::OverBudget>()), "{e}");
        assert_eq!(small.used(), 0);
        // A FIFO where a mapped file was: refused at once, never waited on.
        let dir = tempfile::tempdir().expect("tmp");
        let fifo = dir.path().join("libpython3.so");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        let e = Elf::open(&fifo, &unbounded()).expect_err("a FIFO");
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    /// 64 MiB symbol and string tables (sparse): the walk keeps one piece
    /// of the table and the index it builds, both counted, and stops at
    /// the budget rather than reading on.
    #[test]
    fn symbol_tables_cost_their_index_within_the_budget() {
        let (shoff, big) = (4096u64, 64u64 << 20);
        let f = crafted(64, 3, shoff, 8192 + 2 * big);
        section(f.as_file(), shoff, 1, (SHT_SYMTAB, 8192, big, 2));
        section(f.as_file(), shoff, 2, (3, 8192 + big, big, 0));
        // Every symbol a function named at offset 1, at its own address.
        let mut syms = vec![0u8; 4 << 20];
        for (i, e) in syms.chunks_exact_mut(SYM).enumerate() {
            e[0..4].copy_from_slice(&1u32.to_le_bytes());
            e[4] = STT_FUNC;
            e[8..16].copy_from_slice(&(u64::try_from(i).expect("i") + 1).to_le_bytes());
        }
        f.as_file().write_all_at(&syms, 8192).expect("write");
        f.as_file().write_all_at(b"\0f\0", 8192 + big).expect("write");
        let budget = Budget::new(4 << 20, None);
        let elf = Elf::open(f.path(), &budget).expect("open");
        let e = elf.functions().expect_err("over the budget");
        assert!(e.get_ref().is_some_and(|e| e.is::<super::super::budget::OverBudget>()), "{e}");
        assert!(budget.used() <= 4 << 20, "{}", budget.used());
        // With room: 174,762 functions of 16 bytes, not their 24-byte entries and names.
        let roomy = Budget::new(64 << 20, None);
        let elf = Elf::open(f.path(), &roomy).expect("open");
        let fns = elf.functions().expect("functions");
        assert_eq!(fns.all.len(), (4 << 20) / SYM);
        assert_eq!(elf.name_of(&fns, &fns.all[7]).as_deref(), Some("f"));
        assert!(roomy.used() < 8 << 20, "{}", roomy.used());
        // A deadline already past: nothing is read.
        let late = Budget::new(u64::MAX, Some(std::time::Instant::now()));
        assert!(Elf::open(f.path(), &late).is_err());
    }

    #[test]
    fn finds_its_own_symbols_and_bias() {
        // The test binary itself: a static PIE with a symbol table.
        let exe = std::env::current_exe().expect("exe");
        let elf = Elf::open(&exe, &unbounded()).expect("open");
        assert!(elf.section(".text").is_some());
        let fns = elf.functions().expect("functions");
        assert!(fns.all.len() > 100, "{}", fns.all.len());
        assert!(fns.all.windows(2).all(|w| w[0].addr < w[1].addr));
        let mut names = fns.all.iter().filter_map(|f| elf.name_of(&fns, f));
        assert!(names.any(|n| n.contains("finds_its_own_symbols")));
        assert!(Elf::open(Path::new("/proc/self/status"), &unbounded()).is_err());
    }

    /// Every mapping of the loaded image (the run of mappings around the
    /// executable one; std's backtraces may map the file again as data).
    #[test]
    fn every_mapping_of_a_file_has_one_bias() {
        let exe = std::env::current_exe().expect("exe");
        let elf = Elf::open(&exe, &unbounded()).expect("open");
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
