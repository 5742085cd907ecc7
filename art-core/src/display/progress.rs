//! A live view of [`gather_trajectory_groups`](crate::gather_trajectory_groups): rollouts done,
//! groups done, failures and the running mean reward, updated in place.

use std::fmt::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::html::{escape_html, format_number, styled};
use super::{Display, MimeBundle, Render};

/// Where gathering stands (what [`gather_trajectory_groups`](crate::gather_trajectory_groups)
/// reports to progress hooks and views).
#[derive(Debug, Clone, PartialEq)]
pub struct GatherProgress {
    pub total: usize,
    pub done: usize,
    pub exceptions: usize,
    pub groups_total: usize,
    pub groups_done: usize,
    /// Mean reward over the finished trajectories so far (before any `after_each` rescoring).
    pub reward_mean: Option<f64>,
}

/// Updates are sent at most this often (the last one always goes out).
const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// A live progress output for gathering. Pass it to
/// [`GatherOptions::on_progress`](crate::GatherOptions::on_progress) with
/// `.on_progress(view.hook())`, or call [`GatherProgressView::update`] yourself. In the ART kernel
/// `gather_trajectory_groups` shows one by itself (unless `progress_bar(false)`).
#[derive(Debug)]
pub struct GatherProgressView {
    display: Display,
    description: String,
    started: Instant,
    last_sent: Mutex<Option<Instant>>,
}

impl GatherProgressView {
    pub fn new(description: impl Into<String>) -> Self {
        GatherProgressView {
            display: Display::new(),
            description: description.into(),
            started: Instant::now(),
            last_sent: Mutex::new(None),
        }
    }

    /// Shows `progress` (throttled: intermediate states closer than 100 ms apart are skipped).
    pub fn update(&self, progress: &GatherProgress) {
        let finished =
            progress.done >= progress.total && progress.groups_done >= progress.groups_total;
        {
            let mut last = self.last_sent.lock().unwrap_or_else(|e| e.into_inner());
            if !finished && last.is_some_and(|t| t.elapsed() < MIN_INTERVAL) {
                return;
            }
            *last = Some(Instant::now());
        }
        self.display.update(self.snapshot(progress, None));
    }

    /// Shows the final state with a closing remark (for example why gathering stopped).
    pub fn finish(&self, progress: &GatherProgress, remark: Option<&str>) {
        self.display
            .update(self.snapshot(progress, remark.map(str::to_string)));
    }

    /// A closure for `GatherOptions::on_progress`.
    pub fn hook(&self) -> impl Fn(&GatherProgress) + Send + Sync + '_ {
        move |progress| self.update(progress)
    }

    fn snapshot(&self, progress: &GatherProgress, remark: Option<String>) -> ProgressSnapshot {
        ProgressSnapshot {
            description: self.description.clone(),
            progress: progress.clone(),
            elapsed: self.started.elapsed(),
            remark,
        }
    }
}

/// One frame of the progress view.
struct ProgressSnapshot {
    description: String,
    progress: GatherProgress,
    elapsed: Duration,
    remark: Option<String>,
}

impl Render for ProgressSnapshot {
    fn render(&self) -> MimeBundle {
        let p = &self.progress;
        let fraction = if p.total == 0 {
            1.0
        } else {
            p.done as f64 / p.total as f64
        };
        let finished = p.done >= p.total && p.groups_done >= p.groups_total;
        let colour = if self.remark.is_some() {
            "#dc2626"
        } else if finished {
            "#16a34a"
        } else {
            "#3b82f6"
        };
        let reward = p.reward_mean.map_or("–".to_string(), format_number);
        let seconds = self.elapsed.as_secs_f64();
        let rate = if seconds > 0.0 && p.done > 0 {
            format!(" · {:.1} rollouts/s", p.done as f64 / seconds)
        } else {
            String::new()
        };
        let mut html = format!(
            r#"<div class="art-root art-progress"><div class="art-head"><span class="art-title">{}</span><span class="art-badge">rollouts <b>{}/{}</b></span><span class="art-badge">groups <b>{}/{}</b></span><span class="art-badge">mean reward <b>{}</b></span>"#,
            escape_html(&self.description),
            p.done,
            p.total,
            p.groups_done,
            p.groups_total,
            reward
        );
        if p.exceptions > 0 {
            let _ = write!(
                html,
                r#"<span class="art-badge" style="border-color:#dc262680;background-color:#dc26261a">failed <b>{}</b></span>"#,
                p.exceptions
            );
        }
        let _ = write!(
            html,
            r#"<span class="art-chip">{seconds:.1}s{rate}</span></div><div class="art-bar"><span class="art-fill" style="width:{:.1}%;background-color:{colour}"></span></div>"#,
            fraction * 100.0
        );
        if let Some(remark) = &self.remark {
            let _ = write!(
                html,
                r#"<div class="art-err">{}</div>"#,
                escape_html(remark)
            );
        }
        html.push_str("</div>");
        let text = format!(
            "{}: {}/{} rollouts, {}/{} groups, mean reward {}, {} failed, {:.1}s",
            self.description,
            p.done,
            p.total,
            p.groups_done,
            p.groups_total,
            reward,
            p.exceptions,
            seconds
        );
        MimeBundle::new()
            .with("text/html", styled(&html))
            .with("text/plain", text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_shows_counts_and_reward() {
        let snapshot = ProgressSnapshot {
            description: "gather".into(),
            progress: GatherProgress {
                total: 8,
                done: 2,
                exceptions: 1,
                groups_total: 2,
                groups_done: 0,
                reward_mean: Some(0.5),
            },
            elapsed: Duration::from_secs(2),
            remark: None,
        };
        let bundle = snapshot.render();
        let html = bundle.get("text/html").unwrap().as_str().unwrap();
        assert!(html.contains("rollouts <b>2/8</b>"));
        assert!(html.contains("mean reward <b>0.5</b>"));
        assert!(html.contains("failed <b>1</b>"));
        assert!(html.contains("width:25.0%"));
        assert_eq!(
            bundle.text(),
            "gather: 2/8 rollouts, 0/2 groups, mean reward 0.5, 1 failed, 2.0s"
        );
    }
}
