//! The source layout keeps the promise of `src/lib.rs`'s `# Layout` table:
//! every module of the crate is in one layer, imports only from its layer
//! or below, and the modules never import each other in a circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// (layer, module) from a layer table whose rows start with `prefix`
/// (`//! | ` in lib.rs's docs, `| ` in the book's source layout chapter).
fn layers(text: &str, prefix: &str) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter_map(|l| l.strip_prefix(prefix)) {
        let mut cells = line.split(" | ");
        let (Some(layer), Some(mods)) = (cells.next(), cells.next()) else { continue };
        let Ok(layer) = layer.trim().parse::<u32>() else { continue };
        for m in mods.split(',') {
            out.insert(m.trim().trim_matches('`').to_string(), layer);
        }
    }
    out
}

/// The code of a file without comments and without its unit tests.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The crate's top-level modules each top-level module names (`crate::x`,
/// `use crate::{x, y::z}`); the `limited!` macro is `ratelimit`'s.
fn imports(code: &str, own: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let names: Vec<&str> = if let Some(group) = rest.strip_prefix('{') {
            // Top-level names only: each item's first path segment, up to
            // the brace that closes the group (nested groups skipped).
            let mut depth = 0;
            let mut end = group.len();
            let mut starts = vec![0];
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        end = j;
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => starts.push(j + 1),
                    _ => {}
                }
            }
            starts.iter().map(|&s| group[s..end].trim_start()).collect()
        } else {
            vec![rest]
        };
        for n in names {
            let id: String = n.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            let id = if id == "limited" { "ratelimit".to_string() } else { id };
            if !id.is_empty() && id != own && id != "self" {
                out.insert(id);
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src").flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Module -> the modules it imports, for every file under src/ but the
/// crate root and main.rs.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).expect("under src");
        let top = rel.components().next().expect("component").as_os_str().to_string_lossy();
        let top = top.trim_end_matches(".rs").to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read");
        let found = imports(&code(&text), &top);
        g.entry(top).or_default().extend(found);
    }
    g
}

#[test]
fn every_module_imports_only_its_layer_or_below_and_there_is_no_cycle() {
    let src = crate::util::repo().join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let layer = layers(&lib, "//! | ");
    assert!(layer.len() >= 15, "the layer table in lib.rs: {layer:?}");
    let book = crate::docs::chapter("source-layout");
    assert_eq!(layers(&book, "| "), layer, "the book's layer table and lib.rs's");
    let g = graph(&src);
    let mut wrong = Vec::new();
    for (m, deps) in &g {
        let Some(&mine) = layer.get(m) else {
            wrong.push(format!("{m} is in no layer of lib.rs's table"));
            continue;
        };
        for d in deps {
            match layer.get(d) {
                Some(&theirs) if theirs <= mine => {}
                Some(&theirs) => wrong.push(format!("{m} (layer {mine}) imports {d} (layer {theirs})")),
                None => wrong.push(format!("{m} imports {d}, which is in no layer")),
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // No cycle: repeatedly remove the modules that import nothing left.
    let mut left: BTreeMap<&String, BTreeSet<&String>> =
        g.iter().map(|(m, d)| (m, d.iter().filter(|x| g.contains_key(*x)).collect())).collect();
    while let Some(leaf) = left.iter().find(|(_, d)| d.is_empty()).map(|(m, _)| *m) {
        left.remove(leaf);
        for d in left.values_mut() {
            d.remove(leaf);
        }
    }
    assert!(left.is_empty(), "modules that import each other in a circle: {:?}", left.keys().collect::<Vec<_>>());
}

/// The checker itself: it sees grouped, nested and plain paths, and no
/// comment or unit test.
#[test]
fn the_import_reader_sees_every_form_of_path() {
    let text = "use crate::{a, b::{c, d}, e::f};\n// crate::commented\nfn x() { crate::g::h(); limited!(); crate::limited!(); }\n#[cfg(test)]\nmod tests { use crate::t; }";
    let got = imports(&code(text), "own");
    let want: BTreeSet<String> = ["a", "b", "e", "g", "ratelimit"].iter().map(|s| s.to_string()).collect();
    assert_eq!(got, want);
}

/// `main.rs` stays the thin entry point the layout promises.
#[test]
fn main_rs_is_thin() {
    let main = std::fs::read_to_string(crate::util::repo().join("src/main.rs")).expect("main.rs");
    assert!(main.lines().count() < 120, "main.rs has {} lines", main.lines().count());
}

/// Every Rust file of the crate, of the initializers and of the round's
/// protocol with its simulation (more than 60: a reader that finds fewer
/// is broken, not the layout).
fn sources() -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    rust_files(&crate::util::repo().join("src"), &mut files);
    rust_files(&crate::util::repo().join("initializers/src"), &mut files);
    rust_files(&crate::util::repo().join("round/src"), &mut files);
    assert!(files.len() > 60, "{}", files.len());
    files
}

/// A round's end is written and read only through
/// `supervise::round_end::RoundEnd`: no other source spells its text
/// (`stop:SEQ`, `dead:UID`, `abort:UID:SIGNAL`, `waiting:UID`, `:hang`) in
/// a string literal, so nothing matches it as text.
#[test]
fn a_rounds_end_is_spelled_only_by_its_type() {
    let words = ["\"stop:", "\"dead:", "\"abort:", "\"waiting:", "\":hang\""];
    let spelled: Vec<String> = sources()
        .iter()
        .filter(|f| !f.ends_with("supervise/round_end.rs"))
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("read");
            words.iter().filter(|w| text.contains(**w)).map(|w| format!("{}: {w}", f.display())).collect::<Vec<_>>()
        })
        .collect();
    assert!(spelled.is_empty(), "{spelled:?}");
}

