//! Charts: PNGs decoded and inspected pixel by pixel, SVGs checked for their structure.

#![cfg(feature = "plots")]

mod common;

use std::collections::HashSet;

use art_core::plots::{
    metric_chart, reward_chart, reward_distribution_chart, training_chart, Chart, Line,
};
use art_core::HistoryEntry;
use common::groups;

const TRAIN_BLUE: [u8; 3] = [31, 119, 180];
const VAL_ORANGE: [u8; 3] = [255, 127, 14];

fn entry(step: u64, split: &str, metrics: &[(&str, f64)]) -> HistoryEntry {
    let mut e = HistoryEntry::new(step, split);
    for (k, v) in metrics {
        e.metrics.insert(k.to_string(), *v);
    }
    e
}

/// Ten training steps with rising reward, validation every other step, losses falling.
fn history() -> Vec<HistoryEntry> {
    let mut out = Vec::new();
    for step in 0..10u64 {
        let s = step as f64;
        out.push(entry(
            step,
            "train",
            &[
                ("reward", 0.2 + 0.06 * s),
                ("reward_std", 0.15 - 0.005 * s),
                ("loss", 1.0 / (1.0 + s)),
                ("grad_norm", 2.0 + (s * 0.7).sin()),
            ],
        ));
        if step % 2 == 0 {
            out.push(entry(
                step,
                "val",
                &[("reward", 0.15 + 0.05 * s), ("reward_std", 0.1)],
            ));
        }
    }
    out
}

struct Pixels {
    width: u32,
    height: u32,
    rgb: Vec<[u8; 3]>,
}

fn decode(bytes: &[u8]) -> Pixels {
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().expect("a valid PNG");
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    // `to_png` is for files: opaque, on white.
    assert_eq!(info.color_type, png::ColorType::Rgb);
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    Pixels {
        width: info.width,
        height: info.height,
        rgb: buf[..info.buffer_size()]
            .chunks_exact(3)
            .map(|p| [p[0], p[1], p[2]])
            .collect(),
    }
}

impl Pixels {
    fn distinct_colours(&self) -> usize {
        self.rgb.iter().collect::<HashSet<_>>().len()
    }

    fn non_white_fraction(&self) -> f64 {
        let n = self.rgb.iter().filter(|p| **p != [255, 255, 255]).count();
        n as f64 / self.rgb.len() as f64
    }

    fn count(&self, colour: [u8; 3]) -> usize {
        self.rgb.iter().filter(|p| **p == colour).count()
    }

    /// Pixels that are mostly `colour`, antialiased or blended onto white.
    fn near(&self, colour: [u8; 3], tolerance: i32) -> usize {
        self.rgb
            .iter()
            .filter(|p| (0..3).all(|i| (p[i] as i32 - colour[i] as i32).abs() <= tolerance))
            .count()
    }
}

/// Whether the SVG has a `<text>` element with exactly this content (plotters writes
/// `<text ...>\nTEXT\n</text>`).
fn has_text(svg: &str, text: &str) -> bool {
    svg.contains(&format!(">\n{text}\n</text>"))
}

fn save(name: &str, png: &[u8]) {
    // Not `scratch`: tests run in parallel and share this directory.
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plots");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), png).unwrap();
}

