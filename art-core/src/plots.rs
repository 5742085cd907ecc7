//! Training charts for notebooks: rewards per step (mean with a ±std band, one series per split),
//! the reward distribution of a batch of groups, loss and gradient norm, any history metric.
//! Each function returns a [`Chart`], rendered on demand as an SVG string or PNG bytes.
//!
//! Text is drawn with a bundled subset of DejaVu Sans (assets/fonts), so rendering needs no
//! system fonts; in SVG output the font only sizes the layout and the viewer draws the text.

use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::element::ErrorBar;
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
/// Text, axes and grid: a mid grey that reads on white and on a dark notebook alike. Charts have
/// no background of their own (SVG and notebook PNG are transparent), so a dark theme shows
/// through instead of a white box.
const INK: RGBColor = RGBColor(128, 128, 128);
const AXIS: RGBColor = INK;
/// Notebook PNGs are drawn at twice their size and shown at their size: sharp on HiDPI screens.
const PNG_SCALE: u32 = 2;

/// Pixel sizes of one rendering (fonts, margins, strokes), multiplied for a HiDPI PNG.
#[derive(Debug, Clone, Copy)]
struct Scale(f64);

impl Scale {
    fn px(self, v: f64) -> u32 {
        (v * self.0).round() as u32
    }

    fn font(self, size: f64) -> FontDesc<'static> {
        (FAMILY, size * self.0).into_font()
    }
}

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

    /// The chart as an SVG document, on a transparent background.
    pub fn to_svg(&self) -> Result<String, PlotError> {
        ensure_font()?;
        let mut svg = String::new();
        {
            let root =
                SVGBackend::with_string(&mut svg, (self.width, self.height)).into_drawing_area();
            self.draw(&root, Scale(1.0)).map_err(draw_error)?;
            root.present().map_err(draw_error)?;
        }
        Ok(svg)
    }

    /// The chart as PNG bytes (RGB, on white, at its size): for files and reports.
    pub fn to_png(&self) -> Result<Vec<u8>, PlotError> {
        let rgb = self.raster(1, 255)?;
        encode_png(&rgb, self.width, self.height, png::ColorType::Rgb)
            .map_err(|e| PlotError::Png(e.to_string()))
    }

    /// The chart as PNG bytes (RGBA) at `scale` times its size, on a transparent background:
    /// what a notebook shows, in a light or a dark theme, sharp on HiDPI screens at `scale` 2.
    pub fn to_transparent_png(&self, scale: u32) -> Result<Vec<u8>, PlotError> {
        let scale = scale.max(1);
        // Drawn once on white and once on black: a pixel's difference between the two is how
        // transparent it is (plotters' bitmaps have no alpha channel).
        let (on_white, on_black) = (self.raster(scale, 255)?, self.raster(scale, 0)?);
        let rgba = unmix_backgrounds(&on_white, &on_black);
        encode_png(
            &rgba,
            self.width * scale,
            self.height * scale,
            png::ColorType::Rgba,
        )
        .map_err(|e| PlotError::Png(e.to_string()))
    }

    /// RGB pixels at `scale` times the chart's size, drawn over a `background` grey level.
    fn raster(&self, scale: u32, background: u8) -> Result<Vec<u8>, PlotError> {
        ensure_font()?;
        let (w, h) = (self.width * scale, self.height * scale);
        let mut rgb = vec![background; w as usize * h as usize * 3];
        {
            let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
            self.draw(&root, Scale(f64::from(scale)))
                .map_err(draw_error)?;
            root.present().map_err(draw_error)?;
        }
        Ok(rgb)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>, s: Scale) -> DrawResult<DB> {
        match &self.body {
            Body::Lines(lines) => self.draw_lines(root, lines, s),
            Body::Strips(groups) => self.draw_strips(root, groups, s),
            Body::Panels(panels) => {
                let inner = root.titled(&self.title, s.font(22.0).color(&INK))?;
                let areas = inner.split_evenly((1, panels.len().max(1)));
                for (panel, area) in panels.iter().zip(&areas) {
                    match &panel.body {
                        Body::Lines(lines) => panel.draw_lines(area, lines, s)?,
                        Body::Strips(groups) => panel.draw_strips(area, groups, s)?,
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
        s: Scale,
    ) -> DrawResult<DB> {
        let xs = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
        let ys = lines.iter().flat_map(|l| {
            let band = l.band.iter().flatten().flat_map(|b| [b.1, b.2]);
            l.points.iter().map(|p| p.1).chain(band)
        });
        let (x0, x1) = padded_range(xs, 0.5, 0.0);
        let (y0, y1) = padded_range(ys, 0.0, 0.08);
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, s.font(20.0).color(&INK))
            .margin(s.px(12.0))
            .x_label_area_size(s.px(42.0))
            .y_label_area_size(s.px(60.0))
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .bold_line_style(INK.mix(0.25))
            .axis_style(AXIS)
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_labels(10)
            .y_labels(8)
            .x_label_formatter(&integer_label)
            .y_label_formatter(&|y| short_number(*y))
            .label_style(s.font(13.0).color(&AXIS))
            .axis_desc_style(s.font(15.0).color(&INK))
            .draw()?;
        let legend_len = s.px(22.0) as i32;
        let half = s.px(5.0) as i32;
        for (i, line) in lines.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            match &line.band {
                // A band is filled where it has points enough to outline a shape: between two
                // points far apart it is a wedge across the chart, so sparse ones (a
                // validation before and after training) get error bars.
                Some(band) if band.len() >= 3 => {
                    let upper = band.iter().map(|b| (b.0, b.2));
                    let lower = band.iter().rev().map(|b| (b.0, b.1));
                    chart
                        .draw_series(std::iter::once(Polygon::new(
                            upper.chain(lower).collect::<Vec<_>>(),
                            color.mix(0.18).filled(),
                        )))?
                        .label(format!("{} ± std", line.name))
                        .legend(move |(x, y)| {
                            Rectangle::new(
                                [(x, y - half), (x + legend_len, y + half)],
                                color.mix(0.18).filled(),
                            )
                        });
                }
                Some(band) => {
                    let style = color.mix(0.6).stroke_width(s.px(2.0));
                    chart
                        .draw_series(band.iter().map(|&(x, lo, hi)| {
                            let mid = line
                                .points
                                .iter()
                                .find(|p| p.0 == x)
                                .map_or((lo + hi) / 2.0, |p| p.1);
                            ErrorBar::new_vertical(x, lo, mid, hi, style, s.px(10.0))
                        }))?
                        .label(format!("{} ± std", line.name))
                        .legend(move |(x, y)| {
                            let x = x + legend_len / 2;
                            PathElement::new(vec![(x, y - half), (x, y + half)], style)
                        });
                }
                None => {}
            }
            chart
                .draw_series(LineSeries::new(
                    line.points.iter().copied(),
                    color.stroke_width(s.px(2.0)),
                ))?
                .label(line.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + legend_len, y)], color.stroke_width(3))
                });
            // Markers, so that a single logged step is visible too.
            chart.draw_series(
                line.points
                    .iter()
                    .map(|&p| Circle::new(p, s.px(3.0), color.filled())),
            )?;
        }
        if lines.iter().all(|l| l.points.is_empty()) {
            no_data(area, s)?;
        } else if lines.len() > 1 || lines.iter().any(|l| l.band.is_some()) {
            // A single line without a band needs no legend: the title and axis say what it is.
            chart
                .configure_series_labels()
                .position(legend_corner(lines, (x0, x1), (y0, y1)))
                .margin(s.px(10.0))
                .legend_area_size(s.px(30.0))
                .background_style(INK.mix(0.12))
                .border_style(INK.mix(0.4))
                .label_font(s.font(14.0).color(&INK))
                .draw()?;
        }
        Ok(())
    }

    fn draw_strips<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        groups: &[Vec<f64>],
        s: Scale,
    ) -> DrawResult<DB> {
        let n = groups.len();
        let (x0, x1) = (-0.6, n.max(1) as f64 - 0.4);
        let (y0, y1) = padded_range(groups.iter().flatten().copied(), 0.0, 0.08);
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, s.font(20.0).color(&INK))
            .margin(s.px(12.0))
            .x_label_area_size(s.px(42.0))
            .y_label_area_size(s.px(60.0))
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .bold_line_style(INK.mix(0.25))
            .axis_style(AXIS)
            .disable_x_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_labels(n.clamp(1, 20))
            .y_labels(8)
            .x_label_formatter(&integer_label)
            .y_label_formatter(&|y| short_number(*y))
            .label_style(s.font(13.0).color(&AXIS))
            .axis_desc_style(s.font(15.0).color(&INK))
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
                    mean_color.stroke_width(s.px(3.0)),
                )
            });
        // No legend box: wherever it sits it can cover points (rewards fill the whole range);
        // the x axis's description says what the marks are.
        chart.draw_series(means)?;
        chart.draw_series(
            points
                .iter()
                .map(|&p| Circle::new(p, s.px(4.0), dot.mix(0.7).filled())),
        )?;
        if points.is_empty() {
            no_data(area, s)?;
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

/// RGBA pixels from the same drawing over white and over black: where the two differ by `d`
/// the drawing covers `1 - d/255` of the pixel, and its colour is the black rendering divided by
/// that coverage (compositing `c·a + bg·(1-a)` solved for `a` and `c`).
fn unmix_backgrounds(on_white: &[u8], on_black: &[u8]) -> Vec<u8> {
    let mut rgba = Vec::with_capacity(on_white.len() / 3 * 4);
    for (w, b) in on_white.chunks_exact(3).zip(on_black.chunks_exact(3)) {
        let diff = (0..3)
            .map(|i| i32::from(w[i]) - i32::from(b[i]))
            .max()
            .unwrap_or(0);
        let alpha = (255 - diff).clamp(0, 255);
        for &c in b {
            let straight = if alpha == 0 {
                0
            } else {
                i32::from(c) * 255 / alpha
            };
            rgba.push(straight.clamp(0, 255) as u8);
        }
        rgba.push(alpha as u8);
    }
    rgba
}

fn encode_png(
    pixels: &[u8],
    width: u32,
    height: u32,
    color: png::ColorType,
) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(color);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(pixels)?;
    writer.finish()?;
    Ok(out)
}

