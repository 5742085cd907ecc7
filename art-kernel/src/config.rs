//! What `art-kernel install` decides once and every kernel start reads: where cells get art-core
//! from, where compiled dependencies are kept, and the prelude every notebook starts with.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Where cells get art-core from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtCoreSource {
    /// A checkout (the repository the kernel was built from, by default).
    Path(PathBuf),
    /// A version from crates.io.
    Version(String),
}

/// The state a kernel's evaluator starts in.
#[derive(Debug, Clone)]
pub struct Prelude {
    /// Cargo dependencies of every cell, `(name, TOML value)`. They resolved when the cache was
    /// warmed at install, so the kernel adds them without evcxr's `cargo metadata` check.
    pub dependencies: Vec<(String, String)>,
    /// The first cell's code.
    pub code: String,
    /// Cells' builds never touch the network.
    pub offline: bool,
    /// Optimisation of cell code.
    pub opt_level: String,
    /// The linker (`None`: the one evcxr finds, when the cache is first warmed).
    pub linker: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KernelConfig {
    pub art_core: ArtCoreSource,
    /// Compiled dependencies and per-kernel build directories (`slots/N`).
    pub cache_dir: PathBuf,
    /// Optimisation of cell code (dependencies are always built at opt-level 1).
    pub cell_opt_level: String,
    /// Never touch the network from cells' builds (set once the cache is warm).
    pub offline: bool,
    /// The rustup toolchain cells are compiled with: the one that built the kernel, so that the
    /// warm cache and every kernel start agree (`None` outside rustup).
    #[serde(default)]
    pub toolchain: Option<String>,
    /// The linker cells are linked with, chosen when the cache was warmed (evcxr takes lld or
    /// mold where installed). Kept fixed because it is part of every dependency's compiler
    /// flags: installing lld later would otherwise recompile the whole cache at the next start.
    #[serde(default = "system_linker")]
    pub linker: String,
}

fn system_linker() -> String {
    "system".into()
}

/// The crate that links art-core, tokio and serde_json (with everything below them) into one
/// shared library, written by the kernel into its cache directory. Every cell links against it:
/// without it each cell's shared object statically linked what it reached of ~220 libraries (a
/// first `1 + 1` took 0.56-0.64 s, now 0.31-0.39 s), and each cell carried its own copy of
/// art-core's statics (one trace exporter per cell).
const CELL_DEPS_CRATE: &str = "art-cell-deps";
/// Its library's name, as cells write it.
const CELL_DEPS_LIB: &str = "art_cell_deps";

/// The features of tokio cells get (what top-level `.await` and art-core need).
const TOKIO_DEP: &str =
    r#"{ version = "1", features = ["rt-multi-thread", "macros", "time", "sync"] }"#;

impl KernelConfig {
    /// The settings `install` starts from.
    pub fn defaults() -> Self {
        KernelConfig {
            art_core: Self::default_art_core(),
            cache_dir: Self::default_cache_dir(),
            cell_opt_level: "0".into(),
            offline: false,
            toolchain: option_env!("RUSTUP_TOOLCHAIN").map(str::to_string),
            linker: system_linker(),
        }
    }

    pub fn default_cache_dir() -> PathBuf {
        std::env::var_os("ART_KERNEL_CACHE")
            .map(PathBuf::from)
            .or_else(|| dirs::cache_dir().map(|d| d.join("art-kernel")))
            .unwrap_or_else(|| std::env::temp_dir().join("art-kernel"))
    }

