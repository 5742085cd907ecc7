//! `art-kernel`: the Jupyter kernel for ART notebooks. Rust cells are compiled and run by evcxr
//! with art-core, tokio and rich displays preloaded.
//!
//! ```text
//! art-kernel install [--user | --sys-prefix | --prefix DIR] [--art-core PATH | --art-core-version V]
//!                    [--cache-dir DIR] [--cell-opt LEVEL] [--no-warm]
//! art-kernel uninstall [--user | --sys-prefix | --prefix DIR]
//! art-kernel run --connection-file FILE [--config FILE]     (what Jupyter starts)
//! ```
//!
//! Layout: `protocol` speaks Jupyter (ZeroMQ sockets, signing, message flow) and runs any
//! `protocol::Engine`; `engine` is the evcxr engine and knows nothing of Jupyter; `config` and
//! `install` hold what is decided at install time.

mod child;
mod config;
mod engine;
mod install;
mod protocol;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use config::{acquire_slot, ArtCoreSource, KernelConfig};
use install::{InstallOptions, Location};

const USAGE: &str = "\
usage:
  art-kernel install [--user | --sys-prefix | --prefix DIR] [--art-core PATH | --art-core-version V]
                     [--cache-dir DIR] [--cell-opt LEVEL] [--no-warm]
  art-kernel uninstall [--user | --sys-prefix | --prefix DIR]
  art-kernel run --connection-file FILE [--config FILE]";

fn main() {
    // When this binary is started as evcxr's child (running cells, or wrapping rustc), this runs
    // that role and never returns. It must come first (after the child's stdout relay).
    child::relay_stdout_if_child();
    evcxr::runtime_hook();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("install") => parse_install(&args[1..]).and_then(install::install),
        Some("uninstall") => parse_location(&args[1..]).and_then(|l| install::uninstall(&l)),
        Some("run") => run(&args[1..]),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(anyhow::anyhow!("{USAGE}")),
    };
    if let Err(error) = result {
        eprintln!("art-kernel: {error:#}");
        std::process::exit(1);
    }
}

/// Options of the form `--name value`.
struct Args<'a> {
    args: std::slice::Iter<'a, String>,
}

impl<'a> Args<'a> {
    fn new(args: &'a [String]) -> Self {
        Args { args: args.iter() }
    }

    fn value(&mut self, flag: &str) -> Result<&'a str> {
        self.args
            .next()
            .map(String::as_str)
            .with_context(|| format!("{flag} needs a value"))
    }
}

fn parse_location(args: &[String]) -> Result<Location> {
    let mut location = Location::User;
    let mut rest = Args::new(args);
    while let Some(arg) = rest.args.next() {
        match arg.as_str() {
            "--user" => location = Location::User,
            "--sys-prefix" => location = Location::SysPrefix,
            "--prefix" => location = Location::Prefix(rest.value("--prefix")?.into()),
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    Ok(location)
}

fn parse_install(args: &[String]) -> Result<InstallOptions> {
    let mut options = InstallOptions {
        location: Location::User,
        config: KernelConfig::defaults(),
        warm: true,
    };
    let mut rest = Args::new(args);
    while let Some(arg) = rest.args.next() {
        match arg.as_str() {
            "--user" => options.location = Location::User,
            "--sys-prefix" => options.location = Location::SysPrefix,
            "--prefix" => options.location = Location::Prefix(rest.value("--prefix")?.into()),
            "--art-core" => {
                let path = PathBuf::from(rest.value("--art-core")?);
                let path = path
                    .canonicalize()
                    .with_context(|| format!("no art-core at {}", path.display()))?;
                options.config.art_core = ArtCoreSource::Path(path);
            }
            "--art-core-version" => {
                options.config.art_core =
                    ArtCoreSource::Version(rest.value("--art-core-version")?.into())
            }
            "--cache-dir" => options.config.cache_dir = rest.value("--cache-dir")?.into(),
            "--cell-opt" => options.config.cell_opt_level = rest.value("--cell-opt")?.into(),
            "--no-warm" => options.warm = false,
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    Ok(options)
}

fn run(args: &[String]) -> Result<()> {
    let mut connection_file = None;
    let mut config_file = None;
    let mut rest = Args::new(args);
    while let Some(arg) = rest.args.next() {
        match arg.as_str() {
            "--connection-file" | "-f" => connection_file = Some(rest.value(arg)?.to_string()),
            "--config" => config_file = Some(PathBuf::from(rest.value("--config")?)),
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    let connection_file = connection_file.context("run needs --connection-file")?;
    let connection: jupyter_protocol::ConnectionInfo = serde_json::from_str(
        &std::fs::read_to_string(&connection_file)
            .with_context(|| format!("cannot read {connection_file}"))?,
    )
    .with_context(|| format!("{connection_file} is not a Jupyter connection file"))?;
    let config = match config_file {
        Some(path) => KernelConfig::load(&path)?,
        None => KernelConfig::defaults(),
    };
    config.prepare_cache()?;
    let slot = acquire_slot(&config.cache_dir)?;
    install::set_engine_env(&config, &slot.dir);
    // After the variables above: the exporter starts a thread of its own.
    art_core::telemetry::init("art-kernel");
    let prelude = config.prelude();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(protocol::serve(
        connection,
        engine::language(),
        move |sink| engine::EvcxrEngine::start(&prelude, sink),
    ))?;
    drop(slot);
    // Blocking threads (a stuck cell) must not keep the process alive.
    std::process::exit(0);
}
