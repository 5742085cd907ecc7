//! Training charts for notebooks: rewards per step (mean with a ±std band, one series per split),
//! the reward distribution of a batch of groups, loss and gradient norm, any history metric.
//! Each function returns a [`Chart`], rendered on demand as an SVG string or PNG bytes.
//!
//! Text is drawn with a bundled subset of DejaVu Sans (assets/fonts), so rendering needs no
//! system fonts; in SVG output the font only sizes the layout and the viewer draws the text.

use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::store::metrics::REWARD;
use crate::store::HistoryEntry;
use crate::types::TrajectoryGroup;

/// DejaVu Sans, Latin subset (license: assets/fonts/LICENSE-DejaVu.txt).
static FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-subset.ttf");
const FAMILY: &str = "sans-serif";

/// Series colours: train, val, then others (matplotlib's tab10, readable on white).
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];
const GRID: RGBColor = RGBColor(225, 225, 225);
const AXIS: RGBColor = RGBColor(90, 90, 90);

/// What went wrong rendering a chart.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("the bundled font could not be loaded: {0}")]
    Font(String),
    #[error("drawing the chart failed: {0}")]
    Draw(String),
    #[error("encoding the PNG failed: {0}")]
    Png(String),
}

/// One line of a line chart, with an optional band (x, low, high) drawn under it.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub band: Option<Vec<(f64, f64, f64)>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Body {
    Lines(Vec<Line>),
    /// Rewards per group: a strip of points per group with its mean marked.
    Strips(Vec<Vec<f64>>),
    /// Side-by-side panels under one title.
    Panels(Vec<Chart>),
}

/// A chart ready to render. Sizes are pixels (SVG user units).
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub width: u32,
    pub height: u32,
    body: Body,
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

impl Chart {
    /// A line chart of the given series.
    pub fn lines(
        title: impl Into<String>,
        x_label: impl Into<String>,
        y_label: impl Into<String>,
        lines: Vec<Line>,
    ) -> Self {
        Chart {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            width: 720,
            height: 400,
            body: Body::Lines(lines),
        }
    }

    pub fn with_size(mut self, width: u32, height: u32) -> Self {
        self.width = width.max(100);
        self.height = height.max(80);
        self
    }

    pub fn with_title(mut self, title: impl Into<String>) -> Self {
        self.title = title.into();
        self
    }

    /// The series of a line chart (empty for other kinds).
    pub fn series(&self) -> &[Line] {
        match &self.body {
            Body::Lines(lines) => lines,
            _ => &[],
        }
    }

    /// The chart as an SVG document.
    pub fn to_svg(&self) -> Result<String, PlotError> {
        ensure_font()?;
        let mut svg = String::new();
        {
            let root =
                SVGBackend::with_string(&mut svg, (self.width, self.height)).into_drawing_area();
            self.draw(&root).map_err(draw_error)?;
            root.present().map_err(draw_error)?;
        }
        Ok(svg)
    }

    /// The chart as PNG bytes (RGB).
    pub fn to_png(&self) -> Result<Vec<u8>, PlotError> {
        ensure_font()?;
        let (w, h) = (self.width, self.height);
        let mut rgb = vec![0u8; w as usize * h as usize * 3];
        {
            let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
            self.draw(&root).map_err(draw_error)?;
            root.present().map_err(draw_error)?;
        }
        encode_png(&rgb, w, h).map_err(|e| PlotError::Png(e.to_string()))
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
        root.fill(&WHITE)?;
        match &self.body {
            Body::Lines(lines) => self.draw_lines(root, lines),
            Body::Strips(groups) => self.draw_strips(root, groups),
            Body::Panels(panels) => {
                let inner = root.titled(&self.title, (FAMILY, 22).into_font().color(&BLACK))?;
                let areas = inner.split_evenly((1, panels.len().max(1)));
                for (panel, area) in panels.iter().zip(&areas) {
                    match &panel.body {
                        Body::Lines(lines) => panel.draw_lines(area, lines)?,
                        Body::Strips(groups) => panel.draw_strips(area, groups)?,
                        Body::Panels(_) => {}
                    }
                }
                Ok(())
            }
        }
    }

