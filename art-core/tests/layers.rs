//! The crate's modules depend one way: each top-level module may use only modules of lower
//! layers (the README's architecture picture), and within a directory no two files use each other.
//! A new module, or a use that points up, fails here with the file and the line to fix.
//! Cost: reads the sources, well under a second.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Bottom to top; a module may use the modules of the layers below its own, none beside or above.
const LAYERS: &[&[&str]] = &[
    // Plain data: OpenAI's and ART's wire types, names; durable file writes; dataset batching.
    &["types", "fsutil", "dataset"],
    // Inference (candle), tracing spans, DataFrames of trajectories and history.
    &["engine", "telemetry", "frames"],
    // An OpenAI-compatible client, a model's directory on disk, LoRA training on the engine.
    &["client", "store", "train"],
    // RULER's judge calls; the backends a notebook trains through (local or remote).
    &["ruler", "backend"],
    // Notebook and terminal rendering.
    &["display"],
    // Rollout orchestration with live progress; charts.
    &["gather", "plots"],
    // The HTTP server: OpenAI's chat API plus ART's training API.
    &["server"],
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without comments and without its unit tests (tests may use anything).
fn code_lines(path: &Path) -> Vec<(usize, String)> {
    let text = fs::read_to_string(path).unwrap();
    let code = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => &text[..],
    };
    code.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim_start().starts_with("//"))
        .map(|(i, line)| (i + 1, line.to_string()))
        .collect()
}

/// The identifiers that follow `prefix` (e.g. `crate::`) in `line`.
fn paths_after<'a>(line: &'a str, prefix: &str) -> Vec<&'a str> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find(prefix) {
        let preceded_by_word = rest[..at]
            .chars()
            .last()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        rest = &rest[at + prefix.len()..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if !preceded_by_word && end > 0 {
            found.push(&rest[..end]);
        }
    }
    found
}

/// `src/engine/model/backward.rs` -> ["engine", "model", "backward"]; `mod.rs` names its directory.
fn module_path(file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src()).unwrap().with_extension("");
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

#[test]
fn top_level_modules_use_only_lower_layers() {
    let layer_of: BTreeMap<&str, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(layer, modules)| modules.iter().map(move |m| (*m, layer)))
        .collect();
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut problems = Vec::new();
    for file in &files {
        let module = module_path(file);
        let top = module[0].as_str();
        if top == "lib" || top == "bin" {
            continue;
        }
        let Some(&own) = layer_of.get(top) else {
            problems.push(format!(
                "{}: module `{top}` is in no layer: add it to LAYERS here and to the README's \
                 architecture picture",
                file.display()
            ));
            continue;
        };
        for (line_no, line) in code_lines(file) {
            for used in paths_after(&line, "crate::") {
                match layer_of.get(used) {
                    Some(&layer) if used != top && layer >= own => problems.push(format!(
                        "{}:{line_no}: `{top}` (layer {own}) uses `{used}` (layer {layer})",
                        file.display()
                    )),
                    _ => {}
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_two_files_of_a_directory_use_each_other() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    // (directory, file) -> the siblings it uses.
    let mut uses: BTreeMap<(Vec<String>, String), BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let module = module_path(file);
        let Some((name, dir)) = module.split_last() else {
            continue;
        };
        let entry = uses.entry((dir.to_vec(), name.clone())).or_default();
        let in_dir = format!("crate::{}::", dir.join("::"));
        for (_, line) in code_lines(file) {
            let mut used = paths_after(&line, "super::");
            if !dir.is_empty() {
                used.extend(paths_after(&line, &in_dir));
            }
            entry.extend(used.into_iter().filter(|u| u != name).map(String::from));
        }
    }
    let mut cycles = Vec::new();
    for ((dir, name), used) in &uses {
        for other in used {
            let back = uses.get(&(dir.clone(), other.clone()));
            if name < other && back.is_some_and(|b| b.contains(name)) {
                cycles.push(format!("src/{}: {name} <-> {other}", dir.join("/")));
            }
        }
    }
    assert!(cycles.is_empty(), "{}", cycles.join("\n"));
}

/// Every `ART_*` variable the code reads is named in the README (the kernel's `ART_KERNEL_*` and
/// the tests' `ART_TEST_*` by their prefix), so that no switch is known only to its author.
#[test]
fn the_readme_names_every_environment_variable() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = fs::read_to_string(root.join("README.md")).unwrap();
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    rust_files(&root.join("art-kernel/src"), &mut files);
    let mut missing = BTreeSet::new();
    for file in &files {
        let text = fs::read_to_string(file).unwrap();
        for name in paths_after(&text, "\"ART_") {
            let var = format!("ART_{name}");
            let by_prefix = ["ART_KERNEL_", "ART_TEST_"]
                .iter()
                .any(|p| var.starts_with(p));
            if !by_prefix && !readme.contains(&format!("`{var}`")) {
                missing.insert(format!("{var} ({})", file.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in README.md: {}",
        missing.into_iter().collect::<Vec<_>>().join(", ")
    );
}