/// Where a string literal spells a key of the agents' store: after a
/// placeholder (`{base}/`, `{}/`), a key's first segment (`hb/`,
/// `serve/`, ...), a job-wide key's whole name (`restarts"`), or a round's
/// prefix (`/r{round}/`); and the job prefix itself (`"trainlet/{`).
fn key_spellings(literal: &str) -> Vec<String> {
    const NODES: [&str; 24] = [
        "hb/",
        "claim/",
        "leaving/",
        "pod/",
        "status/",
        "serve/",
        "actor/",
        "stacks/",
        "cache/",
        "m/",
        "failures/",
        "dumped/",
        "pmi/",
        "lanes/",
        "lane/",
        "go/",
        "ended/",
        "blob/",
        "log/",
        "ask/",
        "answers/",
        "op/",
        "res/",
        "first/",
    ];
    const LEAVES: [&str; 25] = [
        "round\"",
        "restarts\"",
        "takeovers\"",
        "host_left\"",
        "lighthouse\"",
        "attempt\"",
        "pmi\"",
        "serve\"",
        "stacks\"",
        "lanes\"",
        "session\"",
        "setup\"",
        "ops\"",
        "ask\"",
        "end\"",
        "next\"",
        "verdict\"",
        "members\"",
        "closed\"",
        "quorum\"",
        "join\"",
        "dead\"",
        "all_left\"",
        "all_stopped\"",
        "spare_left\"",
    ];
    let mut found = Vec::new();
    if literal.starts_with("\"trainlet/{") {
        found.push("\"trainlet/{".to_string());
    }
    for (at, _) in literal.match_indices("}/") {
        let after = &literal[at + 2..];
        if let Some(w) = NODES.iter().chain(&LEAVES).find(|w| after.starts_with(**w)) {
            found.push(format!("}}/{w}"));
        }
        if after.starts_with("r{") {
            found.push("}/r{".to_string());
        }
    }
    found
}

#[test]
fn the_key_reader_sees_each_form_of_a_key() {
    for (literal, found) in [
        ("\"{base}/hb/{uid}\"", true),
        ("\"{}/r{round}/end\"", true),
        ("\"{base}/restarts\"", true),
        ("\"trainlet/{run}/attempt\"", true),
        ("\"{job}/serve/run\"", true),
        ("\"{proc}/status\"", false),
        ("\"{site}/bin\"", false),
        ("\"round\"", false),
        ("\"{x}/torch\"", false),
    ] {
        assert_eq!(!key_spellings(literal).is_empty(), found, "{literal}");
    }
}

