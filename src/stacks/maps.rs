//! A process from outside: its mappings (`/proc/PID/maps`) and bounded
//! reads of its memory (`sys::read_remote`, so nothing is paused or
//! changed). Every error says which of "gone", "not allowed" or "bad
//! address" it was.

use std::path::PathBuf;

use super::Error;
use super::budget::Budget;
use crate::sys;

/// Most lines of `/proc/PID/maps` read (torch's workers have a few thousand).
const MAX_MAPS: usize = 65_536;
/// Most bytes of `/proc/PID/maps` read.
const MAX_MAPS_BYTES: u64 = 8 << 20;
/// Longest path of a mapped file kept.
const MAX_PATH: usize = 4096;

/// One mapping of a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Executable?
    pub exec: bool,
    /// File offset of `start`.
    pub offset: u64,
    /// The file's path as the kernel shows it.
    pub path: String,
}

/// Parse one line of `/proc/PID/maps`; None for anonymous mappings and
/// lines that do not parse.
pub fn parse_line(line: &str) -> Option<Mapping> {
    let mut f = line.splitn(6, ' ');
    let (range, perms, offset) = (f.next()?, f.next()?, f.next()?);
    let (_dev, _inode) = (f.next()?, f.next()?);
    let path = f.next()?.trim_start();
    if !path.starts_with('/') {
        return None;
    }
    let (a, b) = range.split_once('-')?;
    Some(Mapping {
        start: u64::from_str_radix(a, 16).ok()?,
        end: u64::from_str_radix(b, 16).ok()?,
        exec: perms.as_bytes().get(2) == Some(&b'x'),
        offset: u64::from_str_radix(offset, 16).ok()?,
        path: path.to_string(),
    })
}

/// The file mappings of `pid`: at most [`MAX_MAPS_BYTES`] of the file
/// read, names that are not UTF-8 kept lossily, paths of at most
/// [`MAX_PATH`] bytes (a longer one is no file the reader opens); what is
/// kept counted against `budget`.
pub fn read(pid: i32, budget: &Budget) -> Result<Vec<Mapping>, Error> {
    use std::io::Read;
    let file = std::fs::File::open(format!("/proc/{pid}/maps")).map_err(|e| Error::from_io(pid, &e))?;
    let mut raw = Vec::new();
    file.take(MAX_MAPS_BYTES).read_to_end(&mut raw).map_err(|e| Error::from_io(pid, &e))?;
    if raw.is_empty() {
        // A zombie's maps are empty.
        return Err(Error::Gone);
    }
    let size = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    budget.charge(size(raw.capacity())).map_err(|e| Error::from_io(pid, &e))?;
    let mut out = Vec::new();
    for m in raw
        .split(|b| *b == b'\n')
        .take(MAX_MAPS)
        .filter(|l| l.len() <= MAX_PATH + 128)
        .filter_map(|l| parse_line(&String::from_utf8_lossy(l)))
    {
        budget.charge(size(std::mem::size_of::<Mapping>() + m.path.len())).map_err(|e| Error::from_io(pid, &e))?;
        out.push(m);
    }
    Ok(out)
}

/// Where the process sees `path`: through its root, so a worker in
/// another mount namespace is read from its own files.
pub fn file_of(pid: i32, path: &str) -> PathBuf {
    let own = PathBuf::from(format!("/proc/{pid}/root{path}"));
    if own.exists() { own } else { PathBuf::from(path) }
}

/// Reads of one process's memory.
#[derive(Debug, Clone, Copy)]
pub struct Mem {
    /// The process.
    pub pid: i32,
}

impl Mem {
    /// Exactly `buf.len()` bytes at `addr`.
    pub fn read_into(&self, addr: u64, buf: &mut [u8]) -> Result<(), Error> {
        if addr == 0 {
            return Err(Error::BadAddress);
        }
        match sys::read_remote(self.pid, addr, buf) {
            Ok(n) if n == buf.len() => Ok(()),
            Ok(_) => Err(Error::BadAddress),
            Err(e) => Err(Error::from_io(self.pid, &e)),
        }
    }

    /// `len` bytes at `addr`.
    pub fn bytes(&self, addr: u64, len: usize) -> Result<Vec<u8>, Error> {
        let mut buf = vec![0u8; len];
        self.read_into(addr, &mut buf)?;
        Ok(buf)
    }

    /// A 64-bit little-endian word at `addr`.
    pub fn u64(&self, addr: u64) -> Result<u64, Error> {
        let mut b = [0u8; 8];
        self.read_into(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// A 32-bit little-endian word at `addr`.
    pub fn u32(&self, addr: u64) -> Result<u32, Error> {
        let mut b = [0u8; 4];
        self.read_into(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_file_mappings_only() {
        let m = parse_line("7f1c2a000000-7f1c2a021000 r-xp 00001000 08:01 1234   /usr/lib/libc.so.6").expect("line");
        assert_eq!(
            m,
            Mapping {
                start: 0x7f1c_2a00_0000,
                end: 0x7f1c_2a02_1000,
                exec: true,
                offset: 0x1000,
                path: "/usr/lib/libc.so.6".into()
            }
        );
        assert_eq!(parse_line("7ffd1000-7ffd2000 rw-p 00000000 00:00 0 [stack]"), None);
        assert_eq!(parse_line("55d0-55d1 rw-p 00000000 00:00 0"), None);
        assert_eq!(parse_line("garbage"), None);
        let spaced = parse_line("1000-2000 r--p 00000000 08:01 9 /tmp/a b (deleted)").expect("line");
        assert_eq!(spaced.path, "/tmp/a b (deleted)");
    }

    #[test]
    fn reads_its_own_memory_and_refuses_null() {
        let word: u64 = 0x1122_3344_5566_7788;
        let mem = Mem { pid: i32::try_from(std::process::id()).expect("pid") };
        assert_eq!(mem.u64(std::ptr::addr_of!(word) as u64).expect("read"), word);
        assert!(matches!(mem.u64(0), Err(Error::BadAddress)));
        assert!(!read(mem.pid, &Budget::new(u64::MAX, None)).expect("maps").is_empty());
    }
}