    /// art-core next to this kernel's sources, when the kernel was built from a checkout.
    pub fn default_art_core() -> ArtCoreSource {
        let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../art-core");
        match checkout.join("Cargo.toml").is_file() {
            true => ArtCoreSource::Path(checkout.canonicalize().unwrap_or(checkout)),
            false => ArtCoreSource::Version(env!("CARGO_PKG_VERSION").to_string()),
        }
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the kernel config {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a valid kernel config; run `art-kernel install` again",
                path.display()
            )
        })
    }

    fn art_core_dep(&self) -> String {
        match &self.art_core {
            ArtCoreSource::Path(path) => {
                format!("{{ path = {:?} }}", path.display().to_string())
            }
            ArtCoreSource::Version(version) => format!("{{ version = {version:?} }}"),
        }
    }

    /// The crates every cell sees, `(name, TOML value)`.
    fn toolkit_dependencies(&self) -> Vec<(String, String)> {
        vec![
            ("art-core".into(), self.art_core_dep()),
            ("tokio".into(), TOKIO_DEP.into()),
            ("serde_json".into(), r#"{ version = "1" }"#.into()),
        ]
    }

    /// The crate that bundles the toolkit into one shared library (see [`CELL_DEPS_CRATE`]).
    fn cell_deps_dir(&self) -> PathBuf {
        self.cache_dir.join(CELL_DEPS_CRATE)
    }

    /// What every kernel starts with: dependencies, imports, and cells compiled as async blocks
    /// that may use `?` (so that neither the prelude nor a first `.await?` cell compiles twice).
    ///
    /// Cells name the toolkit's crates directly (rust-analyzer's types say `art_core::..`), and
    /// `use art_cell_deps as _` makes rustc load that crate and so link them through its shared
    /// library instead of copying them into every cell. (Not `extern crate`: evcxr answers that
    /// with a `cargo metadata` round, which fails offline.)
    pub fn prelude(&self) -> Prelude {
        let mut dependencies = self.toolkit_dependencies();
        dependencies.push((
            CELL_DEPS_CRATE.into(),
            format!(
                "{{ path = {:?} }}",
                self.cell_deps_dir().display().to_string()
            ),
        ));
        Prelude {
            dependencies,
            code: format!(
                "use {CELL_DEPS_LIB} as _;\n\
                 use art_core::*;\n\
                 use art_core::display::{{self, DebugDisplay, Display, RichDisplay}};\n"
            ),
            offline: self.offline,
            opt_level: self.cell_opt_level.clone(),
            linker: Some(self.linker.clone()),
        }
    }

    /// Writes the [`CELL_DEPS_CRATE`] crate under the cache directory. A file is rewritten only
    /// when its text changes: cargo compares modification times, and a fresh one would relink
    /// the library at every kernel start.
    fn write_cell_deps_crate(&self) -> Result<()> {
        let dir = self.cell_deps_dir();
        let toolkit = self.toolkit_dependencies();
        let dependencies: String = toolkit
            .iter()
            .map(|(name, value)| format!("{name} = {value}\n"))
            .collect();
        let manifest = format!(
            "# Written by art-kernel: the crates every notebook cell uses, as one shared library.\n\
             [package]\nname = \"{CELL_DEPS_CRATE}\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n\
             [lib]\ncrate-type = [\"dylib\"]\npath = \"lib.rs\"\n\n\
             [dependencies]\n{dependencies}"
        );
        // Naming a crate is what makes rustc link it into the library.
        let library: String = std::iter::once(
            "//! Written by art-kernel: the crates every notebook cell uses, linked into this library.\n"
                .to_string(),
        )
        .chain(
            toolkit
                .iter()
                .map(|(name, _)| format!("pub use {};\n", name.replace('-', "_"))),
        )
        .collect();
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        for (name, text) in [("Cargo.toml", manifest), ("lib.rs", library)] {
            let path = dir.join(name);
            if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                std::fs::write(&path, text)
                    .with_context(|| format!("cannot write {}", path.display()))?;
            }
        }
        Ok(())
    }

    /// Starts a build directory's lockfile from the checkout's `Cargo.lock` (when cells use
    /// art-core from a checkout): cells then build the dependency versions the workspace was
    /// tested with, found in cargo's local registry cache, without resolving against the
    /// registry's index. A lockfile already there is kept.
    pub fn seed_lockfile(&self, build_dir: &Path) {
        let ArtCoreSource::Path(art_core) = &self.art_core else {
            return;
        };
        let target = build_dir.join("Cargo.lock");
        let Some(source) = art_core.parent().map(|p| p.join("Cargo.lock")) else {
            return;
        };
        if target.exists() || !source.is_file() {
            return;
        }
        if let Err(error) = std::fs::copy(&source, &target) {
            eprintln!(
                "art-kernel: cannot copy {} to {} ({error}); cargo will resolve afresh",
                source.display(),
                target.display()
            );
        }
    }

    /// Writes what the build directories need above them: cargo's configuration and the
    /// [`CELL_DEPS_CRATE`] crate.
    pub fn prepare_cache(&self) -> Result<()> {
        self.write_cargo_config()?;
        self.write_cell_deps_crate()
    }

    /// Cargo configuration above the build directories: the toolkit and its dependencies are
    /// compiled optimised, whatever level cells use, and without debug assertions (std's
    /// precondition checks inside every SIMD kernel halved candle's CPU matmul, when cells still
    /// compiled the engine). At opt-level 1, not 3: cells get art-core's client side (HTTP,
    /// JSON, DataFrames of a few hundred rows, charts), whose work is waiting on the backend,
    /// and a cold install took 552 s instead of 767 s on two cores.
    fn write_cargo_config(&self) -> Result<()> {
        let dir = self.cache_dir.join(".cargo");
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        std::fs::write(
            dir.join("config.toml"),
            "# Written by art-kernel: dependencies of notebook cells are compiled once, optimised.\n\
             [profile.dev.package.\"*\"]\nopt-level = 1\ndebug = false\ndebug-assertions = false\n",
        )?;
        Ok(())
    }
}

