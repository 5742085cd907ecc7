//! A live view of a training run: the step being computed (micro-batches, loss so far) and the
//! reward and loss curves over the steps done, redrawn in place as the run goes on.

use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::html::{escape_html, format_number, styled};
use super::{base64, Display, MimeBundle, Render};
use crate::types::{StepResult, TrainProgress};

/// Updates during a step are sent at most this often (a step's last one always goes out).
const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// A live training output. Create it once before the loop; pass [`TrainingView::hook`] to
/// [`TrainableModel::train_with_progress`](crate::TrainableModel::train_with_progress) and hand
/// each step's result to [`TrainingView::record`]:
///
/// ```no_run
/// # async fn run(model: art_core::TrainableModel, groups: Vec<art_core::TrajectoryGroup>) -> anyhow::Result<()> {
/// use art_core::{display::TrainingView, TrainConfig};
/// let view = TrainingView::new("GRPO on additions");
/// for _ in 0..4 {
///     let result = model.train_with_progress(&groups, &TrainConfig::default(), view.hook()).await?;
///     view.record(&result);
/// }
/// # Ok(()) }
/// ```
///
/// Outside the ART kernel each update prints one line of text instead.
#[derive(Debug)]
pub struct TrainingView {
    display: Display,
    description: String,
    started: Instant,
    state: Mutex<State>,
}

#[derive(Debug, Default, Clone)]
struct State {
    /// (step, mean reward, loss) of each recorded step.
    steps: Vec<(u64, f64, f64)>,
    current: Option<TrainProgress>,
    last_sent: Option<Instant>,
}

impl TrainingView {
    pub fn new(description: impl Into<String>) -> Self {
        TrainingView {
            display: Display::new(),
            description: description.into(),
            started: Instant::now(),
            state: Mutex::new(State::default()),
        }
    }

    /// Shows the progress of the step being computed (throttled to one update per 100 ms, except
    /// the step's first and last).
    pub fn update(&self, progress: &TrainProgress) {
        let snapshot = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let edge = progress.micro_batch == 0 || progress.micro_batch >= progress.micro_batches;
            if !edge && state.last_sent.is_some_and(|t| t.elapsed() < MIN_INTERVAL) {
                return;
            }
            state.current = Some(progress.clone());
            state.last_sent = Some(Instant::now());
            self.snapshot(&state)
        };
        self.display.update(snapshot);
    }

    /// A closure for `train_with_progress`.
    pub fn hook(&self) -> impl FnMut(&TrainProgress) + '_ {
        move |progress| self.update(progress)
    }

    /// Adds a finished step (its mean reward and loss) to the curves.
    pub fn record(&self, result: &StepResult) {
        self.record_step(result.step, result.metrics.reward, result.metrics.loss);
    }

    /// Adds a step by its numbers (for steps measured elsewhere, or an evaluation reward).
    pub fn record_step(&self, step: u64, reward: f64, loss: f64) {
        let snapshot = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.steps.push((step, reward, loss));
            state.current = None;
            state.last_sent = Some(Instant::now());
            self.snapshot(&state)
        };
        self.display.update(snapshot);
    }

    fn snapshot(&self, state: &State) -> TrainingSnapshot {
        TrainingSnapshot {
            description: self.description.clone(),
            steps: state.steps.clone(),
            current: state.current.clone(),
            elapsed: self.started.elapsed(),
        }
    }
}

/// One frame of the training view.
struct TrainingSnapshot {
    description: String,
    steps: Vec<(u64, f64, f64)>,
    current: Option<TrainProgress>,
    elapsed: Duration,
}

