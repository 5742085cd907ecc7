//! How long rust-analyzer takes to answer evcxr's questions about a cell crate.
//!
//! evcxr asks rust-analyzer for the type of every variable a cell defines. This writes a cell
//! crate with the given dependencies and `use`s and a cell `let a = 1;` wrapped the way evcxr 0.22
//! wraps it for analysis, loads it the way evcxr does (every source root local), and times:
//! 1. the wrapper function's scope: name resolution of every crate the cell can see;
//! 2. the types of its `let`s: trait impls and lang items of all those crates;
//! 3. both again after an edit, as for each later cell.
//!
//! `--library-roots` marks dependencies as library code (as rust-analyzer's own loader does), to
//! compare the cost of step 3. From the workspace root (its Cargo.lock pins the versions):
//!
//! ```text
//! cargo run --release --manifest-path art-kernel/analysis-cost/Cargo.toml -- \
//!     --use 'art_core::*' "art-core = { path = \"$PWD/art-core\" }" 'tokio = "1"'
//! ```

use anyhow::{Context, Result};
use ra_ap_base_db::{EditionedFileId, SourceRoot};
use ra_ap_hir::{self as hir, ChangeWithProcMacros, HirDisplay, Semantics};
use ra_ap_ide::{AnalysisHost, Edition, RootDatabase};
use ra_ap_ide_db::FxHashMap;
use ra_ap_paths::AbsPathBuf;
use ra_ap_project_model::{CargoConfig, ProjectManifest, ProjectWorkspace, RustLibSource};
use ra_ap_syntax::ast::{self, AstNode, HasModuleItem, HasName};
use ra_ap_vfs::loader::{Handle, LoadingProgress};
use ra_ap_vfs::{FileId, Vfs, VfsPath, file_set::FileSetConfig, loader};
use std::path::Path;
use std::time::Instant;

const WRAPPER: &str = "evcxr_analysis_wrapper";

