//! PMI's two wire formats, parsed and written with bounds (a rank is not
//! trusted to stay within them).
//!
//! - PMI-1 (simple PMI): one command a line, `cmd=NAME key=value ...\n`.
//!   Tokens are separated by spaces; a key is `[A-Za-z0-9_/-]+`; a value
//!   runs to the next unescaped space or the end of the line, and a
//!   backslash takes the next character as it is (MPICH's clients and
//!   servers agree on this; `pmi_wire.c`). A key may stand without `=`.
//!   `mcmd=spawn` starts a multi-line command that ends at `endcmd`; spawn
//!   is refused by the server, so only its start is recognised here.
//! - PMI-2: a frame of a 6-character length (decimal, left-padded with
//!   spaces, `%6u`; Slurm's client writes it left-justified, `%-6d`, and
//!   reads either with `atoi`) and that many bytes of
//!   `cmd=NAME;key=value;...;`. A value runs to the next single `;`: a
//!   doubled `;;` is one `;` in the value (Slurm's `libpmi2` writes and
//!   reads it so, seen 2026-11-27). The length counts what follows the
//!   prefix; a trailing NUL that some clients count is ignored.
//!
//! Read from the original specifications and MPICH's `src/pmi`; written
//! here.

/// The longest PMI-1 line accepted, its newline included. MPICH's clients
/// read replies of at most 1024 bytes (`PMIU_MAXLINE`); puts of its
/// business cards stay under its `vallen_max`.
pub const MAX_LINE: usize = 64 * 1024;
/// The longest PMI-2 frame body: what 6 decimal digits can say.
pub const MAX_FRAME: usize = 999_999;

/// One command or reply: its name and its arguments in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// `cmd=` (or `mcmd=`) value.
    pub name: String,
    /// `key=value` pairs, and bare keys (`None`), in wire order.
    pub args: Vec<(String, Option<String>)>,
}

impl Command {
    /// A command named `name` without arguments.
    pub fn new(name: &str) -> Command {
        Command { name: name.to_string(), args: Vec::new() }
    }

    /// This command with `key=value` appended.
    #[must_use]
    pub fn arg(mut self, key: &str, value: impl ToString) -> Command {
        self.args.push((key.to_string(), Some(value.to_string())));
        self
    }

    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.args.iter().find(|(k, _)| k == key).and_then(|(_, v)| v.as_deref())
    }
}

/// Why a line or frame is not PMI.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// It does not start with `cmd=` (`mcmd=` for PMI-1's spawn).
    #[error("a PMI command starts with cmd=")]
    NoCmd,
    /// A byte where a key must start.
    #[error("byte {at}: a key must be letters, digits, '_', '-' or '/'")]
    Key {
        /// Offset in the line or frame body.
        at: usize,
    },
    /// `key=` with nothing after it.
    #[error("byte {at}: '=' without a value")]
    Empty {
        /// Offset in the line or frame body.
        at: usize,
    },
    /// A PMI-2 length prefix that is not a number of at most 6 digits.
    #[error("the PMI-2 length prefix is not a decimal number of 6 characters")]
    Length,
    /// Over [`MAX_LINE`].
    #[error("a PMI-1 line over {MAX_LINE} bytes")]
    TooLong,
    /// Not UTF-8.
    #[error("not UTF-8 text")]
    Utf8,
}

fn is_key(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'/')
}

/// Parse one PMI-1 line (without its newline; a `\r` or `\n` left at the
/// end is dropped).
pub fn parse_v1(line: &[u8]) -> Result<Command, Error> {
    if line.len() >= MAX_LINE {
        return Err(Error::TooLong);
    }
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let lead = if line.starts_with(b"cmd=") {
        "cmd"
    } else if line.starts_with(b"mcmd=") {
        "mcmd"
    } else {
        return Err(Error::NoCmd);
    };
    let tokens = tokens(line, b' ', true)?;
    assemble(lead, tokens)
}

/// The body length a PMI-2 frame's 6-byte prefix announces.
pub fn frame_len(prefix: &[u8; 6]) -> Result<usize, Error> {
    // Right-aligned (`%6u`) or left-justified (`%-6d`, Slurm's client).
    let text = std::str::from_utf8(prefix).map_err(|_| Error::Length)?.trim_matches(' ');
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::Length);
    }
    text.parse().map_err(|_| Error::Length)
}

/// Parse a PMI-2 frame body (what follows the length prefix).
pub fn parse_v2(body: &[u8]) -> Result<Command, Error> {
    let body = body.strip_suffix(b"\0").unwrap_or(body);
    if !body.starts_with(b"cmd=") {
        return Err(Error::NoCmd);
    }
    let tokens = tokens(body, b';', false)?;
    assemble("cmd", tokens)
}