/// Every key of the agents' store comes from the schema, `src/keys/`: no
/// other source spells one in a string literal. The schema itself spells
/// every kind the reader knows (so the reader is not blind).
#[test]
fn no_store_key_is_spelled_outside_the_schema() {
    let mut in_schema = BTreeSet::new();
    let mut spelled = Vec::new();
    for f in sources() {
        let text = std::fs::read_to_string(&f).expect("read");
        let schema = f.components().any(|c| c.as_os_str() == "keys");
        for literal in scan(&text).1 {
            for form in key_spellings(&literal) {
                if schema {
                    in_schema.insert(form);
                } else {
                    spelled.push(format!("{}: {literal} ({form})", f.display()));
                }
            }
        }
    }
    assert!(spelled.is_empty(), "store keys spelled outside src/keys/: {spelled:#?}");
    assert!(in_schema.len() >= 15, "the schema's own spellings, as the reader sees them: {in_schema:?}");
}

/// The rendezvous session stays small: at most 8 fields, and where the
/// agent stands between rounds is one state (`Standing`), not flags.
#[test]
fn the_rendezvous_session_has_few_fields_and_no_flags() {
    let text = std::fs::read_to_string(crate::util::repo().join("src/rendezvous/session.rs")).expect("read");
    let code = code_only(&text);
    let body = code.split("pub struct Session {").nth(1).and_then(|b| b.split('}').next()).expect("struct Session");
    let fields: Vec<&str> = body.lines().map(str::trim).filter(|l| l.contains(':') && l.ends_with(',')).collect();
    assert!((4..=8).contains(&fields.len()), "Session's fields: {fields:#?}");
    let flags: Vec<&&str> = fields.iter().filter(|f| f.ends_with(": bool,")).collect();
    assert!(flags.is_empty(), "state flags in Session: {flags:?}");
}

/// No source file holds more than 600 lines of code before its unit tests
/// (tables of tests may make a file longer): past that, a file does several
/// jobs and is split by job.
#[test]
fn no_file_is_over_600_lines_of_code() {
    let files = sources();
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let text = std::fs::read_to_string(f).expect("read");
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(&text).lines().count();
            (code > 600).then(|| format!("{}: {code}", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "{long:?}");
}

/// Longest a function may be, from its `fn` line to its closing brace.
const MAX_FN_LINES: usize = 150;

/// `text` with every comment, string and character literal blanked out
/// (newlines kept), so that braces are counted in code only.
fn code_only(text: &str) -> String {
    scan(text).0
}

/// [`code_only`]'s text, and every string literal of `text` (raw strings
/// too), quotes included, in order.
fn scan(text: &str) -> (String, Vec<String>) {
    let mut strings = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let keep_lines = |out: &mut String, s: &[char]| out.extend(s.iter().map(|&c| if c == '\n' { '\n' } else { ' ' }));
    while i < chars.len() {
        let rest = &chars[i..];
        let (skip, blank) = if rest.starts_with(&['/', '/']) {
            (rest.iter().position(|&c| c == '\n').unwrap_or(rest.len()), true)
        } else if rest.starts_with(&['/', '*']) {
            let end = rest.windows(2).position(|w| w == ['*', '/']).map_or(rest.len(), |p| p + 2);
            (end, true)
        } else if rest[0] == 'r'
            && rest.get(1).is_some_and(|&c| c == '"' || c == '#')
            && (i == 0 || !chars[i - 1].is_alphanumeric())
        {
            // A raw string: r"...", r#"..."#, ...
            let hashes = rest[1..].iter().take_while(|&&c| c == '#').count();
            let close: Vec<char> = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            let body = 2 + hashes;
            let end = rest[body.min(rest.len())..].windows(close.len()).position(|w| w == close.as_slice());
            let end = end.map_or(rest.len(), |p| body + p + close.len());
            strings.push(rest[..end].iter().collect());
            (end, true)
        } else if rest[0] == '"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(rest.len());
            strings.push(rest[..end].iter().collect());
            (end, true)
        } else if rest[0] == '\'' {
            // A character literal ('{', '\n', '\u{7b}'), not a lifetime.
            let end = if rest.get(1) == Some(&'\\') {
                rest.iter().skip(2).position(|&c| c == '\'').map(|p| p + 3)
            } else {
                (rest.get(2) == Some(&'\'')).then_some(3)
            };
            end.map_or((1, false), |e| (e, true))
        } else {
            (1, false)
        };
        let skip = skip.max(1);
        if blank {
            keep_lines(&mut out, &rest[..skip.min(rest.len())]);
        } else {
            out.extend(&rest[..skip]);
        }
        i += skip;
    }
    (out, strings)
}

