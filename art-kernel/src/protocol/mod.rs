//! The Jupyter side of the kernel: sockets, signing, and the message flow of the messaging
//! protocol (v5.3). It runs any [`Engine`]; it knows nothing of how code is compiled or run.

mod server;
mod wire;

pub use server::serve;

use std::sync::Arc;

/// A mime bundle: mime type -> content (text, base64, or JSON for JSON types).
pub type Bundle = serde_json::Map<String, serde_json::Value>;

/// Output produced while code runs, in the order it happened.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Stdout(String),
    Stderr(String),
    /// A rich output; with `update`, it replaces the earlier output of the same `display_id`.
    Display {
        data: Bundle,
        metadata: Bundle,
        display_id: Option<String>,
        update: bool,
    },
}

/// The value of a cell: its data by mime type, and Jupyter's metadata for them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CellResult {
    pub data: Bundle,
    pub metadata: Bundle,
}

/// Where an engine sends output. It may be called from any thread, during or between executions.
pub type OutputSink = Arc<dyn Fn(Output) + Send + Sync>;

/// Why an execution failed, in the shape of Jupyter's error output.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorReport {
    pub ename: String,
    pub evalue: String,
    /// Lines shown to the user (ANSI colours allowed).
    pub traceback: Vec<String>,
}

/// Completion candidates replacing the bytes `start..end` of the code.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Completions {
    pub matches: Vec<String>,
    pub start: usize,
    pub end: usize,
}

/// Whether a cell is ready to run (for consoles that decide when Enter submits).
#[derive(Debug, Clone, PartialEq)]
pub enum Completeness {
    Complete,
    Incomplete { indent: String },
    Invalid,
}

/// The language description sent in `kernel_info_reply`.
#[derive(Debug, Clone)]
pub struct LanguageDescription {
    pub implementation: String,
    pub implementation_version: String,
    pub name: String,
    pub version: String,
    pub mimetype: String,
    pub file_extension: String,
    pub pygments_lexer: String,
    pub codemirror_mode: String,
    pub banner: String,
    pub help_links: Vec<(String, String)>,
}

/// A language back end. Calls come one at a time from a blocking thread, except
/// [`Interrupter::interrupt`], which may come from any thread while `execute` runs.
pub trait Engine: Send + 'static {
    /// Runs a cell. Output goes to the engine's [`OutputSink`] and must all have been handed to it
    /// by the time this returns; the value of the cell, if any, is returned.
    fn execute(&mut self, code: &str) -> Result<Option<CellResult>, ErrorReport>;

    /// Completions at byte offset `cursor` of `code`.
    fn complete(&mut self, code: &str, cursor: usize) -> anyhow::Result<Completions>;

    /// Documentation for what is at byte offset `cursor`, if any.
    fn inspect(&mut self, _code: &str, _cursor: usize) -> Option<Bundle> {
        None
    }

    /// A handle that stops the running execution.
    fn interrupter(&self) -> Arc<dyn Interrupter>;
}

/// Stops a running execution from another thread.
pub trait Interrupter: Send + Sync {
    /// `from_signal`: the kernel received SIGINT (its process group already has).
    fn interrupt(&self, from_signal: bool);

    /// Ends whatever runs code (the kernel is exiting).
    fn shutdown(&self);
}

/// A cell is incomplete while a bracket or a string is open (good enough for Rust consoles).
pub fn bracket_completeness(code: &str) -> Completeness {
    let mut depth: Vec<char> = Vec::new();
    let mut chars = code.chars().peekable();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if in_string {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            '(' | '[' | '{' => depth.push(c),
            ')' | ']' | '}' => {
                let open = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                if depth.pop() != Some(open) {
                    return Completeness::Invalid;
                }
            }
            _ => {}
        }
    }
    if in_string || !depth.is_empty() {
        Completeness::Incomplete {
            indent: "    ".repeat(depth.len().max(1)),
        }
    } else {
        Completeness::Complete
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completeness_follows_brackets_and_strings() {
        assert_eq!(bracket_completeness("1 + 1"), Completeness::Complete);
        assert_eq!(
            bracket_completeness("fn f() {\n"),
            Completeness::Incomplete {
                indent: "    ".into()
            }
        );
        assert_eq!(
            bracket_completeness("let s = \"{\";"),
            Completeness::Complete
        );
        assert_eq!(bracket_completeness("// {\n1"), Completeness::Complete);
        assert_eq!(bracket_completeness("())"), Completeness::Invalid);
    }
}
