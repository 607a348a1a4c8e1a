//! fnmatch-style patterns, as Trainer's initializers apply them (`*`, `?`,
//! `[...]`, `[!...]`; `*` also crosses `/`, as Python's fnmatch does).

/// Does `name` match `pat`?
pub fn fnmatch(pat: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pat.chars().collect(), name.chars().collect());
    matches(&p, &n)
}

fn matches(p: &[char], n: &[char]) -> bool {
    match p.first() {
        None => n.is_empty(),
        Some('*') => (0..=n.len()).any(|i| matches(&p[1..], &n[i..])),
        Some('?') => !n.is_empty() && matches(&p[1..], &n[1..]),
        Some('[') => match (class(&p[1..]), n.first()) {
            (Some((set, negate, used)), Some(c)) => (set(*c) != negate) && matches(&p[1 + used..], &n[1..]),
            (None, Some(c)) => *c == '[' && matches(&p[1..], &n[1..]), // a lone `[` is literal
            (_, None) => false,
        },
        Some(c) => n.first() == Some(c) && matches(&p[1..], &n[1..]),
    }
}

type Class = Box<dyn Fn(char) -> bool>;

/// `[...]` after the `[`: (membership, negated, chars used incl. `]`).
fn class(p: &[char]) -> Option<(Class, bool, usize)> {
    let negate = matches!(p.first(), Some('!' | '^'));
    let start = usize::from(negate);
    // A `]` right after `[` or `[!` is a member.
    let end = p.iter().skip(start + 1).position(|c| *c == ']')? + start + 1;
    let body: Vec<char> = p[start..end].to_vec();
    let mut ranges = Vec::new();
    let mut i = 0;
    while i < body.len() {
        if i + 2 < body.len() && body[i + 1] == '-' {
            ranges.push((body[i], body[i + 2]));
            i += 3;
        } else {
            ranges.push((body[i], body[i]));
            i += 1;
        }
    }
    Some((Box::new(move |c| ranges.iter().any(|(a, b)| *a <= c && c <= *b)), negate, end + 1))
}

/// Which files to fetch: any allow pattern (all when none), and no ignore
/// pattern, matched against the path relative to the source root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Allow patterns (empty: everything).
    pub allow: Vec<String>,
    /// Ignore patterns.
    pub ignore: Vec<String>,
}

impl Filter {
    /// Keep `path`?
    pub fn keeps(&self, path: &str) -> bool {
        (self.allow.is_empty() || self.allow.iter().any(|p| fnmatch(p, path)))
            && !self.ignore.iter().any(|p| fnmatch(p, path))
    }

    /// The patterns, for messages.
    pub fn describe(&self) -> String {
        let list = |v: &[String]| if v.is_empty() { "none".to_string() } else { v.join(",") };
        format!(
            "allow {}, ignore {}",
            if self.allow.is_empty() { "all".to_string() } else { list(&self.allow) },
            list(&self.ignore)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("*.json", "config.json", true; "star")]
    #[test_case("*.json", "sub/config.json", true; "star crosses slash like python")]
    #[test_case("*.bin", "model.safetensors", false; "no match")]
    #[test_case("model-?????-of-*.safetensors", "model-00001-of-00002.safetensors", true; "question marks")]
    #[test_case("[!a]*", "b.txt", true; "negated class")]
    #[test_case("[!a]*", "a.txt", false; "negated class excludes")]
    #[test_case("data[0-9].csv", "data7.csv", true; "range")]
    #[test_case("[", "[", true; "lone bracket is literal")]
    fn fnmatch_like_python(p: &str, n: &str, want: bool) {
        assert_eq!(fnmatch(p, n), want);
    }

    #[test]
    fn allow_then_ignore() {
        let f = Filter {
            allow: vec!["*.json".into(), "*.safetensors".into()],
            ignore: vec!["*.bin".into(), "ignored/*".into()],
        };
        assert!(f.keeps("config.json") && f.keeps("a/model.safetensors"));
        assert!(!f.keeps("pytorch_model.bin") && !f.keeps("ignored/x.json") && !f.keeps("README.md"));
        assert!(Filter::default().keeps("anything"));
    }
}
