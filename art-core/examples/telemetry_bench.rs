//! What trace export costs a training iteration (rollouts, `model.log`, a step) when its endpoint
//! is down: the same iterations with traces off, with an endpoint that refuses connections, and
//! with one that accepts and never answers, interleaved round by round, each in a process of its
//! own (the OTEL_* variables are read once per process). Prints the median iteration time of each
//! and its ratio to "off".
//!
//!     cargo run --release -p art-core --features server --example telemetry_bench [-- ROUNDS STEPS]
//!
//! (scripts/fetch-models.sh first; the `art` binary is found as for the main job.)

use std::net::TcpListener;
use std::process::Command;
use std::time::Instant;

use art_core::{
    gather_trajectory_groups, telemetry, ChatCompletionRequest, GatherOptions, LocalBackend,
    LocalBackendOptions, Message, Split, TrainConfig, TrainableModel, Trajectory, TrajectoryGroup,
};

async fn rollout(model: &TrainableModel, a: u32, seed: u64) -> anyhow::Result<Trajectory> {
    let mut trajectory = Trajectory::new([
        Message::system("Answer with the number only."),
        Message::user(format!("What is {a} + 7?")),
    ]);
    let mut request = ChatCompletionRequest::new("", trajectory.messages());
    request.max_tokens = Some(16);
    request.temperature = Some(1.0);
    request.seed = Some(seed);
    request.logprobs = Some(true);
    let choice = model.endpoint().complete(request).await?.choices.remove(0);
    let text = choice.to_message().text();
    trajectory.reward = f64::from(text.contains(&(a + 7).to_string())) + text.len() as f64 / 100.0;
    trajectory.push_choice(choice);
    Ok(trajectory)
}

/// The child: `steps` iterations, printing each one's seconds.
async fn iterations(steps: usize) -> anyhow::Result<()> {
    let backend = LocalBackend::start(LocalBackendOptions::default_model()?).await?;
    let name = format!("bench-{}", std::process::id());
    let model = TrainableModel::register(&backend, name, "telemetry-bench").await?;
    for step in 0..steps {
        let started = Instant::now();
        let model = &model;
        let groups = (0..4u32).map(|g| {
            TrajectoryGroup::from_rollouts(
                (0..4u64).map(move |i| rollout(model, g + 10 * step as u32, i)),
            )
        });
        let groups =
            gather_trajectory_groups(groups, GatherOptions::new().progress_bar(false)).await?;
        model.log(&groups, Split::Train).await?;
        let step_started = Instant::now();
        model.train(&groups, &TrainConfig::default()).await?;
        println!(
            "iteration {:.4} step {:.4}",
            started.elapsed().as_secs_f64(),
            step_started.elapsed().as_secs_f64()
        );
    }
    // CPU time of the exporters' own threads (the SDK's batch processor, the blocking HTTP
    // client's runtime), here and in `art serve`, against all the CPU both processes used.
    let me = std::process::id();
    let server = child_of(me);
    let (mine, mine_total) = cpu_seconds(me);
    let (theirs, theirs_total) = server.map_or((0.0, 0.0), cpu_seconds);
    println!(
        "cpu exporters {:.4} total {:.4}",
        mine + theirs,
        mine_total + theirs_total
    );
    // What one span costs the thread that makes it: a `chat` span with its GenAI attributes,
    // started and ended, as every rollout makes.
    if telemetry::enabled() {
        let request = ChatCompletionRequest::new(
            "bench",
            vec![
                Message::system("Answer with the number only."),
                Message::user("What is 4 + 7?"),
            ],
        );
        let started = Instant::now();
        let count = 2000;
        for _ in 0..count {
            let span = telemetry::start_chat(&request, opentelemetry::trace::SpanKind::Client);
            telemetry::end::<String>(&span, None);
        }
        println!(
            "span_us {:.2}",
            started.elapsed().as_secs_f64() * 1e6 / f64::from(count)
        );
    }
    drop(model);
    drop(backend);
    telemetry::shutdown();
    Ok(())
}

