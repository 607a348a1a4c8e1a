//! A run's files sent as a tar archive (gzip-compressed or not): the
//! regular files it holds, by relative path. Pure: bytes in, files out.
//!
//! Read: POSIX ustar (name + prefix), pax extended headers (`path`, and
//! `size` for the next entry), GNU long names (`L`). Directories are
//! skipped (made as files need them); links, devices and FIFOs are
//! refused by name, as is any path [`super::paths::check_path`] refuses.
//!
//! Everything is bounded before it is held: the archive is read as it
//! inflates, never inflated whole; each entry's size is judged from its
//! header (the files' total, a pax header's length) before a byte of it is
//! kept, and every byte kept is first asked of the caller's [`Room`] (the
//! control API's body budget), so that a small gzip body cannot grow into
//! what the budget did not grant. The number of entries and the inflated
//! length are bounded too, and reading stops at the archive's end.

use std::io::Read;

use super::paths::{MAX_FILES, MAX_FILES_BYTES, check_path, shown};

const BLOCK: usize = 512;
/// The largest archive (inflated) taken: the files' limit plus headers.
pub const MAX_ARCHIVE: usize = MAX_FILES_BYTES + (MAX_FILES + 16) * 2 * BLOCK;
/// Longest pax header or GNU long name.
const MAX_META: usize = 64 * 1024;

/// Asked for `n` more bytes before they are held; a refusal says why
/// (the control API's body budget: [`super::intake::Bodies::reserve`]).
pub type Room<'a> = &'a mut dyn FnMut(usize) -> Result<(), String>;

/// A reader that counts what it gave, and refuses to give more than
/// [`MAX_ARCHIVE`] bytes.
struct Counted<R> {
    inner: R,
    read: usize,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = (MAX_ARCHIVE + 1).saturating_sub(self.read);
        let end = buf.len().min(left);
        let n = self.inner.read(&mut buf[..end])?;
        self.read += n;
        if self.read > MAX_ARCHIVE {
            let why = format!("the archive inflates to more than {MAX_ARCHIVE} bytes");
            return Err(std::io::Error::new(std::io::ErrorKind::FileTooLarge, why));
        }
        Ok(n)
    }
}

/// Why reading the archive failed, in words: too long inflated, or a
/// broken (or cut) gzip stream; a tar cut short is found by its reader.
fn broken(e: &std::io::Error, gzip: bool) -> String {
    match e.kind() {
        std::io::ErrorKind::FileTooLarge => e.to_string(),
        _ if gzip => format!("the body is not valid gzip: {e}"),
        _ => format!("the archive cannot be read: {e}"),
    }
}

fn octal(field: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(field).ok()?;
    let text = text.trim_matches(|c: char| c == '\0' || c == ' ');
    if text.is_empty() {
        return Some(0);
    }
    u64::from_str_radix(text, 8).ok()
}

fn text(field: &[u8]) -> Result<String, String> {
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    String::from_utf8(field[..end].to_vec()).map_err(|_| "a name in the archive is not UTF-8".to_string())
}

/// `path` and `size` of a pax extended header's records (`LEN key=value\n`).
fn pax(data: &[u8]) -> Result<(Option<String>, Option<u64>), String> {
    let (mut path, mut size) = (None, None);
    let mut rest = data;
    while !rest.is_empty() {
        let sp = rest.iter().position(|b| *b == b' ').ok_or("a bad pax record")?;
        let len: usize =
            std::str::from_utf8(&rest[..sp]).ok().and_then(|l| l.parse().ok()).ok_or("a bad pax record")?;
        if len <= sp + 1 || len > rest.len() {
            return Err("a bad pax record".into());
        }
        let record = &rest[sp + 1..len - 1];
        if let Some(v) = record.strip_prefix(b"path=") {
            path = Some(String::from_utf8(v.to_vec()).map_err(|_| "a pax path is not UTF-8")?);
        } else if let Some(v) = record.strip_prefix(b"size=") {
            size = std::str::from_utf8(v).ok().and_then(|s| s.parse().ok());
        }
        rest = &rest[len..];
    }
    Ok((path, size))
}