#[test]
fn reward_chart_png_has_both_series_bands_and_text() {
    let chart = reward_chart(&history());
    assert_eq!(chart.series().len(), 2);
    assert_eq!(chart.series()[0].name, "train");
    assert_eq!(chart.series()[1].name, "val");
    assert_eq!(chart.series()[1].points.len(), 5);
    let png = chart.to_png().unwrap();
    save("reward.png", &png);
    let pixels = decode(&png);
    assert_eq!((pixels.width, pixels.height), (720, 400));
    // A light background with a drawing on it, not a blank or a solid image.
    let white = pixels.count([255, 255, 255]) as f64 / pixels.rgb.len() as f64;
    assert!(white > 0.5, "background is not white: {white}");
    assert!(
        pixels.non_white_fraction() > 0.04,
        "{}",
        pixels.non_white_fraction()
    );
    // Lines, bands (blended colours) and antialiased text give many colours.
    assert!(
        pixels.distinct_colours() > 50,
        "{}",
        pixels.distinct_colours()
    );
    assert!(
        pixels.count(TRAIN_BLUE) > 300,
        "train line: {}",
        pixels.count(TRAIN_BLUE)
    );
    assert!(
        pixels.count(VAL_ORANGE) > 200,
        "val line: {}",
        pixels.count(VAL_ORANGE)
    );
    // The ±std band: blue mixed at 18% onto white.
    let band = [
        (255.0 * 0.82 + 31.0 * 0.18) as u8,
        (255.0 * 0.82 + 119.0 * 0.18) as u8,
        (255.0 * 0.82 + 180.0 * 0.18) as u8,
    ];
    assert!(
        pixels.near(band, 3) > 2000,
        "band: {}",
        pixels.near(band, 3)
    );
    // Grey ink: axis labels, title, ticks (readable on a light and a dark theme).
    let ink = pixels.near([128, 128, 128], 10);
    assert!(ink > 500, "text: {ink}");
}

#[test]
fn notebook_png_is_transparent_and_twice_the_size() {
    let chart = reward_chart(&history());
    let png = chart.to_transparent_png(2).unwrap();
    save("reward-transparent.png", &png);
    let decoder = png::Decoder::new(std::io::Cursor::new(&png));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgba);
    assert_eq!((info.width, info.height), (1440, 800));
    let rgba: Vec<[u8; 4]> = buf[..info.buffer_size()]
        .chunks_exact(4)
        .map(|p| [p[0], p[1], p[2], p[3]])
        .collect();
    // No background: the corner and most pixels are fully transparent...
    assert_eq!(rgba[0][3], 0);
    let clear = rgba.iter().filter(|p| p[3] == 0).count() as f64 / rgba.len() as f64;
    assert!(clear > 0.5, "transparent fraction {clear}");
    // ...and the lines keep their colour, opaque.
    let blue = rgba
        .iter()
        .filter(|p| p[3] == 255 && p[..3] == TRAIN_BLUE)
        .count();
    assert!(blue > 1000, "opaque train blue: {blue}");
    // The band is translucent blue, not blue mixed with white.
    let band = rgba
        .iter()
        .filter(|p| (30..60).contains(&p[3]) && (p[2] as i32 - 180).abs() < 12)
        .count();
    assert!(band > 4000, "band pixels: {band}");
}

#[test]
fn bands_stay_within_the_logged_range_and_sparse_ones_are_error_bars() {
    // Rewards in [0, 1] with a std reaching past both ends; val logged before and after only.
    let history = vec![
        entry(
            1,
            "train",
            &[
                ("reward", 0.1),
                ("reward_std", 0.3),
                ("reward_min", 0.0),
                ("reward_max", 1.0),
            ],
        ),
        entry(
            2,
            "train",
            &[
                ("reward", 0.5),
                ("reward_std", 0.45),
                ("reward_min", 0.0),
                ("reward_max", 1.0),
            ],
        ),
        entry(
            3,
            "train",
            &[
                ("reward", 0.9),
                ("reward_std", 0.3),
                ("reward_min", 0.0),
                ("reward_max", 1.0),
            ],
        ),
        entry(
            0,
            "val",
            &[
                ("reward", 0.2),
                ("reward_std", 0.4),
                ("reward_min", 0.0),
                ("reward_max", 0.8),
            ],
        ),
        entry(
            3,
            "val",
            &[
                ("reward", 0.6),
                ("reward_std", 0.1),
                ("reward_min", 0.2),
                ("reward_max", 1.0),
            ],
        ),
    ];
    let chart = reward_chart(&history);
    let train = chart.series()[0].band.clone().unwrap();
    assert_eq!(
        train,
        vec![
            (1.0, 0.0, 0.1 + 0.3),
            (2.0, 0.5 - 0.45, 0.5 + 0.45),
            (3.0, 0.9 - 0.3, 1.0)
        ]
    );
    let val = chart.series()[1].band.clone().unwrap();
    assert_eq!(val[0], (0.0, 0.0, 0.2 + 0.4));
    let svg = chart.to_svg().unwrap();
    // One filled band (train, three points) and none for val's two: error bars instead.
    assert_eq!(svg.lines().filter(|l| l.contains("<polygon")).count(), 1);
    for text in ["train ± std", "val ± std"] {
        assert!(has_text(&svg, text), "legend misses {text}");
    }
}

