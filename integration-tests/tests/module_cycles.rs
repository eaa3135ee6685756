//! No module imports a module that imports it back, in any crate of the workspace: each
//! crate's modules, linked by the `crate::…` and `super::…` paths their files name, form
//! no cycle. What two modules both need belongs below them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path within its crate (`["gpu", "ops"]`; empty for the crate root).
type ModulePath = Vec<String>;

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

/// The text without `//` comments (doc comments name paths they do not import).
fn code(text: &str) -> String {
    text.lines()
        .map(|line| line.find("//").map_or(line, |at| &line[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `a::b::c` segments after each occurrence of `prefix::` in `code`.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let needle = format!("{prefix}::");
    let mut found = Vec::new();
    for (at, _) in code.match_indices(&needle) {
        let before = code[..at].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + needle.len()..];
        let path: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        found.push(
            path.split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        );
    }
    found
}

/// The longest prefix of `path` that is one of `modules`.
fn longest_module(path: &[String], modules: &BTreeSet<ModulePath>) -> Option<ModulePath> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|prefix| modules.contains(prefix))
}

/// Each module's uses of the crate's other modules.
fn uses(src: &Path) -> BTreeMap<ModulePath, BTreeSet<ModulePath>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let modules: BTreeMap<ModulePath, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let names: BTreeSet<ModulePath> = modules.keys().cloned().collect();
    let mut graph = BTreeMap::new();
    for (module, file) in &modules {
        let text = code(&std::fs::read_to_string(file).expect("a readable source file"));
        // `super` of `a/b.rs` is `a`; of `a/b/mod.rs` it is `a` too.
        let parent: ModulePath = module[..module.len().saturating_sub(1)].to_vec();
        let mut used = BTreeSet::new();
        for path in paths_after(&text, "crate") {
            used.extend(longest_module(&path, &names));
        }
        for path in paths_after(&text, "super") {
            let full: Vec<String> = parent.iter().cloned().chain(path).collect();
            used.extend(longest_module(&full, &names));
        }
        used.retain(|m| m != module && !m.is_empty());
        graph.insert(module.clone(), used);
    }
    graph
}

/// A cycle through `start`, if one exists (a path back to it).
fn cycle_from(
    start: &ModulePath,
    graph: &BTreeMap<ModulePath, BTreeSet<ModulePath>>,
) -> Option<Vec<ModulePath>> {
    let mut stack = vec![(start.clone(), vec![start.clone()])];
    let mut seen = BTreeSet::new();
    while let Some((node, path)) = stack.pop() {
        for next in graph.get(&node).into_iter().flatten() {
            if next == start {
                return Some(path.clone());
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push((next.clone(), longer));
            }
        }
    }
    None
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cycles = Vec::new();
    let mut crates = 0;
    for entry in std::fs::read_dir(&workspace).expect("the workspace directory") {
        let src = entry.expect("a directory entry").path().join("src");
        if !src.is_dir() || !src.with_file_name("Cargo.toml").is_file() {
            continue;
        }
        crates += 1;
        let graph = uses(&src);
        for module in graph.keys() {
            if let Some(cycle) = cycle_from(module, &graph) {
                let names: Vec<String> = cycle.iter().map(|m| m.join("::")).collect();
                cycles.push(format!("{}: {}", src.display(), names.join(" → ")));
            }
        }
    }
    assert!(
        crates >= 9,
        "found only {crates} crates under {}",
        workspace.display()
    );
    assert!(cycles.is_empty(), "module cycles:\n{}", cycles.join("\n"));
}

/// The check finds a cycle where there is one.
#[test]
fn a_cycle_is_found() {
    let module = |name: &str| vec![name.to_string()];
    let graph: BTreeMap<ModulePath, BTreeSet<ModulePath>> = [
        (module("a"), [module("b")].into()),
        (module("b"), [module("c")].into()),
        (module("c"), [module("a")].into()),
        (module("d"), [module("a")].into()),
    ]
    .into();
    assert_eq!(
        cycle_from(&module("a"), &graph),
        Some(vec![module("a"), module("b"), module("c")])
    );
    assert_eq!(cycle_from(&module("d"), &graph), None);
    let text = "use crate::gpu::ops::PointwiseInput; // crate::precision\nlet x = super::Backend;";
    let code = code(text);
    assert_eq!(
        paths_after(&code, "crate"),
        vec![vec!["gpu", "ops", "PointwiseInput"]]
    );
    assert_eq!(paths_after(&code, "super"), vec![vec!["Backend"]]);
}
