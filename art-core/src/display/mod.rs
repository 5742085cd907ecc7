//! Rich output in notebooks: HTML, SVG and PNG from a cell, live displays that update in place, and
//! rich views of trajectories and groups.
//!
//! In the ART kernel (`art-kernel`) every function here becomes a Jupyter output: a cell may show
//! several, and a [`Display`] handle replaces its own output each time it is updated (progress,
//! a chart that grows). Anywhere else (a plain program, a test) the same calls print a short
//! plain-text fallback to stdout, so notebook code also runs as a script.
//!
//! ```no_run
//! use art_core::display::{self, Display};
//! display::html("<b>bold</b>");
//! display::svg(r#"<svg xmlns="http://www.w3.org/2000/svg" width="20" height="20"><circle cx="10" cy="10" r="8"/></svg>"#);
//! let live = Display::new();
//! for step in 0..=10 {
//!     live.update(display::Html(format!("step {step}/10")));
//! }
//! ```
//!
//! Types with a rich view implement [`Render`]: trajectories and groups (transcripts), polars
//! DataFrames (tables), [`Chart`](crate::Chart)s (SVG), and the wrappers below. [`show`] displays
//! any of them, and the last expression of a cell shows richly through evcxr's `evcxr_display`
//! convention, which [`RichDisplay`] provides for every `Render` type.

mod html;
mod progress;
#[cfg(feature = "frames")]
mod table;
mod tensorboard;
mod training;
pub mod wire;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

pub use html::{escape_html, STYLE};
pub use progress::{GatherProgress, GatherProgressView};
pub use tensorboard::{tensorboard, tensorboard_with, TensorBoard, TensorBoardError};
pub use training::TrainingView;
use wire::DisplayMessage;

/// A mime bundle: the same content in one or more formats; the front end picks the richest it can
/// show. Text formats hold text, images hold base64, `application/json` holds JSON.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MimeBundle {
    pub data: BTreeMap<String, Value>,
    pub metadata: BTreeMap<String, Value>,
}

impl MimeBundle {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) one format.
    pub fn with(mut self, mime: impl Into<String>, content: impl Into<Value>) -> Self {
        self.data.insert(mime.into(), content.into());
        self
    }

    /// Adds metadata for one format (for example `{"width": 400}` for an image).
    pub fn with_metadata(mut self, mime: impl Into<String>, metadata: Value) -> Self {
        self.metadata.insert(mime.into(), metadata);
        self
    }

    pub fn get(&self, mime: &str) -> Option<&Value> {
        self.data.get(mime)
    }

    /// The plain-text form (what a terminal shows).
    pub fn text(&self) -> String {
        match self.data.get("text/plain") {
            Some(Value::String(text)) => text.clone(),
            Some(other) => other.to_string(),
            None => {
                let kinds: Vec<&str> = self.data.keys().map(String::as_str).collect();
                format!("<{}>", kinds.join(", "))
            }
        }
    }

    fn message(&self, display_id: Option<&str>, update: bool) -> DisplayMessage {
        DisplayMessage {
            data: self.data.clone().into_iter().collect(),
            metadata: self.metadata.clone().into_iter().collect(),
            display_id: display_id.map(str::to_string),
            update,
        }
    }
}

/// Something with a rich view.
pub trait Render {
    fn render(&self) -> MimeBundle;
}

// References and boxes show what they point to: a result like `groups.first().unwrap()` must find
// `RichDisplay` before `DebugDisplay`, which method lookup would reach first on the reference.
impl<T: Render + ?Sized> Render for &T {
    fn render(&self) -> MimeBundle {
        (**self).render()
    }
}

impl<T: Render + ?Sized> Render for &mut T {
    fn render(&self) -> MimeBundle {
        (**self).render()
    }
}

impl<T: Render + ?Sized> Render for Box<T> {
    fn render(&self) -> MimeBundle {
        (**self).render()
    }
}

impl<T: Render + ?Sized> Render for std::sync::Arc<T> {
    fn render(&self) -> MimeBundle {
        (**self).render()
    }
}

impl Render for MimeBundle {
    fn render(&self) -> MimeBundle {
        self.clone()
    }
}

