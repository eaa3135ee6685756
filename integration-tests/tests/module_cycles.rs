//! No module imports a module that imports it back, in any crate of the workspace: each
//! crate's modules, linked by the paths their files name (`crate::a::b`, `crate::Item`
//! through the crate root's re-exports, `crate::{a::X, b::Y}`, `super::…`), form no
//! cycle, except the one listed in [`KNOWN`]. What two modules both need belongs below
//! them. Test modules (from a file's `#[cfg(test)]` on) are left out: a test may use
//! anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path within its crate (`["gpu", "ops"]`; empty for the crate root).
type ModulePath = Vec<String>;

/// The circles not broken yet, by crate and their modules, and why they are still here.
/// tape's core types name each other: a tensor records onto its tape, the tape holds
/// parameters and tensors' gradient links, a parameter's gradient may be a view of flat
/// storage, and 16-bit formats are a tensor's storage.
const KNOWN: &[(&str, &[&str])] = &[(
    "tape",
    &["flat", "parameter", "precision", "tape", "tensor"],
)];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a readable source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file defines: `src/gpu/ops.rs` and `src/gpu/ops/mod.rs` are `gpu::ops`.
fn module_of(src: &Path, file: &Path) -> ModulePath {
    let relative = file.strip_prefix(src).expect("a file under src");
    let mut parts: ModulePath = relative
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The text without `//` comments (doc comments name paths they do not import) and
/// without its tests (from the first `#[cfg(test)]` on).
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines()
        .map(|line| line.find("//").map_or(line, |at| &line[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The paths named after each `prefix::` in `code`: `a::b::c` as one path, a group
/// `{a::X, b::{Y, Z}}` as a path per top-level member.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let needle = format!("{prefix}::");
    let split = |path: &str| -> Vec<String> {
        // The path up to what follows it (`as _`, `,`, `;`, `(`...).
        let path: String = (path.trim_start().chars())
            .take_while(|&c| is_ident(c) || c == ':')
            .collect();
        path.split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    let mut found = Vec::new();
    for (at, _) in code.match_indices(&needle) {
        // Part of a longer name, or an inner segment (`super::super::`) of a path read.
        if code[..at]
            .chars()
            .last()
            .is_some_and(|c| is_ident(c) || c == ':')
        {
            continue;
        }
        let rest = &code[at + needle.len()..];
        let Some(group) = rest.strip_prefix('{') else {
            found.push(split(rest));
            continue;
        };
        let (mut depth, mut member) = (0usize, String::new());
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    found.push(split(&member));
                    member.clear();
                    continue;
                }
                _ => {}
            }
            member.push(c);
        }
        found.push(split(&member));
    }
    found.retain(|path| !path.is_empty());
    found
}

/// What the crate root re-exports, by item name: `pub use module::{A, B};` names `A` and
/// `B` as `module`'s.
fn reexports(root: &str, modules: &BTreeSet<ModulePath>) -> BTreeMap<String, ModulePath> {
    let mut items = BTreeMap::new();
    for statement in root.split(';') {
        let Some(at) = statement.find("use ") else {
            continue;
        };
        if !statement[..at].trim_start().starts_with("pub") {
            continue;
        }
        let path = statement[at + 4..].trim();
        let Some((module, names)) = path.split_once("::") else {
            continue;
        };
        let module = vec![module.to_string()];
        if !modules.contains(&module) {
            continue;
        }
        for name in names
            .split(|c: char| !is_ident(c))
            .filter(|n| !n.is_empty())
        {
            items.insert(name.to_string(), module.clone());
        }
    }
    items
}

/// The longest prefix of `path` that is one of `modules`.
fn longest_module(path: &[String], modules: &BTreeSet<ModulePath>) -> Option<ModulePath> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|prefix| modules.contains(prefix))
}