/// What evcxr gives rust-analyzer for a cell `let a = 1;` (its `analysis_code`, abridged).
fn cell_source(uses: &[String], edit: usize) -> String {
    let uses: String = uses.iter().map(|u| format!("use {u};\n")).collect();
    format!(
        "#![allow(unused_imports, unused_mut, dead_code)]
{uses}struct EvcxrUserCodeError {{}}
impl<T: std::fmt::Display> From<T> for EvcxrUserCodeError {{
    fn from(error: T) -> Self {{ eprintln!(\"{{}}\", error); EvcxrUserCodeError {{}} }}
}}
fn evcxr_variable_store<T: 'static>(_: T) {{}}
async fn {WRAPPER}() -> Result<(), EvcxrUserCodeError> {{
    let a = 1;
    let edit = {edit};
    evcxr_variable_store(a);
    Ok(())
}}
"
    )
}

fn main() -> Result<()> {
    let mut library_roots = false;
    let (mut uses, mut dependencies) = (Vec::new(), Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--library-roots" => library_roots = true,
            "--use" => uses.push(args.next().context("--use needs a path")?),
            _ => dependencies.push(arg),
        }
    }
    let dir = std::env::temp_dir().join(format!("analysis-cost-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            "[package]\nname = \"ctx\"\nversion = \"1.0.0\"\nedition = \"2024\"\n\n[dependencies]\n{}\n",
            dependencies.join("\n")
        ),
    )?;
    if Path::new("Cargo.lock").is_file() {
        std::fs::copy("Cargo.lock", dir.join("Cargo.lock"))?;
    }
    std::fs::write(dir.join("src/lib.rs"), cell_source(&uses, 0))?;
    let result = measure(&dir, &uses, library_roots);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(dir: &Path, uses: &[String], library_roots: bool) -> Result<()> {
    let dir = AbsPathBuf::assert_utf8(std::fs::canonicalize(dir)?);
    let started = Instant::now();
    let manifest = ProjectManifest::from_manifest_file(dir.join("Cargo.toml"))?;
    let config = CargoConfig {
        sysroot: Some(RustLibSource::Discover),
        ..CargoConfig::default()
    };
    let workspace = ProjectWorkspace::load(manifest, &config, &|_| {})?;
    println!("cargo metadata and sysroot: {:.2?}", started.elapsed());

    let step = Instant::now();
    let (mut vfs, megabytes) = load_sources(&workspace);
    println!(
        "read sources: {:.2?} ({megabytes} MB, {} crates)",
        step.elapsed(),
        workspace.n_packages()
    );

    let mut host = AnalysisHost::default();
    host.apply_change(initial_change(&workspace, &mut vfs, library_roots));
    let lib_rs: VfsPath = dir.join("src/lib.rs").into();
    let (file, _) = vfs.file_id(&lib_rs).context("no src/lib.rs")?;

    let (scope, types) = analyse(host.raw_database(), file)?;
    println!(
        "first cell: scope (name resolution) {scope:.2?}, types (trait impls, lang items) {types:.2?}"
    );
    for edit in 1..=2 {
        let mut change = ChangeWithProcMacros::default();
        change.change_file(file, Some(cell_source(uses, edit)));
        host.apply_change(change);
        let (scope, types) = analyse(host.raw_database(), file)?;
        println!("after edit {edit}: scope {scope:.2?}, types {types:.2?}");
    }
    println!("total: {:.2?}", started.elapsed());
    Ok(())
}

/// Reads every `.rs` file of the workspace's roots, as evcxr's loader does.
fn load_sources(workspace: &ProjectWorkspace) -> (Vfs, usize) {
    let (sender, receiver) = crossbeam_channel::unbounded();
    let mut handle = ra_ap_vfs_notify::NotifyHandle::spawn(sender);
    let load = workspace
        .to_roots()
        .iter()
        .map(|root| {
            loader::Entry::Directories(loader::Directories {
                extensions: vec!["rs".to_owned()],
                include: root.include.clone(),
                exclude: root.exclude.clone(),
            })
        })
        .collect();
    handle.set_config(loader::Config {
        version: 1,
        load,
        watch: vec![],
    });
    let mut vfs = Vfs::default();
    let mut bytes = 0;
    for message in &receiver {
        match message {
            loader::Message::Progress {
                n_done: LoadingProgress::Finished,
                ..
            } => break,
            loader::Message::Progress { .. } => {}
            loader::Message::Loaded { files } | loader::Message::Changed { files } => {
                for (path, contents) in files {
                    bytes += contents.as_ref().map_or(0, Vec::len);
                    vfs.set_file_contents(path.to_path_buf().into(), contents);
                }
            }
        }
    }
    (vfs, bytes / 1_000_000)
}

/// Files, source roots and crate graph. evcxr makes every root local; rust-analyzer's own loader
/// makes dependencies libraries, whose files it expects never to change.
fn initial_change(
    workspace: &ProjectWorkspace,
    vfs: &mut Vfs,
    library_roots: bool,
) -> ChangeWithProcMacros {
    let mut change = ChangeWithProcMacros::default();
    for (file, changed) in vfs.take_changes() {
        let text = match changed.change {
            ra_ap_vfs::Change::Create(bytes, _) | ra_ap_vfs::Change::Modify(bytes, _) => {
                String::from_utf8(bytes).ok()
            }
            ra_ap_vfs::Change::Delete => None,
        };
        change.change_file(file, text);
    }
    let roots = workspace.to_roots();
    let mut file_sets = FileSetConfig::builder();
    for root in &roots {
        file_sets.add_file_set(root.include.iter().cloned().map(Into::into).collect());
    }
    let partition = file_sets.build().partition(vfs);
    change.set_roots(
        partition
            .into_iter()
            .enumerate()
            .map(|(i, files)| {
                // The partition ends with the files outside every root.
                let dependency = roots.get(i).is_some_and(|root| !root.is_local);
                if library_roots && dependency {
                    SourceRoot::new_library(files)
                } else {
                    SourceRoot::new_local(files)
                }
            })
            .collect(),
    );
    let (graph, _) = workspace.to_crate_graph(
        &mut |path| vfs.file_id(&path.to_path_buf().into()).map(|(id, _)| id),
        &FxHashMap::default(),
    );
    change.set_crate_graph(graph);
    change
}

/// Times what evcxr asks for: the wrapper function's scope, then the types of its `let`s.
fn analyse(db: &RootDatabase, file: FileId) -> Result<(std::time::Duration, std::time::Duration)> {
    hir::attach_db(db, || {
        let sema = Semantics::new(db);
        let source = sema.parse(EditionedFileId::new(db, file, Edition::Edition2024));
        let wrapper = source
            .items()
            .find_map(|item| match item {
                ast::Item::Fn(f) if f.name().is_some_and(|n| n.text() == WRAPPER) => Some(f),
                _ => None,
            })
            .with_context(|| format!("src/lib.rs has no fn {WRAPPER}"))?;
        let started = Instant::now();
        let module = sema.scope(wrapper.syntax()).context("no scope")?.module();
        let scope = started.elapsed();
        let started = Instant::now();
        let body = wrapper.body().context("the wrapper has no body")?;
        for statement in body.statements() {
            if let ast::Stmt::LetStmt(binding) = statement
                && let Some(pattern) = binding.pat()
                && let Some(ty) = sema.type_of_pat(&pattern)
            {
                let _ = ty.original().display_source_code(db, module.into(), true);
            }
        }
        Ok((scope, started.elapsed()))
    })
}
