//! The line format that carries a display from a cell to the kernel.
//!
//! A cell runs in a child process whose stdout the kernel reads line by line. A display is one line:
//! [`PREFIX`] followed by a JSON [`DisplayMessage`] (JSON escapes newlines, so it stays one line).
//! The kernel turns it into Jupyter's `display_data` (or `update_display_data` when `update` is
//! set); every other line is ordinary stdout. One line per display also means that displays
//! written from several threads never interleave.

use serde::{Deserialize, Serialize};

/// Starts a display line.
pub const PREFIX: &str = "ART_KERNEL_DISPLAY_V1 ";

/// Set (to "1") in the environment of the process that runs cells when the ART kernel is the one
/// reading its stdout; without it, displays print a plain-text fallback instead.
pub const KERNEL_ENV: &str = "ART_KERNEL_DISPLAY";

/// evcxr carries a cell's result as one text per mime type, with no room for Jupyter's per-type
/// metadata (an image's display size, say). The result's metadata travels as this pseudo mime
/// type, as JSON; the kernel moves it into the result's metadata.
pub const RESULT_METADATA_MIME: &str = "application/vnd.art.result-metadata+json";

/// One display, as the cell sends it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisplayMessage {
    /// Mime type -> content: text for text types, base64 for images, JSON for `application/json`.
    pub data: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// Names an output that later messages with the same id replace in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_id: Option<String>,
    /// Replace the output named by `display_id` instead of adding a new one.
    #[serde(default)]
    pub update: bool,
}

impl DisplayMessage {
    /// The message as one line, without the trailing newline.
    pub fn to_line(&self) -> String {
        let json = serde_json::to_string(self).expect("a display message always serializes");
        format!("{PREFIX}{json}")
    }

    /// Reads a display line; `None` for any other line (ordinary output).
    pub fn parse_line(line: &str) -> Option<DisplayMessage> {
        let json = line.strip_prefix(PREFIX)?;
        serde_json::from_str(json.trim_end()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_one_line() {
        let mut data = serde_json::Map::new();
        data.insert("text/html".into(), "<p>a\nb</p>".into());
        data.insert("text/plain".into(), "a\nb".into());
        let message = DisplayMessage {
            data,
            metadata: Default::default(),
            display_id: Some("d1".into()),
            update: true,
        };
        let line = message.to_line();
        assert!(!line.contains('\n'));
        assert!(line.starts_with(PREFIX));
        assert_eq!(DisplayMessage::parse_line(&line), Some(message));
        assert_eq!(DisplayMessage::parse_line("hello"), None);
        assert_eq!(
            DisplayMessage::parse_line(&format!("{PREFIX}not json")),
            None
        );
    }
}