impl Render for TrainingSnapshot {
    fn render(&self) -> MimeBundle {
        let last = self.steps.last();
        let first = self.steps.first();
        let mut html = format!(
            r#"<div class="art-root art-progress"><div class="art-head"><span class="art-title">{}</span>"#,
            escape_html(&self.description)
        );
        let mut text = format!("{}:", self.description);
        if let (Some(&(step, reward, loss)), Some(&(_, first_reward, _))) = (last, first) {
            let _ = write!(
                html,
                r#"<span class="art-badge">step <b>{step}</b></span><span class="art-badge">reward <b>{}</b></span><span class="art-badge">loss <b>{}</b></span>"#,
                format_number(reward),
                format_number(loss)
            );
            let _ = write!(
                text,
                " step {step}, reward {} (first {}), loss {}",
                format_number(reward),
                format_number(first_reward),
                format_number(loss)
            );
        } else {
            text.push_str(" no step finished yet");
        }
        let _ = write!(
            html,
            r#"<span class="art-chip">{:.1}s</span></div>"#,
            self.elapsed.as_secs_f64()
        );
        if let Some(p) = &self.current {
            let fraction = if p.micro_batches == 0 {
                0.0
            } else {
                p.micro_batch as f64 / p.micro_batches as f64
            };
            let _ = write!(
                html,
                r#"<div class="art-chip">step {} · micro-batch {}/{} · {}/{} tokens · loss so far {}</div><div class="art-bar"><span class="art-fill" style="width:{:.1}%;background-color:#3b82f6"></span></div>"#,
                p.step,
                p.micro_batch,
                p.micro_batches,
                p.trainable_tokens,
                p.total_trainable_tokens,
                format_number(p.loss),
                fraction * 100.0
            );
            let _ = write!(
                text,
                "; step {}: {}/{} micro-batches",
                p.step, p.micro_batch, p.micro_batches
            );
        }
        // Curves from two steps on: a one-step run's "curve" is a lone dot, and its badges
        // already say everything.
        if self.steps.len() >= 2 {
            let rewards: Vec<(f64, f64)> =
                self.steps.iter().map(|&(s, r, _)| (s as f64, r)).collect();
            let losses: Vec<(f64, f64)> =
                self.steps.iter().map(|&(s, _, l)| (s as f64, l)).collect();
            // As images, not inline <svg>: notebook sanitizers drop inline SVG from untrusted
            // outputs, but keep an <img> with a data URL.
            html.push_str("<div>");
            for (title, points, colour) in [
                ("reward", &rewards, "#16a34a"),
                ("loss", &losses, "#8b5cf6"),
            ] {
                let _ = write!(
                    html,
                    r#"<img class="art-chart" alt="{title}" src="data:image/svg+xml;base64,{}">"#,
                    base64(line_chart(title, points, colour).as_bytes())
                );
            }
            html.push_str("</div>");
        }
        html.push_str("</div>");
        MimeBundle::new()
            .with("text/html", styled(&html))
            .with("text/plain", text)
    }
}

/// A small SVG line chart of `points` (x ascending) with its range written on the axes.
pub(crate) fn line_chart(title: &str, points: &[(f64, f64)], colour: &str) -> String {
    const W: f64 = 280.0;
    const H: f64 = 120.0;
    const LEFT: f64 = 44.0;
    const RIGHT: f64 = 8.0;
    const TOP: f64 = 18.0;
    const BOTTOM: f64 = 20.0;
    let finite: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let (x0, x1) = range(finite.iter().map(|p| p.0));
    let (y0, y1) = range(finite.iter().map(|p| p.1));
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT);
    let sy = |y: f64| TOP + (1.0 - (y - y0) / (y1 - y0)) * (H - TOP - BOTTOM);
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="10" fill="gray"><text x="{LEFT}" y="11" font-weight="600">{}</text><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{}" stroke="gray" stroke-opacity=".5"/><line x1="{LEFT}" y1="{}" x2="{}" y2="{}" stroke="gray" stroke-opacity=".5"/>"#,
        escape_html(title),
        H - BOTTOM,
        H - BOTTOM,
        W - RIGHT,
        H - BOTTOM,
    );
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="end">{}</text><text x="{}" y="{}" text-anchor="end">{}</text><text x="{LEFT}" y="{}">{}</text><text x="{}" y="{}" text-anchor="end">{}</text>"#,
        LEFT - 4.0,
        TOP + 8.0,
        format_number(y1),
        LEFT - 4.0,
        H - BOTTOM,
        format_number(y0),
        H - 6.0,
        format_number(x0),
        W - RIGHT,
        H - 6.0,
        format_number(x1),
    );
    if !finite.is_empty() {
        let path: Vec<String> = finite
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for &(x, y) in &finite {
            let _ = write!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{colour}"/>"#,
                sx(x),
                sy(y)
            );
        }
    }
    svg.push_str("</svg>");
    svg
}

