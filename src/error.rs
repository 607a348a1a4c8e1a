//! Error text for logs and messages: an error with its whole `source()`
//! chain on one line.

/// "outer: inner: innermost" for logs and error text.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}