#[test]
fn reward_chart_svg_structure() {
    let svg = reward_chart(&history()).to_svg().unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
    assert!(svg.contains(r#"width="720""#) && svg.contains(r#"height="400""#));
    for text in ["Reward per step", "step", "reward", "train", "val"] {
        assert!(has_text(&svg, text), "missing {text}");
    }
    // One line per series plus one legend sample each, in the series colours.
    let polylines = |colour: &str| {
        svg.lines()
            .filter(|l| l.contains("<polyline") && l.contains(colour))
            .count()
    };
    assert_eq!(polylines("#1F77B4"), 2, "train lines");
    assert_eq!(polylines("#FF7F0E"), 2, "val lines");
    // One band per series.
    let bands = svg.lines().filter(|l| l.contains("<polygon")).count();
    assert_eq!(bands, 2);
    // Markers: 10 train steps, 5 val steps.
    let circles = |colour: &str| {
        svg.lines()
            .filter(|l| l.contains("<circle") && l.contains(colour))
            .count()
    };
    assert_eq!(circles("#1F77B4"), 10);
    assert_eq!(circles("#FF7F0E"), 5);
}

#[test]
fn training_chart_has_loss_and_grad_norm_panels() {
    let chart = training_chart(&history());
    let svg = chart.to_svg().unwrap();
    for text in ["Training", "loss", "gradient norm", "grad_norm"] {
        assert!(has_text(&svg, text), "missing {text}");
    }
    let train_lines = svg
        .lines()
        .filter(|l| l.contains("<polyline") && l.contains("#1F77B4"))
        .count();
    assert_eq!(
        train_lines, 2,
        "one line per panel, no legend for a single series"
    );
    assert!(!has_text(&svg, "train"));
    let png = chart.to_png().unwrap();
    save("training.png", &png);
    let pixels = decode(&png);
    assert!(pixels.count(TRAIN_BLUE) > 300);
}

#[test]
fn reward_distribution_shows_every_trajectory_and_group_means() {
    let chart = reward_distribution_chart(&groups());
    let svg = chart.to_svg().unwrap();
    for text in [
        "Rewards by group",
        "group (dots: trajectories, bars: group mean)",
        "reward",
    ] {
        assert!(has_text(&svg, text), "missing {text}");
    }
    // 4 trajectories and 2 means; no legend box (it covered points).
    assert_eq!(svg.matches("<circle").count(), 4);
    let means = svg
        .lines()
        .filter(|l| l.contains("<polyline") && l.contains("#D62728"))
        .count();
    assert_eq!(means, 2);
    let png = chart.to_png().unwrap();
    save("distribution.png", &png);
    assert!(decode(&png).distinct_colours() > 20);
}

#[test]
fn any_metric_by_name_and_custom_sizes() {
    let chart = metric_chart(&history(), "grad_norm").with_size(480, 300);
    assert_eq!(chart.series().len(), 1);
    let pixels = decode(&chart.to_png().unwrap());
    assert_eq!((pixels.width, pixels.height), (480, 300));
    assert!(has_text(&chart.to_svg().unwrap(), "grad_norm per step"));

    // Nothing logged: still a chart, saying so.
    let empty = metric_chart(&[], "reward");
    assert!(empty.to_svg().unwrap().contains("nothing logged yet"));
    assert!(decode(&empty.to_png().unwrap()).non_white_fraction() > 0.005);

    // A single step and a hand-made series render too.
    let one = Chart::lines(
        "one",
        "x",
        "y",
        vec![Line {
            name: "only".into(),
            points: vec![(3.0, 0.5)],
            band: None,
        }],
    );
    assert_eq!(one.to_svg().unwrap().matches("<circle").count(), 1);
}