/// A build directory held by one kernel (cargo and evcxr cannot share one between processes).
pub struct Slot {
    pub dir: PathBuf,
    _lock: File,
}

/// Takes the first free build directory under `cache_dir/slots`. A new one starts as a hard-linked
/// copy of slot 0 (the one `install` warmed), so that a second notebook does not compile the
/// toolkit again.
pub fn acquire_slot(cache_dir: &Path) -> Result<Slot> {
    let slots = cache_dir.join("slots");
    std::fs::create_dir_all(&slots)
        .with_context(|| format!("cannot create {}", slots.display()))?;
    for n in 0..64 {
        let lock_path = slots.join(format!("{n}.lock"));
        let lock = File::create(&lock_path)
            .with_context(|| format!("cannot create {}", lock_path.display()))?;
        // SAFETY: flock on a file descriptor we own.
        let locked = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if !locked {
            continue;
        }
        let dir = slots.join(n.to_string());
        let seed = slots.join("0");
        if n > 0 && dir.exists() && warm_stamp(&dir) != warm_stamp(&seed) {
            // Seeded before slot 0 was warmed again (a newer art-core, another linker): its
            // build would start nearly from scratch; a fresh copy of slot 0 does not.
            let _ = std::fs::remove_dir_all(&dir);
        }
        if !dir.exists() && n > 0 && seed.join("target").is_dir() {
            if let Err(error) = link_tree(&seed, &dir) {
                eprintln!(
                    "art-kernel: could not seed {} from slot 0 ({error}); compiling afresh",
                    dir.display()
                );
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        std::fs::create_dir_all(&dir)?;
        return Ok(Slot { dir, _lock: lock });
    }
    anyhow::bail!("all 64 build slots under {} are in use", slots.display())
}

/// The file in a slot saying which warm-up of slot 0 it is (a copy of).
const WARM_STAMP: &str = ".warm-stamp";

/// Marks a slot as freshly warmed by `install`; slots seeded from it carry the same stamp.
pub fn stamp_warm_slot(slot: &Path) -> Result<()> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let path = slot.join(WARM_STAMP);
    std::fs::write(&path, format!("{nanos}\n"))
        .with_context(|| format!("cannot write {}", path.display()))
}

fn warm_stamp(slot: &Path) -> Option<String> {
    std::fs::read_to_string(slot.join(WARM_STAMP)).ok()
}

/// Copies a directory tree for a new slot, keeping modification times so that cargo sees the
/// artifacts as fresh. Compiled dependencies (`.rlib`, `.rmeta`) are hard links: no one rewrites
/// them. Everything else is copied: evcxr and cargo rewrite their files in place (the cell
/// crate's Cargo.toml, its libraries, fingerprints), and a file shared with another slot would
/// change under a kernel compiling or running there.
fn link_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            link_tree(&entry.path(), &target)?;
        } else if kind.is_symlink() {
            let link = std::fs::read_link(entry.path())?;
            std::os::unix::fs::symlink(link, &target)?;
        } else if !is_dependency_artifact(&entry.file_name().to_string_lossy())
            || std::fs::hard_link(entry.path(), &target).is_err()
        {
            std::fs::copy(entry.path(), &target)?;
            // `copy` gives the copy the time of now: a fingerprint newer than the artifacts it
            // vouches for makes cargo rebuild every crate of the new slot.
            let modified = entry.metadata()?.modified()?;
            File::options()
                .write(true)
                .open(&target)?
                .set_modified(modified)?;
        }
    }
    Ok(())
}

