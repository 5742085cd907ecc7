//! Running rollouts: every rollout of every group concurrently, with progress, a tolerance for
//! failed rollouts, and a hook per finished group (where RULER plugs in).

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;

use backon::Retryable;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use opentelemetry::trace::{FutureExt as _, SpanKind};
use opentelemetry::{Context, KeyValue};

pub use crate::display::GatherProgress;
use crate::telemetry;
use crate::types::{MetadataValue, RolloutException, Trajectory, TrajectoryGroup};

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
type RolloutFuture<'a> = BoxFuture<'a, anyhow::Result<Trajectory>>;
type AfterEachHook<'a> = Box<
    dyn Fn(TrajectoryGroup) -> BoxFuture<'a, anyhow::Result<Option<TrajectoryGroup>>>
        + Send
        + Sync
        + 'a,
>;
type ProgressHook<'a> = Box<dyn Fn(&GatherProgress) + Send + Sync + 'a>;

/// A group whose rollouts have not run yet: build it with [`TrajectoryGroup::from_rollouts`], run it
/// with [`gather_trajectory_groups`] (or [`PendingGroup::gather`] for just one).
pub struct PendingGroup<'a> {
    rollouts: Vec<RolloutFuture<'a>>,
    metadata: BTreeMap<String, MetadataValue>,
}

impl TrajectoryGroup {
    /// A group of rollouts to run, usually the same scenario several times:
    /// `TrajectoryGroup::from_rollouts((0..8).map(|_| rollout(&client, &scenario)))`.
    /// A rollout is any future giving `Result<Trajectory, E>`; nothing runs until it is gathered.
    pub fn from_rollouts<'a, I, F, E>(rollouts: I) -> PendingGroup<'a>
    where
        I: IntoIterator<Item = F>,
        F: Future<Output = Result<Trajectory, E>> + Send + 'a,
        E: Into<anyhow::Error> + 'a,
    {
        PendingGroup {
            rollouts: rollouts
                .into_iter()
                .map(|rollout| {
                    Box::pin(async move { rollout.await.map_err(Into::into) }) as RolloutFuture<'a>
                })
                .collect(),
            metadata: BTreeMap::new(),
        }
    }
}

impl TrajectoryGroup {
    /// A group of `count` rollouts that survive transient failures: rollout `i` is
    /// `make(i)`, built again and retried (up to `retries` more times, after about 0.25 s,
    /// 0.5 s, 1 s, ... with jitter) when it fails with an error [`is_transient`] accepts, so that
    /// a dropped connection or an overloaded server (429, 503) costs an attempt, not the
    /// trajectory.
    pub fn from_retried_rollouts<'a, M, F, E>(
        count: usize,
        retries: usize,
        make: M,
    ) -> PendingGroup<'a>
    where
        M: Fn(usize) -> F + Send + Sync + 'a,
        F: Future<Output = Result<Trajectory, E>> + Send + 'a,
        E: Into<anyhow::Error> + 'a,
    {
        let make = std::sync::Arc::new(make);
        TrajectoryGroup::from_rollouts((0..count).map(|i| {
            let make = make.clone();
            async move {
                let attempt = || async { make(i).await.map_err(Into::into) };
                attempt
                    .retry(crate::client::backoff(retries))
                    .when(is_transient)
                    .await
            }
        }))
    }
}

/// Whether a rollout's error is worth another attempt: a [`ClientError`] (anywhere in its chain)
/// that says the server was unreachable or overloaded.
///
/// [`ClientError`]: crate::ClientError
pub fn is_transient(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<crate::ClientError>()
            .is_some_and(crate::ClientError::is_transient)
    })
}

impl<'a> PendingGroup<'a> {
    /// Metadata copied onto the finished group (scenario id, difficulty, ...).
    pub fn with_metadata(
        mut self,
        name: impl Into<String>,
        value: impl Into<MetadataValue>,
    ) -> Self {
        self.metadata.insert(name.into(), value.into());
        self
    }

    pub fn len(&self) -> usize {
        self.rollouts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rollouts.is_empty()
    }

    /// Runs this one group's rollouts with the given options.
    pub async fn gather(self, options: GatherOptions<'a>) -> Result<TrajectoryGroup, GatherError> {
        let mut groups = gather_trajectory_groups([self], options).await?;
        groups.pop().ok_or(GatherError::GroupDropped)
    }
}

/// How many failed rollouts to tolerate before giving up on the whole gather.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaxExceptions {
    Count(usize),
    /// A fraction of all rollouts (0.1 = one rollout in ten may fail).
    Fraction(f64),
}