/// HTML, shown as is (with a plain-text fallback of its tags stripped).
#[derive(Debug, Clone, PartialEq)]
pub struct Html(pub String);

/// An SVG image (the document text).
#[derive(Debug, Clone, PartialEq)]
pub struct Svg(pub String);

/// A PNG image (the file's bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct Png(pub Vec<u8>);

/// Markdown, rendered by the front end.
#[derive(Debug, Clone, PartialEq)]
pub struct Markdown(pub String);

impl Render for Html {
    fn render(&self) -> MimeBundle {
        MimeBundle::new()
            .with("text/html", self.0.clone())
            .with("text/plain", html::strip_tags(&self.0))
    }
}

impl Render for Svg {
    fn render(&self) -> MimeBundle {
        MimeBundle::new()
            .with("image/svg+xml", self.0.clone())
            .with("text/plain", "<svg image>")
    }
}

impl Render for Png {
    fn render(&self) -> MimeBundle {
        MimeBundle::new()
            .with("image/png", base64(&self.0))
            .with("text/plain", format!("<png image, {} bytes>", self.0.len()))
    }
}

impl Render for Markdown {
    fn render(&self) -> MimeBundle {
        MimeBundle::new()
            .with("text/markdown", self.0.clone())
            .with("text/plain", self.0.clone())
    }
}

/// True when this process runs cells for the ART kernel (so displays become notebook outputs).
pub fn in_kernel() -> bool {
    std::env::var_os(wire::KERNEL_ENV).is_some_and(|v| v == "1")
}

/// Shows anything with a rich view as a new output of the running cell.
pub fn show(item: impl Render) {
    emit(&item.render(), None, false);
}

/// Shows HTML.
pub fn html(html: impl Into<String>) {
    show(Html(html.into()));
}

/// Shows an SVG image.
pub fn svg(svg: impl Into<String>) {
    show(Svg(svg.into()));
}

/// Shows a PNG image given the bytes of the file.
pub fn png(bytes: impl Into<Vec<u8>>) {
    show(Png(bytes.into()));
}

/// Shows markdown.
pub fn markdown(text: impl Into<String>) {
    show(Markdown(text.into()));
}

/// An output that can be replaced in place: create it, then call [`Display::update`] as often as
/// needed. The first update shows it; each later one replaces what it shows.
#[derive(Debug)]
pub struct Display {
    id: String,
    shown: std::sync::atomic::AtomicBool,
}

impl Default for Display {
    fn default() -> Self {
        Self::new()
    }
}

impl Display {
    /// A new, not yet shown, live output.
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        Display {
            id: format!("art-{}-{nanos:x}-{n}", std::process::id()),
            shown: Default::default(),
        }
    }

    /// Shows `item` now, in a new output, and makes this handle point at it.
    pub fn show(&self, item: impl Render) -> &Self {
        emit(&item.render(), Some(&self.id), false);
        self.shown.store(true, Ordering::Relaxed);
        self
    }

    /// Replaces the content of this output (showing it first if it is not shown yet).
    pub fn update(&self, item: impl Render) -> &Self {
        let update = self.shown.swap(true, Ordering::Relaxed);
        emit(&item.render(), Some(&self.id), update);
        self
    }

    /// The Jupyter display id.
    pub fn id(&self) -> &str {
        &self.id
    }
}

fn emit(bundle: &MimeBundle, display_id: Option<&str>, update: bool) {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    // Output errors are ignored: a display that cannot be written must not fail the cell.
    let _ = if in_kernel() {
        writeln!(out, "{}", bundle.message(display_id, update).to_line())
    } else {
        // A terminal cannot replace earlier output: an update prints the new state.
        writeln!(out, "{}", bundle.text())
    };
    let _ = out.flush();
}

