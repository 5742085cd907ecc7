//! The rich view of a polars DataFrame: an HTML table that reads well in notebooks (column types
//! under the names, numbers right-aligned, long text and tall frames cut).

use std::fmt::Write;

use polars_core::prelude::{AnyValue, DataFrame};

use super::html::{escape_html, format_number, styled};
use super::{MimeBundle, Render};

/// Frames taller than this show their first and last rows around an ellipsis row (as polars'
/// own printout does), so a 10,000-row frame does not freeze the front end.
const MAX_ROWS: usize = 40;
/// Rows shown from the end of a frame that is cut.
const TAIL_ROWS: usize = 5;
/// Text cells longer than this are cut (a rollout's whole answer belongs in its transcript).
const MAX_CELL_CHARS: usize = 160;
/// A text column with a shown cell longer than this is "long text": it gets a wide, wrapping
/// column (shorter ones, like a split's name, take only the width they need).
const LONG_TEXT_CHARS: usize = 40;
/// Tables with more shown rows than this repeat their header row below the last row.
const FOOTER_ROWS: usize = 12;

impl Render for DataFrame {
    fn render(&self) -> MimeBundle {
        MimeBundle::new()
            .with("text/html", frame_html(self))
            .with("text/plain", self.to_string())
    }
}

fn frame_html(frame: &DataFrame) -> String {
    let (height, width) = frame.shape();
    let mut html = format!(
        r#"<div class="art-root"><div class="art-chip">{height} rows &times; {width} columns</div><div class="art-table-wrap"><table class="art-table"><thead><tr>"#
    );
    let rows = shown_rows(height);
    let long: Vec<bool> = frame
        .columns()
        .iter()
        .map(|column| {
            rows.iter().flatten().any(|&row| {
                column.get(row).is_ok_and(|v| {
                    v.get_str()
                        .is_some_and(|s| s.chars().count() > LONG_TEXT_CHARS)
                })
            })
        })
        .collect();
    let header = header_cells(frame);
    html.push_str(&header);
    html.push_str("</tr></thead><tbody>");
    for row in rows.iter().copied() {
        let Some(row) = row else {
            let _ = write!(
                html,
                r#"<tr><td class="art-td art-null" colspan="{width}">&hellip;</td></tr>"#
            );
            continue;
        };
        html.push_str("<tr>");
        for (column, &long) in frame.columns().iter().zip(&long) {
            let cell = column
                .get(row)
                .map(|v| cell_html(&v, long))
                .unwrap_or_default();
            html.push_str(&cell);
        }
        html.push_str("</tr>");
    }
    html.push_str("</tbody>");
    if rows.len() > FOOTER_ROWS {
        let _ = write!(html, "<tfoot><tr>{header}</tr></tfoot>");
    }
    html.push_str("</table></div></div>");
    styled(&html)
}

/// The header cells: each column's name (breakable after `_` and `/`, so that a long name like
/// `metric/independent_reward` wraps instead of widening its column) over its type.
fn header_cells(frame: &DataFrame) -> String {
    let mut html = String::new();
    for column in frame.columns() {
        // Numbers are right-aligned, and so are their headers.
        let align = if column.dtype().is_primitive_numeric() {
            " art-num"
        } else {
            ""
        };
        let _ = write!(
            html,
            r#"<th class="art-th{align}">{}<div class="art-dtype">{}</div></th>"#,
            breakable(column.name()),
            escape_html(&column.dtype().to_string())
        );
    }
    html
}

/// Escaped `name` with a `<wbr>` (a line break opportunity) after each `_` and `/`.
fn breakable(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        out.push_str(&escape_html(c.encode_utf8(&mut [0; 4])));
        if matches!(c, '_' | '/') {
            out.push_str("<wbr>");
        }
    }
    out
}