impl MaxExceptions {
    fn allowed(self, total: usize) -> usize {
        match self {
            MaxExceptions::Count(n) => n,
            MaxExceptions::Fraction(f) => (f.clamp(0.0, 1.0) * total as f64).floor() as usize,
        }
    }
}

impl From<usize> for MaxExceptions {
    fn from(n: usize) -> Self {
        MaxExceptions::Count(n)
    }
}

impl From<i32> for MaxExceptions {
    fn from(n: i32) -> Self {
        MaxExceptions::Count(n.max(0) as usize)
    }
}

impl From<f64> for MaxExceptions {
    /// As in ART: a value below 1 is a fraction of all rollouts, otherwise a count.
    fn from(value: f64) -> Self {
        if value < 1.0 {
            MaxExceptions::Fraction(value)
        } else {
            MaxExceptions::Count(value as usize)
        }
    }
}

/// Options of [`gather_trajectory_groups`], built with chained setters.
pub struct GatherOptions<'a> {
    max_exceptions: MaxExceptions,
    concurrency: Option<usize>,
    after_each: Option<AfterEachHook<'a>>,
    on_progress: Option<ProgressHook<'a>>,
    progress_bar: bool,
    description: String,
}

impl Default for GatherOptions<'_> {
    fn default() -> Self {
        GatherOptions {
            max_exceptions: MaxExceptions::Count(0),
            concurrency: None,
            after_each: None,
            on_progress: None,
            progress_bar: true,
            description: "gather".to_string(),
        }
    }
}

impl<'a> GatherOptions<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Failed rollouts tolerated (dropped from their groups and kept as exceptions); one more fails
    /// the gather. Default 0. A float below 1 is a fraction of all rollouts.
    pub fn max_exceptions(mut self, limit: impl Into<MaxExceptions>) -> Self {
        self.max_exceptions = limit.into();
        self
    }

    /// At most this many rollouts in flight at once (default: all of them).
    pub fn concurrency(mut self, limit: usize) -> Self {
        self.concurrency = Some(limit.max(1));
        self
    }

    /// Called once per group when all its rollouts have finished; returns the group to keep (maybe
    /// rescored, as RULER does) or `None` to drop it. An error fails the gather.
    pub fn after_each<F, Fut>(mut self, hook: F) -> Self
    where
        F: Fn(TrajectoryGroup) -> Fut + Send + Sync + 'a,
        Fut: Future<Output = anyhow::Result<Option<TrajectoryGroup>>> + Send + 'a,
    {
        self.after_each = Some(Box::new(move |group| Box::pin(hook(group))));
        self
    }

    /// Called after every finished rollout and group (for live displays such as the notebook's).
    pub fn on_progress(mut self, hook: impl Fn(&GatherProgress) + Send + Sync + 'a) -> Self {
        self.on_progress = Some(Box::new(hook));
        self
    }

    /// Show the terminal progress bar (default true; it hides itself when stderr is not a terminal).
    pub fn progress_bar(mut self, show: bool) -> Self {
        self.progress_bar = show;
        self
    }

    pub fn description(mut self, text: impl Into<String>) -> Self {
        self.description = text.into();
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GatherError {
    #[error(
        "{count} rollouts failed, more than the {allowed} allowed by max_exceptions; the first: {first}. \
         Fix the rollout, or raise max_exceptions to drop failed rollouts and go on"
    )]
    TooManyExceptions {
        count: usize,
        allowed: usize,
        first: String,
    },
    #[error("the after_each hook failed for group {group}: {source:#}")]
    AfterEach { group: usize, source: anyhow::Error },
    #[error("the after_each hook dropped the only group")]
    GroupDropped,
}

/// Runs every rollout of every group concurrently and returns the finished groups in the order
/// given (groups dropped by `after_each` left out). A rollout that errors or panics is recorded as
/// an exception of its group and never takes the other rollouts down.
pub async fn gather_trajectory_groups<'a>(
    groups: impl IntoIterator<Item = PendingGroup<'a>>,
    options: GatherOptions<'a>,
) -> Result<Vec<TrajectoryGroup>, GatherError> {
    // The trace: this span, a `trajectory_group` span per group (its after_each hook, RULER,
    // runs inside it) and a `rollout` span per rollout, under which the rollout's own requests
    // carry the trace to the server.
    let span = telemetry::start("gather_trajectory_groups", SpanKind::Internal, Vec::new());
    let gathered = gather_in(groups, options, &span);
    telemetry::in_span(span.clone(), gathered, |groups| {
        let rollouts: usize = groups.iter().map(|g| g.trajectories.len()).sum();
        vec![
            KeyValue::new("art.groups", groups.len() as i64),
            KeyValue::new("art.trajectories", rollouts as i64),
        ]
    })
    .await
}

