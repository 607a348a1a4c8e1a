//! The names and sizes of a run's files, which both the run's check
//! (`super::spec`) and its archive's reader (`super::tar`) hold them to,
//! and how a name from a client is shown in a message or a log line.

/// Most files in one run.
pub const MAX_FILES: usize = 10_000;
/// Most bytes of all a run's files together.
pub const MAX_FILES_BYTES: usize = 48 * 1024 * 1024;
/// Longest relative path of a file.
pub const MAX_PATH: usize = 1024;

/// A relative path inside the run's directory: plain names separated by
/// `/`, no `.`, `..` or empty part, no NUL, not absolute.
pub fn check_path(path: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("files: {} {why}", shown(path)));
    if path.is_empty() || path.len() > MAX_PATH {
        return bad(&format!("must be 1-{MAX_PATH} bytes"));
    }
    if path.starts_with('/') {
        return bad("is absolute; give a path relative to the run's directory");
    }
    if path.contains('\0') || path.contains('\\') || path.chars().any(char::is_control) {
        return bad("holds a NUL, a backslash or a control character");
    }
    if path.split('/').any(|p| p.is_empty() || p == "." || p == "..") {
        return bad("has an empty, . or .. part; it must stay inside the run's directory");
    }
    Ok(())
}

/// A name from a client, safe to put in a message or a log line: escaped
/// and cut to 200 characters.
pub fn shown(s: &str) -> String {
    let e: String = s.escape_debug().take(200).collect();
    format!("\"{e}\"")
}