type Token = (String, Option<String>);

/// Split `text` into tokens at `sep`; with `escapes` (PMI-1), a backslash
/// takes the next byte into a value as it is; without (PMI-2), a doubled
/// `sep` is one in the value.
fn tokens(text: &[u8], sep: u8, escapes: bool) -> Result<Vec<Token>, Error> {
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        while i < text.len() && text[i] == b' ' {
            i += 1;
        }
        if i >= text.len() {
            return Ok(out);
        }
        let start = i;
        while i < text.len() && is_key(text[i]) {
            i += 1;
        }
        if i == start {
            return Err(Error::Key { at: i });
        }
        let key = String::from_utf8(text[start..i].to_vec()).map_err(|_| Error::Utf8)?;
        if i < text.len() && text[i] == b'=' {
            i += 1;
            let mut value = Vec::new();
            while i < text.len() {
                let b = text[i];
                if b == sep && !escapes && text.get(i + 1) == Some(&sep) {
                    // PMI-2: a doubled `;` is one in the value.
                    value.push(sep);
                    i += 2;
                } else if b == sep {
                    break;
                } else if escapes && b == b'\\' && i + 1 < text.len() {
                    value.push(text[i + 1]);
                    i += 2;
                } else {
                    value.push(b);
                    i += 1;
                }
            }
            if value.is_empty() {
                return Err(Error::Empty { at: i });
            }
            out.push((key, Some(String::from_utf8(value).map_err(|_| Error::Utf8)?)));
        } else if i < text.len() && text[i] != sep {
            return Err(Error::Key { at: i });
        } else {
            out.push((key, None));
        }
        if i < text.len() {
            i += 1; // the separator
        }
    }
}

/// The command from its tokens: the first is `lead=NAME`.
fn assemble(lead: &str, mut tokens: Vec<Token>) -> Result<Command, Error> {
    match tokens.first() {
        Some((k, Some(_))) if k == lead => {
            let (_, name) = tokens.remove(0);
            Ok(Command { name: name.unwrap_or_default(), args: tokens })
        }
        _ => Err(Error::NoCmd),
    }
}

/// `command` as a PMI-1 line: spaces and backslashes in values escaped.
pub fn format_v1(command: &Command) -> Vec<u8> {
    let mut out = format!("cmd={}", command.name).into_bytes();
    for (key, value) in &command.args {
        out.push(b' ');
        out.extend_from_slice(key.as_bytes());
        if let Some(v) = value {
            out.push(b'=');
            for b in v.bytes() {
                if matches!(b, b' ' | b'\\') {
                    out.push(b'\\');
                }
                out.push(b);
            }
        }
    }
    out.push(b'\n');
    out
}

/// `command` as a PMI-2 frame (a `;` in a value doubled), or `None` when
/// the frame would outgrow [`MAX_FRAME`].
pub fn format_v2(command: &Command) -> Option<Vec<u8>> {
    let mut body = format!("cmd={};", command.name);
    for (key, value) in &command.args {
        body.push_str(key);
        if let Some(v) = value {
            body.push('=');
            body.push_str(&v.replace(';', ";;"));
        }
        body.push(';');
    }
    if body.len() > MAX_FRAME {
        return None;
    }
    Some(format!("{:6}{body}", body.len()).into_bytes())
}

#[cfg(test)]
mod tests {
    use test_case::test_case;

    use super::*;

    fn cmd(name: &str, args: &[(&str, Option<&str>)]) -> Command {
        Command {
            name: name.to_string(),
            args: args.iter().map(|(k, v)| (k.to_string(), v.map(str::to_string))).collect(),
        }
    }

    #[test_case(b"cmd=init pmi_version=1 pmi_subversion=1\n", cmd("init", &[("pmi_version", Some("1")), ("pmi_subversion", Some("1"))]); "init")]
    #[test_case(b"cmd=barrier_in\n", cmd("barrier_in", &[]); "bare command")]
    #[test_case(b"cmd=put kvsname=kvs_1 key=P0-businesscard value=description#h$port#1$\n", cmd("put", &[("kvsname", Some("kvs_1")), ("key", Some("P0-businesscard")), ("value", Some("description#h$port#1$"))]); "a business card")]
    #[test_case(b"cmd=put key=a value=two\\ words\\\\ end", cmd("put", &[("key", Some("a")), ("value", Some("two words\\")), ("end", None)]); "escapes, no newline")]
    #[test_case(b"cmd=get_maxes   \r\n", cmd("get_maxes", &[]); "trailing spaces and CR")]
    #[test_case(b"cmd=spawn_result rc=0 flag", cmd("spawn_result", &[("rc", Some("0")), ("flag", None)]); "a bare key")]
    #[test_case(b"mcmd=spawn", cmd("spawn", &[]); "the start of a multi-line spawn")]
    fn pmi1_lines_parse(line: &[u8], want: Command) {
        assert_eq!(parse_v1(line), Ok(want));
    }