    fn draw_lines<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        lines: &[Line],
    ) -> DrawResult<DB> {
        let xs = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
        let ys = lines.iter().flat_map(|l| {
            let band = l.band.iter().flatten().flat_map(|b| [b.1, b.2]);
            l.points.iter().map(|p| p.1).chain(band)
        });
        let (x0, x1) = padded_range(xs, 0.5, 0.0);
        let (y0, y1) = padded_range(ys, 0.0, 0.08);
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, (FAMILY, 20).into_font().color(&BLACK))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .bold_line_style(GRID)
            .axis_style(AXIS)
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_labels(10)
            .y_labels(8)
            .x_label_formatter(&integer_label)
            .y_label_formatter(&|y| short_number(*y))
            .label_style((FAMILY, 13).into_font().color(&AXIS))
            .axis_desc_style((FAMILY, 15).into_font().color(&BLACK))
            .draw()?;
        for (i, line) in lines.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            if let Some(band) = &line.band {
                let upper = band.iter().map(|b| (b.0, b.2));
                let lower = band.iter().rev().map(|b| (b.0, b.1));
                chart.draw_series(std::iter::once(Polygon::new(
                    upper.chain(lower).collect::<Vec<_>>(),
                    color.mix(0.18).filled(),
                )))?;
            }
            chart
                .draw_series(LineSeries::new(
                    line.points.iter().copied(),
                    color.stroke_width(2),
                ))?
                .label(line.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(3))
                });
            // Markers, so that a single logged step is visible too.
            chart.draw_series(
                line.points
                    .iter()
                    .map(|&p| Circle::new(p, 3, color.filled())),
            )?;
        }
        if lines.iter().all(|l| l.points.is_empty()) {
            no_data(area)?;
        } else if lines.len() > 1 {
            // A single line needs no legend: the title and axis say what it is.
            chart
                .configure_series_labels()
                .position(legend_corner(lines, (x0, x1), (y0, y1)))
                .background_style(WHITE.mix(0.85))
                .border_style(GRID)
                .label_font((FAMILY, 14).into_font().color(&BLACK))
                .draw()?;
        }
        Ok(())
    }

    fn draw_strips<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        groups: &[Vec<f64>],
    ) -> DrawResult<DB> {
        let n = groups.len();
        let (x0, x1) = (-0.6, n.max(1) as f64 - 0.4);
        let (y0, y1) = padded_range(groups.iter().flatten().copied(), 0.0, 0.08);
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, (FAMILY, 20).into_font().color(&BLACK))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .bold_line_style(GRID)
            .axis_style(AXIS)
            .disable_x_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_labels(n.clamp(1, 20))
            .y_labels(8)
            .x_label_formatter(&integer_label)
            .y_label_formatter(&|y| short_number(*y))
            .label_style((FAMILY, 13).into_font().color(&AXIS))
            .axis_desc_style((FAMILY, 15).into_font().color(&BLACK))
            .draw()?;
        let dot = PALETTE[0];
        let mean_color = PALETTE[3];
        let points: Vec<(f64, f64)> = groups
            .iter()
            .enumerate()
            .flat_map(|(g, rewards)| {
                let k = rewards.len();
                // Spread a group's points evenly across its slot, so equal rewards stay visible.
                rewards.iter().enumerate().map(move |(i, &r)| {
                    let offset = if k > 1 {
                        (i as f64 / (k - 1) as f64 - 0.5) * 0.5
                    } else {
                        0.0
                    };
                    (g as f64 + offset, r)
                })
            })
            .collect();
        // Means first, so that no point hides behind its group's mean.
        let means = groups
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.is_empty())
            .map(|(g, r)| {
                let mean = r.iter().sum::<f64>() / r.len() as f64;
                let g = g as f64;
                PathElement::new(
                    vec![(g - 0.35, mean), (g + 0.35, mean)],
                    mean_color.stroke_width(3),
                )
            });
        // No legend box: wherever it sits it can cover points (rewards fill the whole range);
        // the x axis's description says what the marks are.
        chart.draw_series(means)?;
        chart.draw_series(
            points
                .iter()
                .map(|&p| Circle::new(p, 4, dot.mix(0.7).filled())),
        )?;
        if points.is_empty() {
            no_data(area)?;
        }
        Ok(())
    }
}

/// The right-hand corner the lines leave free: upper when they end low, lower when they end high.
fn legend_corner(
    lines: &[Line],
    (x0, x1): (f64, f64),
    (y0, y1): (f64, f64),
) -> SeriesLabelPosition {
    let right = x0 + 0.6 * (x1 - x0);
    let ys: Vec<f64> = lines
        .iter()
        .flat_map(|l| &l.points)
        .filter(|p| p.0 >= right)
        .map(|p| (p.1 - y0) / (y1 - y0))
        .collect();
    let mean = if ys.is_empty() {
        0.5
    } else {
        ys.iter().sum::<f64>() / ys.len() as f64
    };
    if mean < 0.5 {
        SeriesLabelPosition::UpperRight
    } else {
        SeriesLabelPosition::LowerRight
    }
}

fn ensure_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            register_font(FAMILY, FontStyle::Normal, FONT)
                .map_err(|_| "DejaVuSans-subset.ttf is not a valid TrueType font".to_string())
        })
        .clone()
        .map_err(PlotError::Font)
}

fn encode_png(rgb: &[u8], width: u32, height: u32) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(out)
}

fn draw_error<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> PlotError {
    PlotError::Draw(e.to_string())
}

fn no_data<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>) -> DrawResult<DB> {
    let (w, h) = area.dim_in_pixel();
    let style = (FAMILY, 18)
        .into_font()
        .color(&AXIS)
        .pos(plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Center,
            plotters::style::text_anchor::VPos::Center,
        ));
    area.draw_text("nothing logged yet", &style, (w as i32 / 2, h as i32 / 2))
}

