//! `art-kernel install` / `uninstall`: the kernelspec `art` ("Rust (ART)") and a warm build cache,
//! so that the first notebook does not compile the toolkit.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::config::{acquire_slot, ArtCoreSource, KernelConfig};
use crate::engine::EvcxrEngine;
use crate::protocol::{Engine, Output, OutputSink};

pub const KERNEL_NAME: &str = "art";
pub const DISPLAY_NAME: &str = "Rust (ART)";

/// Where a kernelspec goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Location {
    /// The user's Jupyter data directory.
    User,
    /// The running Python environment (a venv or conda env).
    SysPrefix,
    /// `<prefix>/share/jupyter/kernels`.
    Prefix(PathBuf),
}

impl Location {
    pub fn kernels_dir(&self) -> Result<PathBuf> {
        Ok(match self {
            Location::Prefix(prefix) => prefix.join("share/jupyter/kernels"),
            Location::SysPrefix => python_prefix()?.join("share/jupyter/kernels"),
            Location::User => user_data_dir()?.join("kernels"),
        })
    }
}

fn user_data_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("JUPYTER_DATA_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if cfg!(target_os = "macos") {
        let home = dirs::home_dir().context("no home directory")?;
        return Ok(home.join("Library/Jupyter"));
    }
    Ok(dirs::data_dir()
        .context("no user data directory; use --prefix")?
        .join("jupyter"))
}

fn python_prefix() -> Result<PathBuf> {
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = std::env::var_os(var) {
            return Ok(PathBuf::from(prefix));
        }
    }
    let output = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.prefix)"])
        .output()
        .context("--sys-prefix needs python3 (or VIRTUAL_ENV / CONDA_PREFIX)")?;
    if !output.status.success() {
        bail!("python3 could not tell its prefix");
    }
    Ok(PathBuf::from(
        String::from_utf8_lossy(&output.stdout).trim(),
    ))
}

pub struct InstallOptions {
    pub location: Location,
    pub config: KernelConfig,
    pub warm: bool,
}

pub fn install(mut options: InstallOptions) -> Result<()> {
    let exe = std::env::current_exe()?
        .canonicalize()
        .context("cannot locate the art-kernel binary")?;
    if options.warm {
        let started = Instant::now();
        println!(
            "Warming the build cache in {} (the first time compiles art-core and its dependencies: minutes)...",
            options.config.cache_dir.display()
        );
        options.config.linker = warm(&options.config)?;
        println!(
            "Cache warm in {:.1}s (cells link with the {} linker).",
            started.elapsed().as_secs_f64(),
            options.config.linker
        );
        options.config.offline = true;
    }
    let spec_dir = options.location.kernels_dir()?.join(KERNEL_NAME);
    std::fs::create_dir_all(&spec_dir)
        .with_context(|| format!("cannot create {}", spec_dir.display()))?;
    let config_path = spec_dir.join("art-kernel.json");
    std::fs::write(
        &config_path,
        serde_json::to_string_pretty(&options.config)? + "\n",
    )?;
    let spec = serde_json::json!({
        "argv": [
            exe.display().to_string(),
            "run",
            "--config",
            config_path.display().to_string(),
            "--connection-file",
            "{connection_file}",
        ],
        "display_name": DISPLAY_NAME,
        "language": "rust",
        "interrupt_mode": "signal",
        "metadata": { "debugger": false },
    });
    std::fs::write(
        spec_dir.join("kernel.json"),
        serde_json::to_string_pretty(&spec)? + "\n",
    )?;
    std::fs::write(spec_dir.join("logo-svg.svg"), LOGO_SVG)?;
    println!(
        "Installed kernelspec {KERNEL_NAME:?} ({DISPLAY_NAME}) in {}",
        spec_dir.display()
    );
    match &options.config.art_core {
        ArtCoreSource::Path(path) => println!("Cells use art-core from {}", path.display()),
        ArtCoreSource::Version(version) => println!("Cells use art-core {version} from crates.io"),
    }
    Ok(())
}

pub fn uninstall(location: &Location) -> Result<()> {
    let spec_dir = location.kernels_dir()?.join(KERNEL_NAME);
    if !spec_dir.exists() {
        println!("No kernelspec {KERNEL_NAME:?} in {}", spec_dir.display());
        return Ok(());
    }
    std::fs::remove_dir_all(&spec_dir)
        .with_context(|| format!("cannot remove {}", spec_dir.display()))?;
    println!("Removed {}", spec_dir.display());
    Ok(())
}

/// Prepares the process environment for evcxr in `slot`: build directory, displays on, and evcxr's
/// own configuration directory kept apart from a user's evcxr setup. Call before any thread starts.
/// The variable naming the file that holds the running cell's trace context.
pub const CELL_TRACE_ENV: &str = "ART_TRACEPARENT_FILE";