/// (CPU seconds of the exporter threads, CPU seconds of the whole process) from /proc.
fn cpu_seconds(pid: u32) -> (f64, f64) {
    let ticks = |stat: &str| -> f64 {
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, r)| r)
            .split_whitespace()
            .collect();
        // utime and stime are fields 14 and 15 of stat, 12 and 13 after the command name.
        let at = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        (at(11) + at(12)) / 100.0
    };
    let total = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(0.0, |s| ticks(&s));
    let mut exporters = 0.0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.starts_with("OpenTelemetry") || comm.starts_with("reqwest-intern") {
            exporters +=
                std::fs::read_to_string(task.path().join("stat")).map_or(0.0, |s| ticks(&s));
        }
    }
    (exporters, total)
}

/// The pid of this process's `art serve` child.
fn child_of(parent: u32) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == parent).then_some(pid)
        })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return iterations(args[1].parse()?).await;
    }
    let rounds: usize = args.first().map_or(Ok(3), |a| a.parse())?;
    let steps: usize = args.get(1).map_or(Ok(4), |a| a.parse())?;

    let refusing = {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        format!("http://{}", listener.local_addr()?)
    };
    // Accepts connections and never answers: every export waits for its timeout.
    let hanging = TcpListener::bind("127.0.0.1:0")?;
    let hanging_url = format!("http://{}", hanging.local_addr()?);
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in hanging.incoming().flatten() {
            held.push(stream);
        }
    });
    let modes = [
        ("off", None),
        ("refusing", Some(refusing)),
        ("hanging", Some(hanging_url)),
    ];
    // Per mode: (iteration seconds, training-step seconds).
    let mut times: Vec<(Vec<f64>, Vec<f64>)> = vec![Default::default(); modes.len()];
    // Per mode: exporter CPU seconds, all CPU seconds, per-span microseconds.
    let mut cpu: Vec<(f64, f64, Vec<f64>)> = vec![Default::default(); modes.len()];
    for round in 0..rounds {
        for (i, (mode, endpoint)) in modes.iter().enumerate() {
            let mut command = Command::new(std::env::current_exe()?);
            command.args(["--child", &steps.to_string()]);
            for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("OTEL_")) {
                command.env_remove(key);
            }
            if let Some(endpoint) = endpoint {
                command.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
            }
            let output = command.output()?;
            anyhow::ensure!(
                output.status.success(),
                "{mode}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            let stdout = String::from_utf8_lossy(&output.stdout);
            // The first iteration of a process warms caches: left out.
            for line in stdout
                .lines()
                .filter(|l| l.starts_with("iteration "))
                .skip(1)
            {
                let numbers: Vec<f64> = line
                    .split_whitespace()
                    .filter_map(|w| w.parse().ok())
                    .collect();
                times[i].0.push(numbers[0]);
                times[i].1.push(numbers[1]);
            }
            for line in stdout.lines() {
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.as_slice() {
                    ["cpu", "exporters", e, "total", t] => {
                        cpu[i].0 += e.parse::<f64>()?;
                        cpu[i].1 += t.parse::<f64>()?;
                    }
                    ["span_us", us] => cpu[i].2.push(us.parse()?),
                    _ => {}
                }
            }
            eprintln!("round {round} {mode}: {:.3?}", times[i]);
        }
    }
    let (off_iteration, off_step) = (median(times[0].0.clone()), median(times[0].1.clone()));
    println!(
        "median seconds: iteration (4 groups x 4 rollouts, model.log, train step) / train step alone"
    );
    for ((mode, _), (iterations, steps)) in modes.iter().zip(&times) {
        let (iteration, step) = (median(iterations.clone()), median(steps.clone()));
        println!(
            "  {mode:<9} {iteration:.3} s ({:.3}x of off) / {step:.3} s ({:.3}x of off), {} iterations",
            iteration / off_iteration,
            step / off_step,
            iterations.len()
        );
    }
    println!("CPU of the exporters' threads (client and server), of all the CPU the runs used:");
    for ((mode, _), (exporters, total, span_us)) in modes.iter().zip(&cpu) {
        let span = if span_us.is_empty() {
            String::new()
        } else {
            format!(
                ", a chat span costs its thread {:.1} us",
                median(span_us.clone())
            )
        };
        println!(
            "  {mode:<9} {:.3} s of {total:.1} s ({:.4}%){span}",
            exporters,
            100.0 * exporters / total
        );
    }
    Ok(())
}
