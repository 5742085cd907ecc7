//! `art`: the backend's command line. `art serve` runs the OpenAI-compatible server with training.

use std::path::PathBuf;

use art_core::server::{serve, ServeOptions};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "art",
    version,
    about = "ART for Rust: serve and train models for agent reinforcement learning"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model over an OpenAI-compatible API, with the training API under /v1/art.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A GGUF file, a Hugging Face model directory, or a repository id in the local hub cache.
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: String,
    /// The name clients use for the base model (default: the file or directory name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Another name for the base model, accepted wherever the served name is (repeatable). Python
    /// ART programs name their base model by its Hugging Face id, e.g.
    /// `--alias HuggingFaceTB/SmolLM2-135M-Instruct` for the default model.
    #[arg(long = "alias")]
    aliases: Vec<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Clients must send it as `Authorization: Bearer <key>`; required off loopback.
    #[arg(long, env = "ART_API_KEY")]
    api_key: Option<String>,
    /// `cpu`, or `cuda` / `cuda:N` in a CUDA build.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The devices to run on, comma-separated (`cuda:0,cuda:1`; `cpu,cpu` for a try without
    /// GPUs) or `all` (every CUDA device): an inference replica on each (the model loaded on
    /// each, with its own scheduler and key/value caches, behind this one endpoint; a request
    /// goes to its prompt's replica, so that a group's rollouts share one prefix cache, unless
    /// that one is much busier than another), and training data-parallel over all of them (each
    /// device a share of every step's micro-batches, the gradients all-reduced with NCCL: a CUDA
    /// build with the `nccl` feature). Each trained adapter is on every replica before the
    /// training call answers. Replaces --device.
    #[arg(long, conflicts_with_all = ["train_devices", "inference_devices"])]
    devices: Option<String>,
    /// The devices that train (as --devices), data-parallel when there are several. With
    /// --inference-devices: training on devices of their own while the others sample, unless
    /// they are also listed there. Default: the first inference device.
    #[arg(long)]
    train_devices: Option<String>,
    /// The inference replicas (as --devices) when training has devices of its own
    /// (--train-devices). Default: the training devices.
    #[arg(long)]
    inference_devices: Option<String>,
    /// Sample with the GGUF file's quantized weights (llama.cpp's arithmetic: faster decoding on
    /// CPU, logits within a few percent of the dense ones). Training always uses the dense
    /// weights, so the trainer's probabilities then differ slightly from the sampler's.
    #[arg(long)]
    quantized: bool,
    /// Sequences decoded together at most (the key/value cache budget may allow fewer). A GRPO
    /// step's rollouts (128 in the main job) then run as one batch, not in waves.
    #[arg(long, default_value_t = 256)]
    max_batch: usize,
    /// Requests queued beyond the batch before new ones are answered 429.
    #[arg(long, default_value_t = 1024)]
    max_queue: usize,
    /// Tokens generated when a request sets no max_tokens.
    #[arg(long, default_value_t = 1024)]
    default_max_tokens: usize,
    /// MiB of keys and values kept for prompts seen before, so that a GRPO group's rollouts and
    /// an agent's next turn do not prefill them again (0: off). Default: 256 on the CPU, 2048 on
    /// a GPU.
    #[arg(long)]
    prefix_cache_mib: Option<usize>,
    /// MiB the running sequences' keys and values may take together: requests start as it
    /// allows, and past it the newest sequences are preempted and resumed later (their caches
    /// rebuilt). Default: half the GPU's free memory, a quarter of available memory on the CPU.
    #[arg(long)]
    kv_cache_mib: Option<usize>,
    /// Prompt tokens prefilled in one step (default 4,096). A longer prompt that arrives while
    /// other sequences decode is prefilled in chunks of this size, one per step, so that their
    /// tokens keep coming; a smaller value trades the long prompt's wait for steadier decoding.
    #[arg(long)]
    max_prefill_tokens: Option<usize>,
    /// Where trained models, their history and checkpoints are kept.
    #[arg(long, default_value = ".art", env = "ART_DIR")]
    art_dir: PathBuf,
    /// Exit when standard input closes. `LocalBackend` starts the server with it, so the server
    /// ends with the program that started it even when that program is killed (a notebook kernel
    /// restarted or shut down).
    #[arg(long)]
    exit_with_stdin: bool,
    /// Keep freed memory in the process for reuse (glibc's allocator; faster CPU training, at the
    /// price of a process that keeps its peak heap). `off` leaves glibc's defaults.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    malloc_tuning: String,
}

fn device(name: &str) -> anyhow::Result<art_core::engine::Device> {
    use art_core::engine::Device;
    match name {
        "cpu" => Ok(Device::Cpu),
        cuda if cuda.starts_with("cuda") => {
            if !cfg!(feature = "cuda") {
                anyhow::bail!(
                    "device `{cuda}`: this build of art has no CUDA support (build it with \
                     `--features server,cuda`)"
                );
            }
            let ordinal = cuda
                .strip_prefix("cuda:")
                .map(str::parse)
                .transpose()?
                .unwrap_or(0);
            Ok(art_core::engine::cuda_device(ordinal)?)
        }
        other => anyhow::bail!("unknown device `{other}`: use cpu, cuda or cuda:N"),
    }
}