async fn gather_in<'a>(
    groups: impl IntoIterator<Item = PendingGroup<'a>>,
    options: GatherOptions<'a>,
    span: &Context,
) -> Result<Vec<TrajectoryGroup>, GatherError> {
    let mut queue = Vec::new();
    let mut slots = Vec::new();
    for (group_index, pending) in groups.into_iter().enumerate() {
        let size = pending.rollouts.len();
        let group_span = telemetry::start_with_parent(
            span,
            "trajectory_group",
            SpanKind::Internal,
            vec![
                KeyValue::new("art.group.index", group_index as i64),
                KeyValue::new("art.group.size", size as i64),
            ],
        );
        queue.extend(pending.rollouts.into_iter().enumerate().map(|(i, r)| {
            let rollout_span = telemetry::start_with_parent(
                &group_span,
                "rollout",
                SpanKind::Internal,
                vec![
                    KeyValue::new("art.group.index", group_index as i64),
                    KeyValue::new("art.rollout.index", i as i64),
                ],
            );
            (group_index, i, rollout_span, r)
        }));
        slots.push(GroupSlot {
            results: (0..size).map(|_| None).collect(),
            remaining: size,
            exceptions: Vec::new(),
            metadata: pending.metadata,
            span: group_span,
        });
    }
    let total = queue.len();
    let allowed = options.max_exceptions.allowed(total);
    let concurrency = options.concurrency.unwrap_or(total.max(1));
    let mut progress = GatherProgress {
        total,
        done: 0,
        exceptions: 0,
        groups_total: slots.len(),
        groups_done: 0,
        reward_mean: None,
    };
    let bar = Reporter::new(&options, total);
    let mut reward_sum = 0.0;
    let mut finished: Vec<Option<TrajectoryGroup>> = (0..slots.len()).map(|_| None).collect();

    let mut pending_rollouts = queue.into_iter();
    let mut running = FuturesUnordered::new();
    let mut hooks = FuturesUnordered::new();
    let mut start_next = |running: &mut FuturesUnordered<_>| {
        if let Some((group, index, span, rollout)) = pending_rollouts.next() {
            running.push(async move {
                let outcome = AssertUnwindSafe(rollout.with_context(span.clone()))
                    .catch_unwind()
                    .await;
                end_rollout_span(&span, &outcome);
                (group, index, outcome)
            });
        }
    };
    for _ in 0..concurrency {
        start_next(&mut running);
    }
    // Groups with no rollouts at all are finished from the start.
    let empty: Vec<usize> = (0..slots.len())
        .filter(|&g| slots[g].remaining == 0)
        .collect();
    for group in empty {
        let (taken, span) = slots[group].take();
        hooks.push(finish_group(
            group,
            taken,
            span,
            options.after_each.as_ref(),
        ));
    }

    while !running.is_empty() || !hooks.is_empty() {
        tokio::select! {
            Some((group, index, outcome)) = running.next(), if !running.is_empty() => {
                start_next(&mut running);
                let slot = &mut slots[group];
                match outcome {
                    Ok(Ok(trajectory)) => {
                        reward_sum += trajectory.reward;
                        slot.results[index] = Some(trajectory);
                    }
                    Ok(Err(error)) => slot.exceptions.push(RolloutException {
                        kind: "RolloutError".to_string(),
                        message: format!("{error:#}"),
                        traceback: format!("{error:?}"),
                    }),
                    Err(panic) => slot.exceptions.push(RolloutException {
                        kind: "Panic".to_string(),
                        message: panic_message(&*panic),
                        traceback: String::new(),
                    }),
                }
                slot.remaining -= 1;
                progress.done += 1;
                progress.exceptions = slots.iter().map(|s| s.exceptions.len()).sum();
                let succeeded = progress.done - progress.exceptions;
                progress.reward_mean = (succeeded > 0).then(|| reward_sum / succeeded as f64);
                if progress.exceptions > allowed {
                    bar.abandon(&progress, "too many failed rollouts");
                    let first = slots.iter().flat_map(|s| &s.exceptions).next().map(|e| e.message.clone());
                    return Err(GatherError::TooManyExceptions {
                        count: progress.exceptions,
                        allowed,
                        first: first.unwrap_or_default(),
                    });
                }
                if slots[group].remaining == 0 {
                    let (taken, span) = slots[group].take();
                    hooks.push(finish_group(group, taken, span, options.after_each.as_ref()));
                }
                bar.report(&options, &progress);
            }
            Some((group, result)) = hooks.next(), if !hooks.is_empty() => {
                finished[group] = result?;
                progress.groups_done += 1;
                bar.report(&options, &progress);
            }
        }
    }
    bar.finish(&progress);
    Ok(finished.into_iter().flatten().collect())
}

