//! A run's files sent as a tar archive (gzip-compressed or not): the
//! regular files it holds, by relative path. Pure: bytes in, files out.
//!
//! Read: POSIX ustar (name + prefix), pax extended headers (`path`, and
//! `size` for the next entry), GNU long names (`L`). Directories are
//! skipped (made as files need them); links, devices and FIFOs are
//! refused by name, as is any path [`super::paths::check_path`] refuses.
//! Everything is bounded: the inflated size, the number of entries, a
//! pax header's length.

use std::io::Read;

use super::paths::{MAX_FILES, MAX_FILES_BYTES, check_path, shown};

const BLOCK: usize = 512;
/// The largest archive (inflated) taken: the files' limit plus headers.
pub const MAX_ARCHIVE: usize = MAX_FILES_BYTES + (MAX_FILES + 16) * 2 * BLOCK;
/// Longest pax header or GNU long name.
const MAX_META: usize = 64 * 1024;

/// Inflate `body` when it is gzip, bounded by [`MAX_ARCHIVE`].
fn inflate(body: &[u8]) -> Result<Vec<u8>, String> {
    if !body.starts_with(&[0x1f, 0x8b]) {
        return Ok(body.to_vec());
    }
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(body)
        .take(MAX_ARCHIVE as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("the body is not valid gzip: {e}"))?;
    if out.len() > MAX_ARCHIVE {
        return Err(format!("the archive inflates to more than {MAX_ARCHIVE} bytes"));
    }
    Ok(out)
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

/// The regular files of a tar (or tar.gz) body, by relative path.
pub fn files(body: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    let data = inflate(body)?;
    let mut out = Vec::new();
    let mut at = 0usize;
    let (mut next_path, mut next_size): (Option<String>, Option<u64>) = (None, None);
    let mut entries = 0usize;
    while at + BLOCK <= data.len() {
        let h = &data[at..at + BLOCK];
        if h.iter().all(|b| *b == 0) {
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
        let size = usize::try_from(size).map_err(|_| "an entry too large")?;
        let start = at + BLOCK;
        let end = start.checked_add(size).filter(|e| *e <= data.len()).ok_or("the archive is cut short")?;
        let content = &data[start..end];
        at = start + size.div_ceil(BLOCK) * BLOCK;
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
        match kind {
            b'x' | b'L' if size > MAX_META => return Err("an archive header is too long".into()),
            b'x' => (next_path, next_size) = pax(content)?,
            b'L' => next_path = Some(text(content)?),
            b'g' => {}
            b'5' => {}
            b'0' | 0 | b'7' => {
                let name = name.trim_start_matches("./").to_string();
                check_path(&name)?;
                out.push((name, content.to_vec()));
                if out.len() > MAX_FILES {
                    return Err(format!("more than {MAX_FILES} files in the archive"));
                }
            }
            _ => {
                return Err(format!(
                    "files: {} is a link, a device or a FIFO; only regular files and directories are taken",
                    shown(&name)
                ));
            }
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
        let got = files(&tar).expect("ok");
        assert_eq!(got, vec![("train.py".to_string(), b"print(1)\n".to_vec()), (long, b"long\n".to_vec())]);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).expect("gz");
        assert_eq!(files(&gz.finish().expect("gz")).expect("gzip").len(), 2);
        for (bad, says) in [
            (archive(&[entry("link", b"", b'2')]), "is a link"),
            (archive(&[entry("../etc/passwd", b"x", b'0')]), "stay inside"),
            (archive(&[entry("/etc/passwd", b"x", b'0')]), "absolute"),
            (vec![0x1f, 0x8b, 1, 2, 3], "not valid gzip"),
            (vec![1u8; BLOCK], "not a tar"),
            (entry("cut.py", &[b'a'; 600], b'0')[..BLOCK + 10].to_vec(), "cut short"),
        ] {
            let e = files(&bad).expect_err("refused");
            assert!(e.contains(says), "{says}: {e}");
        }
    }
}
