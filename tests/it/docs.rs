//! The book (`docs/`, built by `tests/book.sh` with mdBook) and `README.md`:
//! every relative link between them names a file that is there and, with a
//! `#fragment`, a heading of that page, as mdBook slugs it. mdBook itself
//! builds a book with broken links without a word, so this test is the check.
//! Links out of the book's `src/` are refused too: the built book has only
//! what is under `src/` (`{{#include}}` copies a file in, and is followed).
//!
//! The other tests that read documented tables (exit codes, the layout)
//! read them from the book through [`chapter`].

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

/// A chapter of the book, `docs/src/<name>.md`, with its includes expanded.
pub fn chapter(name: &str) -> String {
    let path = crate::util::repo().join("docs/src").join(format!("{name}.md"));
    expand(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The text of a Markdown file with every `{{#include PATH}}` replaced by
/// that file's text (PATH relative to the including file, as in mdBook).
fn expand(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))?;
    let mut out = String::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("{{#include ") {
        out.push_str(&rest[..i]);
        let after = &rest[i + "{{#include ".len()..];
        let end = after.find("}}").ok_or("an {{#include without its }}")?;
        let target = after[..end].trim();
        let dir = path.parent().unwrap_or(Path::new("."));
        out.push_str(&expand(&dir.join(target)).map_err(|e| format!("{{{{#include {target}}}}}: {e}"))?);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Markdown outside fenced code blocks, with inline code spans blanked:
/// what is left is where links and headings can be.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push('\n');
            continue;
        }
        if !fenced {
            out.push_str(&blank_code_spans(line));
        }
        out.push('\n');
    }
    out
}

/// A line with the contents of each code span (a run of N backticks to the
/// next run of exactly N) replaced by spaces.
fn blank_code_spans(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let run = |at: usize| chars[at..].iter().take_while(|c| **c == '`').count();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let n = run(i);
        let mut j = i + n;
        let close = loop {
            if j >= chars.len() {
                break None;
            }
            if chars[j] == '`' {
                let m = run(j);
                if m == n {
                    break Some(j);
                }
                j += m;
            } else {
                j += 1;
            }
        };
        match close {
            Some(j) => {
                out.extend(std::iter::repeat_n(' ', j + n - i));
                i = j + n;
            }
            None => {
                out.extend(&chars[i..i + n]);
                i += n;
            }
        }
    }
    out
}

/// The target of every inline link `[text](target)` in the prose.
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        out.push(after[..end].trim().to_string());
        rest = &after[end..];
    }
    out
}

/// mdBook's id for a heading's text (mdbook-html `normalize_id`):
/// alphanumerics, `_` and `-` kept and lowercased, whitespace to `-`,
/// everything else dropped. Inline markup is not part of the text.
fn slug(heading: &str) -> String {
    heading
        .chars()
        .filter(|c| !matches!(c, '`' | '*'))
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().collect::<String>())
            } else if c.is_whitespace() {
                Some("-".to_string())
            } else {
                None
            }
        })
        .collect()
}

/// The ids of a page's headings; a repeated one gets `-1`, `-2`, ... as in
/// mdBook. Headings are ATX (`#` to `######`); code spans keep their text.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let hashes = line.chars().take_while(|c| *c == '#').count();
        let Some(title) = line.get(hashes..).and_then(|t| t.strip_prefix(' ')) else { continue };
        if fenced || !(1..=6).contains(&hashes) {
            continue;
        }
        let base = slug(title.trim());
        let mut id = base.clone();
        let mut n = 0;
        while out.contains(&id) {
            n += 1;
            id = format!("{base}-{n}");
        }
        out.insert(id);
    }
    out
}