    #[test_case(b"" => Error::NoCmd; "empty")]
    #[test_case(b"init pmi_version=1" => Error::NoCmd; "no cmd=")]
    #[test_case(b"cmd= x=1" => Error::Empty { at: 4 }; "empty name")]
    #[test_case(b"cmd=put key=" => Error::Empty { at: 12 }; "empty value")]
    #[test_case(b"cmd=put =1" => Error::Key { at: 8 }; "no key")]
    #[test_case(b"cmd=put k\xff=1" => Error::Key { at: 9 }; "a byte that no key has")]
    #[test_case(b"cmd=put key=\xff\xfe" => Error::Utf8; "not utf-8")]
    fn bad_pmi1_lines_say_why(line: &[u8]) -> Error {
        parse_v1(line).expect_err("must be refused")
    }

    #[test]
    fn a_line_over_the_bound_is_refused_before_it_is_read() {
        let mut line = b"cmd=put value=".to_vec();
        line.resize(MAX_LINE, b'x');
        assert_eq!(parse_v1(&line), Err(Error::TooLong));
    }

    #[test]
    fn pmi1_replies_round_trip_with_escapes() {
        let reply = Command::new("get_result").arg("rc", 0).arg("value", "a b\\c");
        let line = format_v1(&reply);
        assert_eq!(line, b"cmd=get_result rc=0 value=a\\ b\\\\c\n");
        let parsed = parse_v1(&line).expect("parse");
        assert_eq!((parsed.get("value"), parsed.get("rc"), parsed.get("nothing")), (Some("a b\\c"), Some("0"), None));
        assert_eq!(parsed, reply);
    }

    #[test_case(b"cmd=fullinit;pmirank=3;threaded=FALSE;", cmd("fullinit", &[("pmirank", Some("3")), ("threaded", Some("FALSE"))]); "fullinit")]
    #[test_case(b"cmd=kvs-fence;thrid=0x55d1;\0", cmd("kvs-fence", &[("thrid", Some("0x55d1"))]); "counted NUL")]
    #[test_case(b"cmd=kvs-put;key=k;value=a b=c;", cmd("kvs-put", &[("key", Some("k")), ("value", Some("a b=c"))]); "spaces and = in a value")]
    #[test_case(b"cmd=info-getnodeattr;key=x;wait", cmd("info-getnodeattr", &[("key", Some("x")), ("wait", None)]); "a bare key last")]
    fn pmi2_frames_parse(body: &[u8], want: Command) {
        assert_eq!(parse_v2(body), Ok(want));
    }

    #[test_case(b"    36" => Ok(36); "padded")]
    #[test_case(b"999999" => Ok(999_999); "the largest")]
    #[test_case(b"      " => Err(Error::Length); "blank")]
    #[test_case(b"  -1  " => Err(Error::Length); "sign")]
    #[test_case(b"12 34 " => Err(Error::Length); "inner space")]
    #[test_case(b"cmd=in" => Err(Error::Length); "a PMI-1 line")]
    fn pmi2_length_prefixes(prefix: &[u8; 6]) -> Result<usize, Error> {
        frame_len(prefix)
    }

    #[test]
    fn pmi2_frames_round_trip_escape_semicolons_and_refuse_oversize() {
        let reply = Command::new("kvs-get-response").arg("rc", 0).arg("found", "TRUE").arg("value", "v");
        let frame = format_v2(&reply).expect("frame");
        assert_eq!(frame, b"    45cmd=kvs-get-response;rc=0;found=TRUE;value=v;");
        let (prefix, body) = frame.split_at(6);
        assert_eq!(frame_len(prefix.try_into().expect("6 bytes")), Ok(body.len()));
        assert_eq!(parse_v2(body), Ok(reply));
        assert_eq!(format_v2(&Command::new("x").arg("value", "a;b")), Some(b"    17cmd=x;value=a;;b;".to_vec()));
        let slurm = parse_v2(b"cmd=kvs-put;key=k;value=val-of-0;;with=semi;;;").expect("escaped");
        assert_eq!(slurm.get("value"), Some("val-of-0;with=semi;"));
        assert_eq!(frame_len(b"56    "), Ok(56), "Slurm's left-justified length");
        assert_eq!(format_v2(&Command::new("x").arg("value", "v".repeat(MAX_FRAME))), None);
    }
}