/// The row indices to show; `None` marks the cut.
fn shown_rows(height: usize) -> Vec<Option<usize>> {
    if height <= MAX_ROWS {
        return (0..height).map(Some).collect();
    }
    let head = MAX_ROWS - TAIL_ROWS;
    (0..head)
        .map(Some)
        .chain([None])
        .chain((height - TAIL_ROWS..height).map(Some))
        .collect()
}

fn cell_html(value: &AnyValue, long: bool) -> String {
    let text_class = if long { "art-str art-long" } else { "art-str" };
    let (class, text) = match value {
        AnyValue::Null => ("art-null", "null".to_string()),
        AnyValue::String(s) => (text_class, cut(s)),
        AnyValue::StringOwned(s) => (text_class, cut(s)),
        AnyValue::Float32(x) => ("art-num", format_number(f64::from(*x))),
        AnyValue::Float64(x) => ("art-num", format_number(*x)),
        AnyValue::Boolean(b) => ("", b.to_string()),
        other if other.is_primitive_numeric() => ("art-num", other.to_string()),
        other => ("", cut(&other.to_string())),
    };
    format!(r#"<td class="art-td {class}">{}</td>"#, escape_html(&text))
}

fn cut(text: &str) -> String {
    match text.char_indices().nth(MAX_CELL_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use polars_core::prelude::*;

    #[test]
    fn frames_render_as_tables_with_types_and_escaped_text() {
        let frame = df!(
            "reward" => [0.5f64, 1.0],
            "answer" => ["<b>7</b>", "x".repeat(400).as_str()],
            "ok" => [true, false],
        )
        .unwrap();
        let bundle = frame.render();
        let html = bundle.get("text/html").unwrap().as_str().unwrap();
        assert!(html.contains("2 rows &times; 3 columns"), "{html}");
        assert!(
            html.contains(r#"<th class="art-th art-num" style="#) && html.contains(">reward<div")
        );
        assert!(
            html.contains(r#"<th class="art-th" style="#),
            "text columns' headers stay left"
        );
        assert!(html.contains("&lt;b&gt;7&lt;/b&gt;") && !html.contains("<b>7</b>"));
        assert!(html.contains(&format!("{}…", "x".repeat(MAX_CELL_CHARS))));
        assert!(!html.contains(&"x".repeat(MAX_CELL_CHARS + 1)));
        assert!(
            html.contains(r#"<td class="art-td art-num" style="#) && html.contains(">0.5</td>")
        );
        assert!(bundle.text().contains("reward"));
    }

    #[test]
    fn long_text_columns_get_room_and_long_names_wrap() {
        let frame = df!(
            "metric/independent_reward" => [0.5f64, 1.0],
            "split" => ["train", "val"],
            "last_assistant" => ["short", "a much longer answer that goes on past forty characters"],
        )
        .unwrap();
        let html = frame_html(&frame);
        assert!(
            html.contains("metric/<wbr>independent_<wbr>reward<div"),
            "{html}"
        );
        // Every cell of the long column is marked long, none of the short one.
        assert_eq!(
            html.matches(r#"class="art-td art-str art-long""#).count(),
            2
        );
        assert_eq!(html.matches(r#"class="art-td art-str""#).count(), 2);
        // Two rows: no repeated header.
        assert!(!html.contains("<tfoot>"));
    }

    #[test]
    fn tall_tables_repeat_their_header_below() {
        let values: Vec<i64> = (0..30).collect();
        let frame = df!("step" => values).unwrap();
        let html = frame_html(&frame);
        let footer = &html[html.find("<tfoot>").expect("a footer")..];
        assert!(footer.contains(">step<div"), "{footer}");
    }

    #[test]
    fn tall_frames_are_cut_in_the_middle() {
        let rows = shown_rows(1000);
        assert_eq!(rows.len(), MAX_ROWS + 1);
        assert_eq!(rows[MAX_ROWS - TAIL_ROWS], None);
        assert_eq!(rows.last(), Some(&Some(999)));
        assert_eq!(shown_rows(3), vec![Some(0), Some(1), Some(2)]);
    }
}