fn draw_error<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> PlotError {
    PlotError::Draw(e.to_string())
}

fn no_data<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, s: Scale) -> DrawResult<DB> {
    let (w, h) = area.dim_in_pixel();
    let style = s
        .font(18.0)
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
/// with a band of ± `<metric>_std` where that was logged too, kept within the values' own
/// `<metric>_min` and `<metric>_max` where those were logged (rewards in [0, 1] with a std of
/// 0.45 must not draw a band down to -0.2).
fn metric_lines(history: &[HistoryEntry], metric: &str) -> Vec<Line> {
    let std_name = format!("{metric}_std");
    let (min_name, max_name) = (format!("{metric}_min"), format!("{metric}_max"));
    splits_with(history, metric)
        .into_iter()
        .map(|split| {
            let mut by_step: std::collections::BTreeMap<u64, (f64, f64, usize)> =
                Default::default();
            let mut bounds: std::collections::BTreeMap<u64, (f64, f64)> = Default::default();
            for entry in history.iter().filter(|e| e.split == split) {
                if let Some(value) = entry.get(metric) {
                    let slot = by_step.entry(entry.step).or_default();
                    slot.0 += value;
                    slot.1 += entry.get(&std_name).unwrap_or(f64::NAN);
                    slot.2 += 1;
                    let bound = bounds
                        .entry(entry.step)
                        .or_insert((f64::INFINITY, f64::NEG_INFINITY));
                    bound.0 = bound
                        .0
                        .min(entry.get(&min_name).unwrap_or(f64::NEG_INFINITY));
                    bound.1 = bound.1.max(entry.get(&max_name).unwrap_or(f64::INFINITY));
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
                    let (lo, hi) = bounds[&s];
                    (s as f64, (mean - std).max(lo), (mean + std).min(hi))
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
        match self
            .to_svg()
            .and_then(|svg| Ok((svg, self.to_transparent_png(PNG_SCALE)?)))
        {
            Ok((svg, png)) => {
                // The PNG has twice the pixels; the front end shows it at the chart's size.
                let size = serde_json::json!({"width": self.width, "height": self.height});
                bundle
                    .with("image/svg+xml", svg)
                    .with("image/png", crate::display::base64(&png))
                    .with_metadata("image/png", size.clone())
                    .with_metadata("image/svg+xml", size)
                    .with("text/plain", format!("<chart: {}>", self.title))
            }
            Err(e) => bundle.with(
                "text/plain",
                format!("the chart `{}` could not be drawn: {e}", self.title),
            ),
        }
    }
}