/// Each module's uses of the crate's other modules (the root left out: it only
/// declares and re-exports).
fn uses(src: &Path) -> BTreeMap<ModulePath, BTreeSet<ModulePath>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let modules: BTreeMap<ModulePath, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let names: BTreeSet<ModulePath> = modules.keys().cloned().collect();
    let read = |file: &Path| code(&std::fs::read_to_string(file).expect("a readable file"));
    let root = modules
        .get(&Vec::new())
        .map(|f| read(f))
        .unwrap_or_default();
    let exported = reexports(&root, &names);
    let mut graph = BTreeMap::new();
    for (module, file) in &modules {
        let text = read(file);
        let mut used = BTreeSet::new();
        for path in paths_after(&text, "crate") {
            let found = longest_module(&path, &names).or_else(|| exported.get(&path[0]).cloned());
            used.extend(found);
        }
        for mut path in paths_after(&text, "super") {
            // `super` of `a/b.rs` (and of `a/b/mod.rs`) is `a`; each further `super` one up.
            let mut base: ModulePath = module[..module.len().saturating_sub(1)].to_vec();
            while path.first().is_some_and(|p| p == "super") {
                path.remove(0);
                base.pop();
            }
            let full: Vec<String> = base.iter().cloned().chain(path).collect();
            used.extend(longest_module(&full, &names).or(Some(base)));
        }
        used.retain(|m| m != module && !m.is_empty());
        graph.insert(module.clone(), used);
    }
    graph
}

/// The modules of each cycle (strongly connected set of more than one module).
fn cycles(graph: &BTreeMap<ModulePath, BTreeSet<ModulePath>>) -> Vec<BTreeSet<ModulePath>> {
    let reach = |from: &ModulePath| -> BTreeSet<ModulePath> {
        let (mut seen, mut stack) = (BTreeSet::new(), vec![from.clone()]);
        while let Some(node) = stack.pop() {
            for next in graph.get(&node).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&ModulePath, BTreeSet<ModulePath>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut found: Vec<BTreeSet<ModulePath>> = Vec::new();
    for (module, reached) in &reachable {
        let together: BTreeSet<ModulePath> = reached
            .iter()
            .filter(|other| reachable.get(other).is_some_and(|r| r.contains(*module)))
            .cloned()
            .collect();
        if together.len() > 1 && !found.contains(&together) {
            found.push(together);
        }
    }
    found
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut problems = Vec::new();
    let mut crates = 0;
    for entry in std::fs::read_dir(&workspace).expect("the workspace directory") {
        let dir = entry.expect("a directory entry").path();
        let src = dir.join("src");
        if !src.is_dir() || !dir.join("Cargo.toml").is_file() {
            continue;
        }
        crates += 1;
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        for cycle in cycles(&uses(&src)) {
            let modules: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
            let known = KNOWN
                .iter()
                .any(|(krate, listed)| *krate == name && listed.iter().eq(modules.iter()));
            if !known {
                problems.push(format!("{name}: {}", modules.join(", ")));
            }
        }
    }
    assert!(
        crates >= 10,
        "found only {crates} crates under {}",
        workspace.display()
    );
    assert!(
        problems.is_empty(),
        "module cycles:\n{}",
        problems.join("\n")
    );
}

/// The check finds what it should: cycles, grouped imports, root re-exports, `super`.
#[test]
fn the_check_reads_paths_and_finds_cycles() {
    let module = |name: &str| vec![name.to_string()];
    let graph: BTreeMap<ModulePath, BTreeSet<ModulePath>> = [
        (module("a"), [module("b")].into()),
        (module("b"), [module("c")].into()),
        (module("c"), [module("a")].into()),
        (module("d"), [module("a")].into()),
    ]
    .into();
    let abc: BTreeSet<ModulePath> = [module("a"), module("b"), module("c")].into();
    assert_eq!(cycles(&graph), vec![abc]);

    let text = "use crate::gpu::ops::PointwiseInput; // crate::precision\n\
                use crate::{Device, flat::{Regions, View}, local as _};\n\
                let x = super::super::Backend;\n\
                #[cfg(test)]\nmod tests { use crate::tape::Tape; }";
    let code = code(text);
    assert_eq!(
        paths_after(&code, "crate"),
        vec![
            vec!["gpu", "ops", "PointwiseInput"],
            vec!["Device"],
            // A nested group names its module; which items does not matter here.
            vec!["flat"],
            vec!["local"]
        ]
    );
    assert_eq!(paths_after(&code, "super"), vec![vec!["super", "Backend"]]);
    let modules: BTreeSet<ModulePath> = [module("place"), module("error")].into();
    let exported = reexports("pub use place::{Device, NotADevice};\nmod error;", &modules);
    assert_eq!(exported.get("Device"), Some(&module("place")));
}