/// `a/./b/../c` as `a/c`, without touching the file system.
fn normal(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Every broken link of the book under `root/docs` and of `root/README.md`,
/// one line each; empty when all hold.
fn problems(root: &Path) -> Vec<String> {
    let src = root.join("docs/src");
    let mut pages: Vec<PathBuf> =
        std::fs::read_dir(&src).map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    pages.retain(|p| p.extension().is_some_and(|e| e == "md"));
    pages.sort();
    let mut bad = Vec::new();
    if pages.is_empty() {
        bad.push(format!("{}: no pages", src.display()));
    }
    let summary = src.join("SUMMARY.md");
    let listed: BTreeSet<PathBuf> = std::fs::read_to_string(&summary)
        .map(|s| links(&s).iter().map(|l| normal(&src.join(l))).collect())
        .unwrap_or_default();
    for page in pages.iter().filter(|p| **p != summary) {
        if !listed.contains(&normal(page)) {
            bad.push(format!("{}: not in SUMMARY.md, so not in the book", page.display()));
        }
    }
    pages.push(root.join("README.md"));
    for page in &pages {
        let in_book = page.starts_with(&src);
        let text = match expand(page) {
            Ok(t) => t,
            Err(e) => {
                bad.push(format!("{}: {e}", page.display()));
                continue;
            }
        };
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = link.split_once('#').map_or((link.as_str(), None), |(f, a)| (f, Some(a)));
            let target = if file.is_empty() { page.clone() } else { normal(&page.parent().unwrap_or(root).join(file)) };
            let say = |why: &str| format!("{}: link ({link}): {why}", page.display());
            if !target.is_file() {
                bad.push(say("no such file"));
                continue;
            }
            if in_book && !target.starts_with(&src) {
                bad.push(say("leaves docs/src, which is all the built book has"));
                continue;
            }
            let Some(fragment) = fragment else { continue };
            if target.extension().is_none_or(|e| e != "md") {
                continue;
            }
            match expand(&target) {
                Ok(t) if anchors(&t).contains(fragment) => {}
                Ok(_) => bad.push(say("no heading of that page has this id")),
                Err(e) => bad.push(say(&e)),
            }
        }
    }
    bad
}

#[test]
fn every_link_of_the_book_and_the_readme_reaches_a_page_and_a_heading_that_exist() {
    let bad = problems(&crate::util::repo());
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

/// The check fails where it should: a missing page, a missing heading, a
/// page out of SUMMARY.md, a link out of the book; and passes the rest.
#[test]
fn the_link_check_finds_each_kind_of_broken_link() {
    let root = tempfile::tempdir().expect("tmp");
    let src = root.path().join("docs/src");
    std::fs::create_dir_all(&src).expect("mkdir");
    let write = |p: &str, t: &str| std::fs::write(root.path().join(p), t).expect("write");
    write("docs/src/SUMMARY.md", "# Summary\n\n- [A](a.md)\n- [B](b.md)\n");
    write(
        "docs/src/a.md",
        "# A\n\n## Exit codes by mode\n\n[ok](b.md#trainers-own-mpi-runtimes) [ok](#exit-codes-by-mode) \
         `[not a link](nowhere.md)`\n\n[gone](c.md) [no heading](b.md#nope) [out](../../README.md)\n\n\
         ```sh\n[in a fence](nowhere.md)\n```\n",
    );
    write("docs/src/b.md", "# B\n\n## Trainer's own MPI runtimes\n\n{{#include ../../inc.md}}\n");
    write("inc.md", "## Included\n\n[fine](a.md)\n");
    write("docs/src/orphan.md", "# Orphan\n");
    write("README.md", "# R\n\n[book](docs/src/b.md#included) [bad](docs/src/a.md#exit-codes-by-modes)\n");
    let bad = problems(root.path());
    let has = |what: &str| bad.iter().any(|b| b.contains(what));
    assert!(has("(c.md): no such file"), "{bad:#?}");
    assert!(has("(b.md#nope): no heading"), "{bad:#?}");
    assert!(has("(../../README.md): leaves docs/src"), "{bad:#?}");
    assert!(has("orphan.md: not in SUMMARY.md"), "{bad:#?}");
    assert!(has("(docs/src/a.md#exit-codes-by-modes): no heading"), "{bad:#?}");
    assert_eq!(bad.len(), 5, "nothing else is reported: {bad:#?}");
}

/// Ids as mdBook 0.5 writes them (read off its HTML for this book).
#[test]
fn headings_are_slugged_as_mdbook_does() {
    for (heading, id) in [
        ("Trainer's own MPI runtimes", "trainers-own-mpi-runtimes"),
        ("Preloaded Python workers (`--preload`)", "preloaded-python-workers---preload"),
        ("Figures (2-vCPU VM, torch 2.15.0, 2026-11-22)", "figures-2-vcpu-vm-torch-2150-2026-11-22"),
        ("A gloo worker that aborts as it exits (torch 2.15)", "a-gloo-worker-that-aborts-as-it-exits-torch-215"),
        ("Frameworks: JAX, XGBoost, DeepSpeed", "frameworks-jax-xgboost-deepspeed"),
    ] {
        assert_eq!(slug(heading), id);
    }
    assert_eq!(
        anchors("# T\n## This book\n## This book\n"),
        ["t", "this-book", "this-book-1"].map(String::from).into()
    );
}