pub fn set_engine_env(config: &KernelConfig, slot: &Path) {
    let evcxr_config = config.cache_dir.join("evcxr-config");
    let _ = std::fs::create_dir_all(&evcxr_config);
    // Set while the process is still single-threaded.
    std::env::set_var("EVCXR_TMPDIR", slot);
    std::env::set_var("EVCXR_CONFIG_DIR", &evcxr_config);
    std::env::set_var(art_core::display::wire::KERNEL_ENV, "1");
    if let Some(toolchain) = &config.toolchain {
        std::env::set_var("RUSTUP_TOOLCHAIN", toolchain);
    }
    // Where each cell's span is written for the cells' own spans (rollouts, RULER, steps) to
    // join (art_core::telemetry), when traces are exported at all.
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
        || std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
    {
        std::env::set_var(CELL_TRACE_ENV, slot.join("cell-traceparent"));
    }
    config.seed_lockfile(slot);
}

/// Compiles the prelude and a cell using the displays once, in the first free build slot, with
/// the linker evcxr finds; returns the linker that worked.
fn warm(config: &KernelConfig) -> Result<String> {
    config.prepare_cache()?;
    let slot = acquire_slot(&config.cache_dir)?;
    set_engine_env(config, &slot.dir);
    let sink: OutputSink = Arc::new(|output| match output {
        Output::Stdout(text) | Output::Stderr(text) => print!("{text}"),
        Output::Display { .. } => {}
    });
    let mut warm_config = config.clone();
    warm_config.offline = false;
    let progress = Progress::start(&slot.dir);
    let mut prelude = warm_config.prelude();
    prelude.linker = None;
    let mut engine = EvcxrEngine::start(&prelude, sink)?;
    engine.execute(WARM_CELL).map_err(|report| {
        anyhow::anyhow!("the warm-up cell failed:\n{}", report.traceback.join("\n"))
    })?;
    engine.interrupter().shutdown();
    progress.finish();
    crate::config::stamp_warm_slot(&slot.dir)?;
    Ok(engine.linker.clone())
}

/// A line every few seconds while the cache warms: how many of the cells' crates are compiled.
struct Progress {
    done: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Progress {
    const EVERY: std::time::Duration = std::time::Duration::from_secs(15);

    fn start(slot: &Path) -> Progress {
        let (done, finished) = std::sync::mpsc::channel();
        let slot = slot.to_path_buf();
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                finished.recv_timeout(Self::EVERY)
            {
                let total = locked_packages(&slot)
                    .map(|n| format!(" of ~{n}"))
                    .unwrap_or_default();
                println!(
                    "art-kernel install: {}{total} crates compiled for notebook cells ({:.0} s)",
                    compiled_crates(&slot),
                    started.elapsed().as_secs_f64()
                );
            }
        });
        Progress { done, thread }
    }

    fn finish(self) {
        let _ = self.done.send(());
        let _ = self.thread.join();
    }
}

/// Crates with a compiled library in the slot: for the cells' target triple, and for the host
/// (proc macros).
fn compiled_crates(slot: &Path) -> usize {
    let target = slot.join("target");
    let mut deps_dirs = vec![target.join("debug/deps")];
    if let Ok(triples) = std::fs::read_dir(&target) {
        deps_dirs.extend(triples.flatten().map(|t| t.path().join("debug/deps")));
    }
    let mut crates = std::collections::HashSet::new();
    for dir in deps_dirs {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !(name.ends_with(".rlib") || name.ends_with(".so")) {
                continue;
            }
            if let Some((crate_name, _hash)) =
                name.strip_prefix("lib").and_then(|n| n.rsplit_once('-'))
            {
                crates.insert(crate_name.to_string());
            }
        }
    }
    crates.len()
}

/// Packages in the slot's lockfile (once cargo has resolved them).
fn locked_packages(slot: &Path) -> Option<usize> {
    let lock = std::fs::read_to_string(slot.join("Cargo.lock")).ok()?;
    Some(lock.matches("[[package]]").count())
}

/// Touches what notebooks use first, so their first cells find it compiled.
const WARM_CELL: &str = r#"
let mut t = Trajectory::new([Message::system("warm"), Message::user("up")]);
t.push_message(Message::assistant("ok"));
t.reward = 1.0;
display::show(&t);
display::html("<b>ready</b>");
let live = Display::new();
live.update(display::Html("1".into()));
tokio::time::sleep(std::time::Duration::from_millis(1)).await;
TrajectoryGroup::new([t])
"#;

const LOGO_SVG: &str = r##"<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64" viewBox="0 0 64 64"><rect width="64" height="64" rx="14" fill="#b7410e"/><text x="32" y="42" font-family="sans-serif" font-size="24" font-weight="700" text-anchor="middle" fill="#fff">ART</text></svg>"##;