/// A compiled dependency, never rewritten in place: rebuilt only when a dependency changes, and
/// then as a new file (rustc and the linker replace their outputs). evcxr's own cell crates
/// (`ctx`, renamed to `code_N` per cell, and the `evcxr_*` helpers) are rebuilt by every cell.
fn is_dependency_artifact(name: &str) -> bool {
    (name.ends_with(".rlib") || name.ends_with(".rmeta") || name.ends_with(".so"))
        && !["libctx", "libcode_", "libevcxr"]
            .iter()
            .any(|own| name.starts_with(own))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_slots_share_only_compiled_dependencies() {
        assert!(is_dependency_artifact(
            "libpolars_core-ef294e35e92eba02.rlib"
        ));
        assert!(is_dependency_artifact("libtokio-585c545a69bd82ca.rmeta"));
        assert!(is_dependency_artifact("libart_cell_deps.so"));
        for own in [
            "Cargo.toml",
            "Cargo.lock",
            "lib.rs",
            "libctx.rlib",
            "libcode_3.so",
            "libctx.so",
            "libevcxr_dummy_validate_dep.rmeta",
        ] {
            assert!(!is_dependency_artifact(own), "{own}");
        }
    }

    #[test]
    fn prelude_loads_art_core_tokio_and_serde_json() {
        let config = KernelConfig {
            art_core: ArtCoreSource::Path("/src/art-core".into()),
            cache_dir: "/tmp/cache".into(),
            cell_opt_level: "0".into(),
            offline: true,
            toolchain: None,
            linker: "system".into(),
        };
        let prelude = config.prelude();
        let dependency = |name: &str| {
            prelude
                .dependencies
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, value)| value.clone())
        };
        assert_eq!(
            dependency("art-core").as_deref(),
            Some(r#"{ path = "/src/art-core" }"#)
        );
        assert!(dependency("tokio").unwrap().contains("rt-multi-thread"));
        assert!(dependency("serde_json").is_some());
        assert_eq!(
            dependency("art-cell-deps").as_deref(),
            Some(r#"{ path = "/tmp/cache/art-cell-deps" }"#)
        );
        assert!(prelude.code.starts_with("use art_cell_deps as _;\n"));
        assert!(prelude.code.contains("use art_core::*;"));
        assert!(prelude.offline);
        assert_eq!(prelude.opt_level, "0");
        let json = serde_json::to_string(&config).unwrap();
        assert!(json.contains(r#""art_core":{"path":"/src/art-core"}"#));
    }

    #[test]
    fn cell_deps_crate_bundles_the_toolkit_and_is_written_once() {
        let cache =
            std::env::temp_dir().join(format!("art-kernel-deps-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let config = KernelConfig {
            art_core: ArtCoreSource::Version("0.1.0".into()),
            cache_dir: cache.clone(),
            cell_opt_level: "0".into(),
            offline: true,
            toolchain: None,
            linker: "system".into(),
        };
        config.write_cell_deps_crate().unwrap();
        let manifest_path = cache.join("art-cell-deps/Cargo.toml");
        let manifest = std::fs::read_to_string(&manifest_path).unwrap();
        assert!(manifest.contains("crate-type = [\"dylib\"]"), "{manifest}");
        for dependency in [
            "art-core = { version = \"0.1.0\" }",
            "tokio = { version = \"1\"",
            "serde_json = { version = \"1\" }",
        ] {
            assert!(manifest.contains(dependency), "{manifest}");
        }
        let library = std::fs::read_to_string(cache.join("art-cell-deps/lib.rs")).unwrap();
        for name in ["art_core", "serde_json", "tokio"] {
            assert!(library.contains(&format!("pub use {name};")), "{library}");
        }
        // Unchanged text keeps its time: cargo would relink the library otherwise.
        let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        File::options()
            .write(true)
            .open(&manifest_path)
            .unwrap()
            .set_modified(an_hour_ago)
            .unwrap();
        config.write_cell_deps_crate().unwrap();
        let modified = std::fs::metadata(&manifest_path)
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(modified, an_hour_ago);
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn lockfile_is_seeded_from_the_checkout_once() {
        let root =
            std::env::temp_dir().join(format!("art-kernel-lock-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("checkout/art-core")).unwrap();
        std::fs::create_dir_all(root.join("slot")).unwrap();
        std::fs::write(root.join("checkout/Cargo.lock"), "version = 4\n").unwrap();
        let config = KernelConfig {
            art_core: ArtCoreSource::Path(root.join("checkout/art-core")),
            cache_dir: root.join("cache"),
            cell_opt_level: "0".into(),
            offline: true,
            toolchain: None,
            linker: "system".into(),
        };
        config.seed_lockfile(&root.join("slot"));
        assert_eq!(
            std::fs::read_to_string(root.join("slot/Cargo.lock")).unwrap(),
            "version = 4\n"
        );
        // Cargo owns it from then on.
        std::fs::write(root.join("slot/Cargo.lock"), "resolved by cargo").unwrap();
        config.seed_lockfile(&root.join("slot"));
        assert_eq!(
            std::fs::read_to_string(root.join("slot/Cargo.lock")).unwrap(),
            "resolved by cargo"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn slots_are_exclusive_and_seeded_from_slot_zero() {
        let cache =
            std::env::temp_dir().join(format!("art-kernel-slot-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let first = acquire_slot(&cache).unwrap();
        assert!(first.dir.ends_with("slots/0"));
        std::fs::create_dir_all(first.dir.join("target/debug")).unwrap();
        std::fs::write(first.dir.join("target/debug/lib.rlib"), b"rlib").unwrap();
        std::fs::write(first.dir.join("target/debug/lib.d"), b"deps").unwrap();
        let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        File::options()
            .write(true)
            .open(first.dir.join("target/debug/lib.d"))
            .unwrap()
            .set_modified(an_hour_ago)
            .unwrap();
        let second = acquire_slot(&cache).unwrap();
        assert!(second.dir.ends_with("slots/1"));
        assert_eq!(
            std::fs::read(second.dir.join("target/debug/lib.rlib")).unwrap(),
            b"rlib"
        );
        // Copied files keep their time (cargo compares them with the artifacts).
        let modified = |slot: &Path| {
            std::fs::metadata(slot.join("target/debug/lib.d"))
                .unwrap()
                .modified()
                .unwrap()
        };
        assert_eq!(modified(&second.dir), modified(&first.dir));
        drop(first);
        let again = acquire_slot(&cache).unwrap();
        assert!(again.dir.ends_with("slots/0"), "a released slot is reused");

        // Slot 0 warmed again (install after an update): slot 1, seeded before, is reseeded.
        // (A new file, as rustc writes one: slot 1 holds a hard link to the old one.)
        std::fs::remove_file(again.dir.join("target/debug/lib.rlib")).unwrap();
        std::fs::write(again.dir.join("target/debug/lib.rlib"), b"newer").unwrap();
        stamp_warm_slot(&again.dir).unwrap();
        drop(second);
        let second = acquire_slot(&cache).unwrap();
        assert!(second.dir.ends_with("slots/1"));
        assert_eq!(
            std::fs::read(second.dir.join("target/debug/lib.rlib")).unwrap(),
            b"newer"
        );
        assert_eq!(warm_stamp(&second.dir), warm_stamp(&again.dir));
        drop((second, again));
        std::fs::remove_dir_all(&cache).unwrap();
    }
}