/// Every function of `text` longer than `limit` lines: (first line, name, lines).
fn long_functions(text: &str, limit: usize) -> Vec<(usize, String, usize)> {
    let code = code_only(text);
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let Some(at) = line.find("fn ") else { continue };
        if at > 0 && !line[..at].ends_with(' ') && !line[..at].ends_with('(') {
            continue;
        }
        let words: Vec<&str> = line[..at].split_whitespace().collect();
        let qualifiers = ["pub", "pub(crate)", "pub(super)", "const", "async", "unsafe", "extern", "default"];
        if !words.iter().all(|w| qualifiers.contains(w) || w.starts_with("pub(")) {
            continue;
        }
        let name: String = line[at + 3..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() {
            continue;
        }
        // The body: from the first `{` to its match (a declaration ends at `;` first).
        let mut depth = 0usize;
        let mut end = None;
        'scan: for (m, l) in lines.iter().enumerate().skip(n) {
            for c in l.chars() {
                match c {
                    ';' if depth == 0 => break 'scan,
                    '{' => depth += 1,
                    '}' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            end = Some(m);
                            break 'scan;
                        }
                    }
                    _ => {}
                }
            }
        }
        if let Some(end) = end
            && end - n + 1 > limit
        {
            out.push((n + 1, name, end - n + 1));
        }
    }
    out
}

#[test]
fn the_function_reader_measures_bodies_and_ignores_braces_in_literals() {
    let body = "    let x = 1;\n".repeat(5);
    let text = format!(
        "/// fn not_me() {{\npub(super) async fn long(a: u8) -> u8 {{\n    let s = \"}}}}\";\n    let c = '}}';\n    let r = r#\"{{\"#;\n{body}    a\n}}\nfn short() {{}}\nfn decl();\n"
    );
    // long: 1 + 3 literal lines + 5 + 1 + 1 = 11 lines.
    assert_eq!(long_functions(&text, 10), [(2, "long".to_string(), 11)]);
    assert!(long_functions(&text, 11).is_empty());
    assert!(code_only("let a: &'static str = \"{\";").matches('{').count() == 0);
}

/// No function in `src/` or `initializers/src` is over 150 lines: a
/// longer one does several jobs in one body (the round loop grew to 458
/// lines that way), and is split by job, never by moving lines around.
#[test]
fn no_function_is_over_150_lines() {
    let files = sources();
    let long: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).expect("read");
            long_functions(&text, MAX_FN_LINES)
                .into_iter()
                .map(|(line, name, n)| format!("{}:{line} {name}: {n} lines", f.display()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(long.is_empty(), "functions over {MAX_FN_LINES} lines: {long:#?}");
}

/// The sibling modules that `code` (a file of folder module `folder`,
/// `""` for a crate's root) names: `super::x`, `super::{x, y::z}`,
/// `crate::folder::x`, `crate::folder::{x, ...}` (`crate::x` at the root).
fn sibling_refs(code: &str, folder: &str) -> BTreeSet<String> {
    let prefixes = if folder.is_empty() {
        vec!["crate::".to_string()]
    } else {
        vec!["super::".to_string(), format!("crate::{folder}::")]
    };
    let mut out = BTreeSet::new();
    for prefix in &prefixes {
        let mut rest = code;
        while let Some(i) = rest.find(prefix.as_str()) {
            // `super::super::` climbs out of the folder.
            let before = &rest[..i];
            rest = &rest[i + prefix.len()..];
            if rest.starts_with("super::") {
                rest = rest.trim_start_matches("super::");
                continue;
            }
            if before.ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let names: Vec<&str> = match rest.strip_prefix('{') {
                Some(group) => {
                    let end = group.find('}').unwrap_or(group.len());
                    group[..end].split(',').collect()
                }
                None => vec![rest],
            };
            for n in names {
                let id: String = n.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if !id.is_empty() {
                    out.insert(id);
                }
            }
        }
    }
    out
}

/// The circles of files that import each other inside one folder of
/// `root` (a crate's src): each as the folder and its files.
fn folder_circles(root: &Path) -> Vec<String> {
    let mut folders = vec![root.to_path_buf()];
    let mut out = Vec::new();
    while let Some(dir) = folders.pop() {
        let mut modules: BTreeMap<String, Option<std::path::PathBuf>> = BTreeMap::new();
        for e in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            let p = e.path();
            let name = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
            if p.is_dir() {
                folders.push(p.clone());
                modules.entry(name).or_insert(None);
            } else if p.extension().is_some_and(|x| x == "rs") && !["mod", "lib", "main"].contains(&name.as_str()) {
                modules.insert(name, Some(p));
            }
        }
        let folder = dir.strip_prefix(root).expect("inside").to_string_lossy().replace('/', "::");
        let edges: BTreeMap<&str, BTreeSet<String>> = modules
            .iter()
            .filter_map(|(m, file)| {
                let text = std::fs::read_to_string(file.as_ref()?).expect("read");
                let refs = sibling_refs(&code(&text), &folder);
                Some((m.as_str(), refs.into_iter().filter(|r| r != m && modules.contains_key(r)).collect()))
            })
            .collect();
        // Depth-first search for a back edge; report each circle once.
        let mut done: BTreeSet<&str> = BTreeSet::new();
        for start in edges.keys() {
            let mut path: Vec<&str> = Vec::new();
            visit(start, &edges, &mut path, &mut done, &mut |circle| {
                out.push(format!("{}: {}", dir.display(), circle.join(" -> ")));
            });
        }
    }
    out.sort();
    out.dedup();
    out
}