/// Fill `buf` from `input`; how many bytes came (fewer only at its end).
fn fill(input: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match input.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// The regular files of a tar (or tar.gz) body, by relative path; every
/// byte of them asked of `room` before it is read.
pub fn files(body: &[u8], room: Room<'_>) -> Result<Vec<(String, Vec<u8>)>, String> {
    let gzip = body.starts_with(&[0x1f, 0x8b]);
    let inner: Box<dyn Read + '_> = if gzip { Box::new(flate2::read::GzDecoder::new(body)) } else { Box::new(body) };
    let mut input = Counted { inner, read: 0 };
    let io = |e: std::io::Error| broken(&e, gzip);
    let mut out = Vec::new();
    let (mut next_path, mut next_size): (Option<String>, Option<u64>) = (None, None);
    let (mut entries, mut total, mut h) = (0usize, 0usize, [0u8; BLOCK]);
    loop {
        let at = input.read;
        match fill(&mut input, &mut h).map_err(io)? {
            0 => break,
            BLOCK => {}
            _ => return Err("the archive is cut short".into()),
        }
        if h.iter().all(|b| *b == 0) {
            // Its end: what follows is never inflated.
            break;
        }
        entries += 1;
        if entries > 2 * MAX_FILES + 16 {
            return Err(format!("more than {MAX_FILES} files in the archive"));
        }
        let sum: u64 =
            h.iter().enumerate().map(|(i, b)| if (148..156).contains(&i) { 32 } else { u64::from(*b) }).sum();
        if octal(&h[148..156]) != Some(sum) {
            return Err(format!("the archive is not a tar (bad header checksum at byte {at})"));
        }
        let size = match next_size.take() {
            Some(s) => s,
            None => octal(&h[124..136]).ok_or("a bad size in the archive")?,
        };
        let size = usize::try_from(size).ok().filter(|s| *s <= MAX_ARCHIVE).ok_or_else(|| {
            format!("an entry of {size} bytes in the archive, which inflates to at most {MAX_ARCHIVE}")
        })?;
        let kind = h[156];
        let mut name = text(&h[0..100])?;
        if &h[257..262] == b"ustar" {
            let prefix = text(&h[345..500])?;
            if !prefix.is_empty() {
                name = format!("{prefix}/{name}");
            }
        }
        if let Some(p) = next_path.take() {
            name = p;
        }
        let name = name.trim_start_matches("./").to_string();
        // What the entry is decides, from its header, whether its bytes
        // are kept, and how many may be.
        let keep = match kind {
            b'x' | b'L' if size > MAX_META => return Err("an archive header is too long".into()),
            b'x' | b'L' => true,
            b'g' | b'5' => false,
            b'0' | 0 | b'7' => {
                check_path(&name)?;
                if out.len() == MAX_FILES {
                    return Err(format!("more than {MAX_FILES} files in the archive"));
                }
                total = total.saturating_add(size);
                if total > MAX_FILES_BYTES {
                    return Err(format!("files: more than {MAX_FILES_BYTES} bytes in all"));
                }
                true
            }
            _ => {
                return Err(format!(
                    "files: {} is a link, a device or a FIFO; only regular files and directories are taken",
                    shown(&name)
                ));
            }
        };
        let pad = (size.div_ceil(BLOCK) * BLOCK - size) as u64;
        if !keep {
            let skipped = std::io::copy(&mut (&mut input).take(size as u64 + pad), &mut std::io::sink()).map_err(io)?;
            if skipped < size as u64 + pad {
                return Err("the archive is cut short".into());
            }
            continue;
        }
        room(size)?;
        let mut content = Vec::with_capacity(size);
        (&mut input).take(size as u64).read_to_end(&mut content).map_err(io)?;
        if content.len() < size {
            return Err("the archive is cut short".into());
        }
        std::io::copy(&mut (&mut input).take(pad), &mut std::io::sink()).map_err(io)?;
        match kind {
            b'x' => (next_path, next_size) = pax(&content)?,
            b'L' => next_path = Some(text(&content)?),
            _ => out.push((name, content)),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ustar header for `name` of `size` bytes and type `kind`.
    fn header(name: &str, size: usize, kind: u8) -> Vec<u8> {
        let mut h = vec![0u8; BLOCK];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..107].copy_from_slice(b"0000644");
        h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        h
    }

    fn entry(name: &str, data: &[u8], kind: u8) -> Vec<u8> {
        let mut v = header(name, data.len(), kind);
        v.extend_from_slice(data);
        v.resize(v.len().div_ceil(BLOCK) * BLOCK, 0);
        v
    }

    fn archive(entries: &[Vec<u8>]) -> Vec<u8> {
        let mut v: Vec<u8> = entries.concat();
        v.extend_from_slice(&[0u8; 2 * BLOCK]);
        v
    }

    #[test]
    fn regular_files_come_out_by_path_links_and_escapes_do_not() {
        let long = format!("{}/x.py", "d".repeat(150));
        let body = format!(" path={long}\n");
        let pax_rec = format!("{}{body}", body.len() + 3);
        let tar = archive(&[
            entry("./", b"", b'5'),
            entry("./train.py", b"print(1)\n", b'0'),
            entry(&"x".repeat(10), b"", b'5'),
            entry("PaxHeader", pax_rec.as_bytes(), b'x'),
            entry("ignored-name", b"long\n", b'0'),
        ]);
        let got = files(&tar, &mut |_| Ok(())).expect("ok");
        assert_eq!(got, vec![("train.py".to_string(), b"print(1)\n".to_vec()), (long, b"long\n".to_vec())]);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).expect("gz");
        assert_eq!(files(&gz.finish().expect("gz"), &mut |_| Ok(())).expect("gzip").len(), 2);
        for (bad, says) in [
            (archive(&[entry("link", b"", b'2')]), "is a link"),
            (archive(&[entry("../etc/passwd", b"x", b'0')]), "stay inside"),
            (archive(&[entry("/etc/passwd", b"x", b'0')]), "absolute"),
            (vec![0x1f, 0x8b, 1, 2, 3], "not valid gzip"),
            (vec![1u8; BLOCK], "not a tar"),
            (entry("cut.py", &[b'a'; 600], b'0')[..BLOCK + 10].to_vec(), "cut short"),
        ] {
            let e = files(&bad, &mut |_| Ok(())).expect_err("refused");
            assert!(e.contains(says), "{says}: {e}");
        }
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut gz, data).expect("gz");
        gz.finish().expect("gz")
    }

    /// A 47 KiB gzip body of a 47 MiB file (issue 53: 64 of them at once
    /// took a 2 GiB pod): its bytes are asked for from its header, before
    /// any is inflated, and a refusal stops the read there.
    #[test]
    fn an_inflated_file_is_asked_for_before_it_is_held() {
        let big = 47 << 20;
        let body = gzip(&archive(&[entry("a.py", b"x\n", b'0'), entry("big.bin", &vec![0u8; big], b'0')]));
        assert!(body.len() < 100 << 10, "{}", body.len());
        let mut asked = Vec::new();
        let got = files(&body, &mut |n| {
            asked.push(n);
            Ok(())
        })
        .expect("granted");
        assert_eq!((asked, got.len(), got[1].1.len()), (vec![2, big], 2, big));
        let mut asked = Vec::new();
        let e = files(&body, &mut |n| {
            asked.push(n);
            if n > 1 << 20 { Err(format!("{n} bytes: over the budget")) } else { Ok(()) }
        })
        .expect_err("refused");
        assert_eq!((e.as_str(), asked), ("49283072 bytes: over the budget", vec![2, big]));
    }

    /// Sizes are judged from the headers, before anything is inflated or
    /// asked for: a file past the files' total, a pax header past its
    /// bound; and whatever follows the archive's end is not read.
    #[test]
    fn sizes_are_judged_from_the_headers() {
        let asked = std::cell::Cell::new(0usize);
        let mut none = |n: usize| {
            asked.set(asked.get() + n);
            Ok(())
        };
        // A header that claims 49 MiB, with nothing behind it.
        let huge = header("huge.bin", 49 << 20, b'0');
        let e = files(&gzip(&huge), &mut none).expect_err("too large");
        assert!(e.contains("more than 50331648 bytes in all"), "{e}");
        let long = header("PaxHeader", MAX_META + 1, b'x');
        let e = files(&long, &mut none).expect_err("too long");
        assert!(e.contains("header is too long"), "{e}");
        assert_eq!(asked.get(), 0);
        // An end, then a header that claims 49 MiB: never looked at.
        let mut tar = archive(&[entry("a.py", b"1", b'0')]);
        tar.extend_from_slice(&huge);
        assert_eq!(files(&gzip(&tar), &mut none).expect("ends at its end").len(), 1);
        // A size no archive taken can hold, even for an entry skipped.
        let e = files(&header("d/", 1 << 32, b'5'), &mut none).expect_err("too large");
        assert!(e.contains("an entry of 4294967296 bytes"), "{e}");
        // Entries skipped (directories) are read past, not held.
        let cut = gzip(&header("d/", 1 << 20, b'5'));
        assert_eq!(files(&cut, &mut none).expect_err("cut"), "the archive is cut short");
    }
}