/// Prints `bundle` in evcxr's own format, which makes it the result of the cell. Types call this
/// from their `evcxr_display` method.
pub fn evcxr_display(bundle: &MimeBundle) {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let metadata = (!bundle.metadata.is_empty() && std::env::var_os(wire::KERNEL_ENV).is_some())
        .then(|| {
            let metadata: serde_json::Map<String, Value> =
                bundle.metadata.clone().into_iter().collect();
            (
                wire::RESULT_METADATA_MIME.to_string(),
                Value::Object(metadata),
            )
        });
    for (mime, value) in bundle
        .data
        .iter()
        .map(|(m, v)| (m.clone(), v.clone()))
        .chain(metadata)
    {
        let text = match value {
            Value::String(text) => text,
            other => other.to_string(),
        };
        let _ = writeln!(out, "EVCXR_BEGIN_CONTENT {mime}\n{text}\nEVCXR_END_CONTENT");
    }
    let _ = out.flush();
}

/// Standard base64 (with padding), as Jupyter wants images.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// evcxr's convention for the last expression of a cell: when it has an `evcxr_display` method,
/// the kernel calls it. Every [`Render`] type gets one through this trait (the ART kernel's
/// prelude imports it), foreign ones like polars' `DataFrame` included.
pub trait RichDisplay {
    /// Shows the value richly as the result of a notebook cell.
    fn evcxr_display(&self);
}

impl<T: Render + ?Sized> RichDisplay for T {
    fn evcxr_display(&self) {
        evcxr_display(&self.render());
    }
}

/// The plain `Debug` text of any other cell result, as evcxr's own fallback prints it (`{:?}`).
/// Without it evcxr compiles such a cell twice: first with `.evcxr_display()`, which fails, then
/// with its fallback (~0.6 s more for `1 + 1`). The `&mut self` receiver is what keeps
/// [`RichDisplay`] first: method lookup tries `&value` before `&mut value`. A bare variable not
/// declared `mut` cannot be borrowed mutably, so that one still goes through evcxr's fallback,
/// which prints the same text.
pub trait DebugDisplay {
    /// Shows the value's `Debug` text as the result of a notebook cell.
    fn evcxr_display(&mut self);
}

impl<T: std::fmt::Debug + ?Sized> DebugDisplay for T {
    fn evcxr_display(&mut self) {
        // Generic code is compiled in every cell that uses it: keep this body to one call of a
        // function compiled once, in art-core (a plain result cell compiles ~0.1 s faster).
        show_debug(&self, std::any::type_name::<T>() == "()");
    }
}

/// Shows a value's `Debug` text as the cell's result; nothing for `()`, the value of a cell that
/// ends in a block or a loop (`for ... { println!(...) }`), which has nothing to show.
fn show_debug(value: &dyn std::fmt::Debug, is_unit: bool) {
    if let Some(bundle) = debug_bundle(value, is_unit) {
        evcxr_display(&bundle);
    }
}

fn debug_bundle(value: &dyn std::fmt::Debug, is_unit: bool) -> Option<MimeBundle> {
    (!is_unit).then(|| MimeBundle::new().with("text/plain", format!("{value:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (input, expected) in cases {
            assert_eq!(base64(input.as_bytes()), expected, "{input}");
        }
        assert_eq!(base64(&[0xff, 0xfe, 0x00]), "//4A");
    }

    #[test]
    fn bundles_carry_their_formats() {
        let png = Png(vec![0x89, b'P', b'N', b'G']).render();
        assert_eq!(png.get("image/png"), Some(&Value::from("iVBORw==")));
        let html = Html("<b>bold</b> &amp; plain".into()).render();
        assert_eq!(html.text(), "bold & plain");
        let message = html.message(Some("x"), true);
        assert_eq!(message.display_id.as_deref(), Some("x"));
        assert!(message.update);
        assert!(message.data.contains_key("text/html"));
    }

    #[test]
    fn a_unit_result_shows_nothing() {
        fn shown<T: std::fmt::Debug>(value: T) -> Option<String> {
            debug_bundle(&value, std::any::type_name::<T>() == "()").map(|b| b.text())
        }
        assert_eq!(shown(()), None);
        assert_eq!(shown("()"), Some(r#""()""#.to_string()));
        assert_eq!(shown(Some(2)), Some("Some(2)".to_string()));
        assert_eq!(shown(((), 1)), Some("((), 1)".to_string()));
    }

    #[test]
    fn display_ids_are_unique() {
        let a = Display::new();
        let b = Display::new();
        assert_ne!(a.id(), b.id());
    }
}