/// The range of `values`, widened when empty or flat so that scaling never divides by zero.
fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        (0.0, 1.0)
    } else if hi - lo < 1e-12 {
        (lo - 0.5, hi + 0.5)
    } else {
        (lo, hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(micro_batch: usize) -> TrainProgress {
        TrainProgress {
            step: 3,
            micro_batch,
            micro_batches: 4,
            trainable_tokens: micro_batch * 10,
            total_trainable_tokens: 40,
            loss: 0.25,
            elapsed_s: 1.0,
        }
    }

    #[test]
    fn snapshot_shows_the_running_step_and_the_curves() {
        let snapshot = TrainingSnapshot {
            description: "GRPO".into(),
            steps: vec![(1, 0.25, 0.5), (2, 0.75, 0.25)],
            current: Some(progress(1)),
            elapsed: Duration::from_secs(3),
        };
        let bundle = snapshot.render();
        let html = bundle.get("text/html").unwrap().as_str().unwrap();
        assert!(html.contains("step <b>2</b>"), "{html}");
        assert!(html.contains("reward <b>0.75</b>"));
        assert!(html.contains("micro-batch 1/4"));
        assert!(html.contains("width:25.0%"));
        // A reward and a loss chart, as images (untrusted notebooks drop inline SVG).
        assert_eq!(
            html.matches(r#"<img class="art-chart""#).count(),
            2,
            "{html}"
        );
        assert!(!html.contains("<svg"));
        assert_eq!(
            bundle.text(),
            "GRPO: step 2, reward 0.75 (first 0.25), loss 0.25; step 3: 1/4 micro-batches"
        );
    }

    #[test]
    fn a_single_step_shows_no_curves() {
        let snapshot = TrainingSnapshot {
            description: "one step".into(),
            steps: vec![(1, 0.25, 0.5)],
            current: None,
            elapsed: Duration::from_secs(3),
        };
        let html = snapshot.render().get("text/html").unwrap().to_string();
        assert!(html.contains("step <b>1</b>"), "{html}");
        assert!(!html.contains("art-chart"), "{html}");
    }

    #[test]
    fn chart_scales_points_into_the_frame() {
        let svg = line_chart("reward", &[(1.0, 0.0), (2.0, 1.0), (3.0, f64::NAN)], "#000");
        // The first point sits bottom-left, the second top-right; the NaN is left out.
        assert!(svg.contains(r#"points="44.0,100.0 272.0,18.0""#), "{svg}");
        assert_eq!(svg.matches("<circle").count(), 2);
        // A flat or single-point series still draws inside the frame.
        let flat = line_chart("loss", &[(1.0, 2.0)], "#000");
        assert!(flat.contains(r#"cx="#), "{flat}");
        assert!(!flat.contains("NaN"));
    }

    #[test]
    fn view_records_steps_and_clears_the_running_one() {
        let view = TrainingView::new("t");
        view.update(&progress(0));
        view.update(&progress(4));
        assert!(view.state.lock().unwrap().current.is_some());
        view.record_step(3, 0.5, 0.1);
        let state = view.state.lock().unwrap();
        assert!(state.current.is_none());
        assert_eq!(state.steps, vec![(3, 0.5, 0.1)]);
    }
}