/// What is known of one group while its rollouts run.
struct GroupSlot {
    results: Vec<Option<Trajectory>>,
    remaining: usize,
    exceptions: Vec<RolloutException>,
    metadata: BTreeMap<String, MetadataValue>,
    /// The group's `trajectory_group` span, ended once its after_each hook is done.
    span: Context,
}

impl GroupSlot {
    /// The finished group (successful trajectories in their original order, failures as
    /// exceptions) and its span.
    fn take(&mut self) -> (TrajectoryGroup, Context) {
        let group = TrajectoryGroup {
            trajectories: self.results.drain(..).flatten().collect(),
            exceptions: std::mem::take(&mut self.exceptions),
            metadata: std::mem::take(&mut self.metadata),
            ..Default::default()
        };
        (group, self.span.clone())
    }
}

async fn finish_group(
    index: usize,
    group: TrajectoryGroup,
    span: Context,
    hook: Option<&AfterEachHook<'_>>,
) -> (usize, Result<Option<TrajectoryGroup>, GatherError>) {
    let result = match hook {
        None => Ok(Some(group)),
        Some(hook) => hook(group)
            .with_context(span.clone())
            .await
            .map_err(|source| GatherError::AfterEach {
                group: index,
                source,
            }),
    };
    telemetry::end_with(&span, &result, |kept| {
        let Some(group) = kept else {
            return Vec::new();
        };
        let rewards = group.trajectories.iter().map(|t| t.reward);
        let mean = rewards.sum::<f64>() / group.trajectories.len().max(1) as f64;
        vec![
            KeyValue::new("art.reward.mean", mean),
            KeyValue::new("art.exceptions", group.exceptions.len() as i64),
        ]
    });
    (index, result)
}

/// Records a rollout's outcome on its span and ends it.
fn end_rollout_span(
    span: &Context,
    outcome: &Result<anyhow::Result<Trajectory>, Box<dyn std::any::Any + Send>>,
) {
    match outcome {
        Ok(result) => {
            // `{:#}`: the error with its causes, as the group's exception records it.
            let result = result.as_ref().map_err(|error| format!("{error:#}"));
            telemetry::end_with(span, &result, |trajectory| {
                vec![
                    KeyValue::new("art.reward", trajectory.reward),
                    KeyValue::new("art.messages", trajectory.messages_and_choices.len() as i64),
                ]
            });
        }
        Err(panic) => telemetry::end(span, Some(&panic_message(&**panic))),
    }
}

/// Shows progress: a terminal bar on stderr, or a live output in the ART notebook kernel.
enum Reporter {
    Bar(ProgressBar),
    Notebook(crate::display::GatherProgressView),
}

impl Reporter {
    fn new(options: &GatherOptions<'_>, total: usize) -> Self {
        if !options.progress_bar {
            return Reporter::Bar(ProgressBar::hidden());
        }
        if crate::display::in_kernel() {
            return Reporter::Notebook(crate::display::GatherProgressView::new(
                options.description.clone(),
            ));
        }
        let bar = ProgressBar::new(total as u64);
        let style = ProgressStyle::with_template(
            "{prefix} {wide_bar} {pos}/{len} [{elapsed_precise}] {msg}",
        )
        .expect("the progress template is valid");
        bar.set_style(style);
        bar.set_prefix(options.description.clone());
        Reporter::Bar(bar)
    }

    fn report(&self, options: &GatherOptions<'_>, progress: &GatherProgress) {
        match self {
            Reporter::Bar(bar) => {
                bar.set_position(progress.done as u64);
                let reward = progress
                    .reward_mean
                    .map_or("-".to_string(), |r| format!("{r:.3}"));
                bar.set_message(format!(
                    "reward={reward} exceptions={}",
                    progress.exceptions
                ));
            }
            Reporter::Notebook(view) => view.update(progress),
        }
        if let Some(hook) = &options.on_progress {
            hook(progress);
        }
    }

    fn abandon(&self, progress: &GatherProgress, why: &str) {
        match self {
            Reporter::Bar(bar) => bar.abandon_with_message(why.to_string()),
            Reporter::Notebook(view) => view.finish(progress, Some(why)),
        }
    }

    fn finish(&self, progress: &GatherProgress) {
        match self {
            Reporter::Bar(bar) => bar.finish(),
            Reporter::Notebook(view) => view.update(progress),
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        format!("rollout panicked: {text}")
    } else if let Some(text) = payload.downcast_ref::<String>() {
        format!("rollout panicked: {text}")
    } else {
        "rollout panicked".to_string()
    }
}