/// (min, max) of the values, widened by `pad` on each side plus `frac` of the span; a sane
/// default for no values or a single value.
fn padded_range(values: impl Iterator<Item = f64>, pad: f64, frac: f64) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return (0.0, 1.0);
    }
    let span = hi - lo;
    let extra = if span == 0.0 {
        lo.abs().max(1.0) * 0.1
    } else {
        span * frac
    };
    (lo - pad - extra, hi + pad + extra)
}

/// Steps and group indices are integers: label only ticks that fall on one.
fn integer_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-6 {
        format!("{}", x.round() as i64)
    } else {
        String::new()
    }
}

fn short_number(y: f64) -> String {
    let a = y.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e5).contains(&a) {
        format!("{y:.1e}")
    } else if a >= 100.0 {
        format!("{y:.0}")
    } else {
        let s = format!("{y:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Splits in display order: train, val, then the others alphabetically.
fn splits_with(history: &[HistoryEntry], metric: &str) -> Vec<String> {
    let mut splits: Vec<String> = history
        .iter()
        .filter(|e| e.get(metric).is_some())
        .map(|e| e.split.clone())
        .collect();
    splits.sort_by_key(|s| (s != "train", s != "val", s.clone()));
    splits.dedup();
    splits
}

/// One line per split that logged `metric`, by step (several entries at one step are averaged),
/// with a band of ± `<metric>_std` where that was logged too.
fn metric_lines(history: &[HistoryEntry], metric: &str) -> Vec<Line> {
    let std_name = format!("{metric}_std");
    splits_with(history, metric)
        .into_iter()
        .map(|split| {
            let mut by_step: std::collections::BTreeMap<u64, (f64, f64, usize)> =
                Default::default();
            for entry in history.iter().filter(|e| e.split == split) {
                if let Some(value) = entry.get(metric) {
                    let slot = by_step.entry(entry.step).or_default();
                    slot.0 += value;
                    slot.1 += entry.get(&std_name).unwrap_or(f64::NAN);
                    slot.2 += 1;
                }
            }
            let points: Vec<(f64, f64)> = by_step
                .iter()
                .map(|(&s, &(sum, _, n))| (s as f64, sum / n as f64))
                .collect();
            let band: Vec<(f64, f64, f64)> = by_step
                .iter()
                .filter(|(_, (_, std, _))| std.is_finite())
                .map(|(&s, &(sum, std, n))| {
                    let (mean, std) = (sum / n as f64, std / n as f64);
                    (s as f64, mean - std, mean + std)
                })
                .collect();
            let name = if split.is_empty() {
                metric.to_string()
            } else {
                split
            };
            Line {
                name,
                points,
                band: (!band.is_empty()).then_some(band),
            }
        })
        .collect()
}

/// Mean reward per step, one line per split (train, val, ...), with a ±std band.
pub fn reward_chart(history: &[HistoryEntry]) -> Chart {
    Chart::lines(
        "Reward per step",
        "step",
        "reward",
        metric_lines(history, REWARD),
    )
}

/// Any history metric by name (without split prefix), one line per split that logged it; a band
/// of ± `<metric>_std` where that was logged.
pub fn metric_chart(history: &[HistoryEntry], metric: &str) -> Chart {
    Chart::lines(
        format!("{metric} per step"),
        "step",
        metric,
        metric_lines(history, metric),
    )
}

/// Loss and gradient norm per step, side by side (as the trainer logs them: `loss`, `grad_norm`).
pub fn training_chart(history: &[HistoryEntry]) -> Chart {
    let panel = |metric: &str, label: &str| {
        Chart::lines(label, "step", metric, metric_lines(history, metric))
    };
    Chart {
        title: "Training".into(),
        x_label: "step".into(),
        y_label: String::new(),
        width: 720,
        height: 400,
        body: Body::Panels(vec![
            panel("loss", "loss"),
            panel("grad_norm", "gradient norm"),
        ]),
    }
}

/// The rewards of each group of a batch: one strip of points per group, its mean marked.
pub fn reward_distribution_chart(groups: &[TrajectoryGroup]) -> Chart {
    Chart {
        title: "Rewards by group".into(),
        x_label: "group (dots: trajectories, bars: group mean)".into(),
        y_label: "reward".into(),
        width: 720,
        height: 400,
        body: Body::Strips(groups.iter().map(TrajectoryGroup::rewards).collect()),
    }
}

impl crate::display::Render for Chart {
    /// SVG (crisp at any zoom) and PNG: JupyterLab does not show SVG outputs of an untrusted
    /// notebook (one opened from a clone) and falls back to the PNG. A chart that fails to draw
    /// shows why instead.
    fn render(&self) -> crate::display::MimeBundle {
        let bundle = crate::display::MimeBundle::new();
        match self.to_svg().and_then(|svg| Ok((svg, self.to_png()?))) {
            Ok((svg, png)) => bundle
                .with("image/svg+xml", svg)
                .with("image/png", crate::display::base64(&png))
                .with("text/plain", format!("<chart: {}>", self.title)),
            Err(e) => bundle.with(
                "text/plain",
                format!("the chart `{}` could not be drawn: {e}", self.title),
            ),
        }
    }
}