/// Which devices train and which serve, from --device, --devices, or --train-devices and
/// --inference-devices.
struct DeviceRoles {
    /// The first training device (where adapters are registered and checkpointed).
    train: art_core::engine::Device,
    train_serves: bool,
    /// Inference replicas besides the first training device's.
    extra_inference: Vec<art_core::engine::Device>,
    /// Devices that train data-parallel with the first.
    extra_train: Vec<art_core::engine::Device>,
}

fn device_roles(args: &ServeArgs) -> anyhow::Result<DeviceRoles> {
    let names = |list: Option<&str>| list.map(device_names).transpose();
    let train = names(args.train_devices.as_deref())?;
    let inference = names(args.inference_devices.as_deref())?;
    let (train, inference) = match (names(args.devices.as_deref())?, train, inference) {
        (Some(all), _, _) => (all.clone(), all),
        (None, None, None) => (vec![args.device.clone()], vec![args.device.clone()]),
        (None, None, Some(inference)) => (vec![inference[0].clone()], inference),
        (None, Some(train), None) => (train.clone(), train),
        (None, Some(train), Some(inference)) => (train, inference),
    };
    // The first training device's copy serves when it is listed for inference (once: `cpu,cpu`
    // is two copies).
    let mut extra = inference;
    let train_serves = match extra.iter().position(|d| *d == train[0]) {
        Some(at) => {
            extra.remove(at);
            true
        }
        None => false,
    };
    let devices = |names: &[String]| -> anyhow::Result<Vec<_>> {
        names.iter().map(|name| device(name)).collect()
    };
    Ok(DeviceRoles {
        train: device(&train[0])?,
        train_serves,
        extra_inference: devices(&extra)?,
        extra_train: devices(&train[1..])?,
    })
}

/// The device names a --devices-style list gives: comma-separated names (`cuda` is
/// `cuda:0`), or `all` (every CUDA device).
fn device_names(list: &str) -> anyhow::Result<Vec<String>> {
    let names: Vec<String> = match list.trim() {
        "all" => {
            let count = art_core::engine::cuda_device_count()
                .map_err(|e| anyhow::anyhow!("--devices all: no CUDA device to count ({e})"))?;
            if count == 0 {
                anyhow::bail!("--devices all: no CUDA device found");
            }
            (0..count).map(|i| format!("cuda:{i}")).collect()
        }
        list => list
            .split(',')
            .map(|s| match s.trim() {
                "cuda" => "cuda:0".to_string(),
                name => name.to_string(),
            })
            .collect(),
    };
    if names.iter().any(String::is_empty) {
        anyhow::bail!("devices `{list}`: an empty device name (use e.g. cuda:0,cuda:1)");
    }
    Ok(names)
}

/// Reads standard input to its end on a thread of its own, then exits the process.
fn exit_when_stdin_closes() {
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        tracing::info!(
            "standard input closed (the program that started this server ended); exiting"
        );
        art_core::telemetry::shutdown();
        std::process::exit(0);
    });
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Logs go to stderr, `info` and above unless RUST_LOG says otherwise (standard output has
    // the one machine-read line: the address the server listens on).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // SAFETY: no other thread exists yet (the runtime starts below).
    unsafe {
        art_core::engine::process::set_cpu_thread_defaults();
        art_core::engine::process::set_nccl_defaults();
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => {
            if args.exit_with_stdin {
                exit_when_stdin_closes();
            }
            if args.malloc_tuning == "on" {
                art_core::engine::process::tune_allocator();
            }
            let changed = art_core::engine::switches::changed();
            if !changed.is_empty() {
                tracing::info!(switches = %changed.join(" "), "engine switches changed");
            }
            let roles = device_roles(&args)?;
            let load = art_core::engine::LoadOptions {
                device: roles.train,
                ..Default::default()
            };
            serve(ServeOptions {
                model: args.model,
                served_model_name: args.served_model_name,
                aliases: args.aliases,
                host: args.host,
                port: args.port,
                api_key: args.api_key,
                max_batch: args.max_batch,
                max_queue: args.max_queue,
                default_max_tokens: args.default_max_tokens,
                art_dir: args.art_dir,
                quantized: args.quantized,
                prefix_cache_mib: args.prefix_cache_mib,
                kv_cache_mib: args.kv_cache_mib,
                max_prefill_tokens: args.max_prefill_tokens,
                load,
                extra_replicas: roles.extra_inference,
                serve_on_train_device: roles.train_serves,
                extra_train_devices: roles.extra_train,
            })
            .await
        }
    }
}