fn visit<'a>(
    m: &'a str,
    edges: &'a BTreeMap<&'a str, BTreeSet<String>>,
    path: &mut Vec<&'a str>,
    done: &mut BTreeSet<&'a str>,
    found: &mut impl FnMut(Vec<&str>),
) {
    if let Some(i) = path.iter().position(|p| *p == m) {
        let mut circle = path[i..].to_vec();
        circle.push(m);
        found(circle);
        return;
    }
    if done.contains(m) {
        return;
    }
    path.push(m);
    for next in edges.get(m).into_iter().flatten() {
        if let Some((key, _)) = edges.get_key_value(next.as_str()) {
            visit(key, edges, path, done, found);
        }
    }
    path.pop();
    done.insert(m);
}

#[test]
fn the_folder_reader_sees_sibling_imports_and_circles() {
    let code = "use super::{a, b::C};\nuse super::super::far;\nfn f() { crate::net::d::x(); crate::netx::e(); super::c::y(); }";
    let want: BTreeSet<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
    assert_eq!(sibling_refs(code, "net"), want);
    let root: BTreeSet<String> = ["x"].iter().map(|s| s.to_string()).collect();
    assert_eq!(sibling_refs("use crate::{x};\nuse super::y;", ""), root);
    let dir = tempfile::tempdir().expect("tmp");
    let net = dir.path().join("net");
    std::fs::create_dir(&net).expect("mkdir");
    std::fs::write(net.join("mod.rs"), "mod a;\nmod b;\nmod c;\n").expect("write");
    std::fs::write(net.join("a.rs"), "use super::b::B;\n").expect("write");
    std::fs::write(net.join("b.rs"), "use crate::net::c::C;\n").expect("write");
    std::fs::write(net.join("c.rs"), "// use super::a;\npub struct C;\n").expect("write");
    assert!(folder_circles(dir.path()).is_empty(), "a comment is not an import");
    std::fs::write(net.join("c.rs"), "use super::a::A;\n").expect("write");
    let circles = folder_circles(dir.path());
    assert_eq!(circles.len(), 1, "{circles:?}");
    assert!(circles[0].ends_with("a -> b -> c -> a"), "{circles:?}");
}

/// No files inside one folder import each other in a circle (a type both
/// need lives where both can import it without importing each other),
/// in the crate and in the initializers.
#[test]
fn no_files_of_a_folder_import_each_other_in_a_circle() {
    let mut circles = folder_circles(&crate::util::repo().join("src"));
    circles.extend(folder_circles(&crate::util::repo().join("initializers/src")));
    circles.extend(folder_circles(&crate::util::repo().join("round/src")));
    assert!(circles.is_empty(), "circles of imports inside a folder: {circles:#?}");
}
