//! HTML views of trajectories and groups: a chat transcript with roles, tool calls and results,
//! reward and metric badges; a group as transcripts side by side with the shared beginning shown
//! once and RULER's explanations on top.
//!
//! Colours are translucent tints over whatever background the front end has, text inherits its
//! colour, and borders and fonts come from JupyterLab's CSS variables when present: the same HTML
//! reads well in JupyterLab, VS Code and classic notebooks, light or dark.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use super::{MimeBundle, Render};
use crate::ruler::common_prefix_len;
use crate::types::{
    Content, ContentPart, Message, MessageOrChoice, MetadataValue, MetricValue, Tool, Trajectory,
    TrajectoryGroup,
};

/// The style sheet every view carries (scoped to `.art-root`): what cannot be written inline —
/// theme colours through JupyterLab's CSS variables, flex and grid layout, sticky table headers.
/// Everything else is in [`CLASS_STYLES`].
pub const STYLE: &str = r#"<style>
.art-root{--art-border:var(--jp-border-color2,rgba(127,127,127,.3));--art-muted:var(--jp-content-font-color2,rgba(127,127,127,1));font-family:var(--jp-ui-font-family,system-ui,-apple-system,"Segoe UI",Roboto,sans-serif);color:inherit;max-width:100%}
.art-root *{box-sizing:border-box}
.art-code{font-family:var(--jp-code-font-family,ui-monospace,SFMono-Regular,Menlo,Consolas,monospace)}
.art-head{display:flex;flex-wrap:wrap;align-items:center}
.art-text,.art-call{overflow-wrap:anywhere}
details>summary{cursor:pointer}
.art-col.art-best{box-shadow:inset 0 0 0 1px #16a34a}
.art-root table.art-table thead th{position:sticky;top:0;background:var(--jp-layout-color1,Canvas)}
.art-root table.art-table th,.art-root table.art-table td{border-bottom:1px solid var(--art-border)}
.art-root table.art-table tbody tr:nth-child(even){background:rgba(127,127,127,.05)}
.art-root table.art-table tbody tr:hover{background:rgba(59,130,246,.08)}
</style>"#;

/// Each class's look, also written into the `style` attribute of every element that has the class
/// (see [`styled`]). JupyterLab drops `<style>` elements from untrusted outputs (a notebook opened
/// from a clone is untrusted) but keeps inline styles that pass its sanitizer: so only plain
/// values here — no `var()`, `hsl()`, `minmax()` or `overflow-wrap:anywhere`, colours as hex.
const CLASS_STYLES: &[(&str, &str)] = &[
    ("art-root", "font-size:13px;line-height:1.45;text-align:left"),
    ("art-card", "border:1px solid #7f7f7f4d;border-radius:8px;padding:10px 12px;margin:4px 0"),
    ("art-head", "margin-bottom:6px"),
    ("art-title", "font-weight:600;margin-right:8px"),
    (
        "art-badge",
        "display:inline-block;padding:1px 8px;margin:1px 6px 1px 0;border:1px solid #7f7f7f4d;border-radius:999px;background-color:#7f7f7f14;font-size:12px;white-space:nowrap",
    ),
    ("art-chip", "font-size:12px;margin-right:8px;white-space:nowrap;opacity:0.7"),
    (
        "art-msg",
        "border-left:3px solid #7f7f7f;padding:3px 10px 5px;margin:6px 0;background-color:#7f7f7f0d;border-radius:0 6px 6px 0",
    ),
    ("art-role", "font-size:11px;font-weight:bold;text-transform:uppercase;letter-spacing:0.04em"),
    ("art-tag", "font-weight:normal;text-transform:none;letter-spacing:normal;margin-left:8px;opacity:0.7"),
    ("art-text", "white-space:pre-wrap;overflow-wrap:break-word;max-height:28em;overflow:auto;margin-top:2px"),
    ("art-empty", "font-style:italic;opacity:0.7"),
    ("art-code", "font-family:Menlo,Consolas,DejaVu Sans Mono,monospace;font-size:12px"),
    (
        "art-call",
        "background-color:#7f7f7f1a;border-radius:4px;padding:4px 8px;margin-top:4px;white-space:pre-wrap;overflow-wrap:break-word;max-height:20em;overflow:auto",
    ),
    ("art-fn", "font-weight:bold;color:#d97706"),
    (
        "art-note",
        "font-size:12.5px;border-radius:6px;padding:5px 9px;background-color:#8b5cf61a;border:1px solid #8b5cf640;margin:6px 0",
    ),
    (
        "art-err",
        "font-size:12.5px;border-radius:6px;padding:5px 9px;background-color:#dc262614;border:1px solid #dc26264d;margin:6px 0;white-space:pre-wrap",
    ),
    ("art-more", "margin:4px 0"),
    // Trajectories side by side, as many as fit at 300 px or more each, the rest on the next
    // rows: a group of 8 must not run off the cell sideways. JupyterLab 4.6 keeps this
    // `grid-template-columns` inline in untrusted outputs (its sanitizer checks each property's
    // own grammar: it drops `minmax()` in `grid-auto-columns` but not here; checked in Chromium).
    (
        "art-cols",
        "display:grid;gap:10px;grid-template-columns:repeat(auto-fit,minmax(300px,1fr));padding-bottom:4px",
    ),
    ("art-col", "border:1px solid #7f7f7f4d;border-radius:8px;padding:8px 10px;min-width:0;margin-bottom:8px"),
    ("art-best", "border-color:#16a34a"),
    ("art-bar", "height:6px;border-radius:3px;background-color:#7f7f7f33;overflow:hidden;margin:4px 0"),
    ("art-fill", "display:block;height:6px;border-radius:3px"),
    ("art-progress", "min-width:320px;max-width:640px"),
    ("art-img", "max-width:260px;max-height:200px;border-radius:4px;margin-top:4px"),
    ("art-chart", "margin:4px 12px 0 0"),
    // No inner vertical scroll: header cells cannot stick untrusted (JupyterLab drops an inline
    // `position:sticky`), so a tall table scrolls with the page and repeats its header below.
    ("art-table-wrap", "overflow-x:auto;margin-top:4px"),
    ("art-table", "border-collapse:collapse;font-size:12.5px"),
    ("art-th", "padding:3px 10px;text-align:left;vertical-align:bottom;font-weight:bold"),
    ("art-td", "padding:3px 10px;text-align:left;vertical-align:top"),
    ("art-num", "text-align:right;white-space:nowrap"),
    // Short text (a split, a label) takes the width it needs; long text (an answer, a RULER
    // explanation) gets a readable column that wraps, whatever the header's length.
    ("art-str", "white-space:pre-wrap;overflow-wrap:break-word"),
    ("art-long", "min-width:22em;max-width:40em"),
    ("art-null", "font-style:italic;opacity:0.7"),
    ("art-dtype", "font-weight:normal;font-size:11px;opacity:0.7"),
];

/// A view's HTML ready to display: the style sheet, then `body` with every element's class styles
/// ([`CLASS_STYLES`]) written into its `style` attribute, ahead of any style it already has (so
/// an element's own style wins). `body` is our own markup: attribute values never hold a raw `"`
/// or `>` (text is escaped), so scanning for `class="` is exact.
pub(crate) fn styled(body: &str) -> String {
    let mut out = String::with_capacity(STYLE.len() + body.len() * 2);
    out.push_str(STYLE);
    let mut rest = body;
    while let Some(at) = rest.find(r#" class=""#) {
        let value_start = at + r#" class=""#.len();
        let value_len = rest[value_start..].find('"').unwrap_or(0);
        let value_end = value_start + value_len;
        let declarations: Vec<&str> = rest[value_start..value_end]
            .split_whitespace()
            .filter_map(|class| CLASS_STYLES.iter().find(|(c, _)| *c == class))
            .map(|(_, style)| *style)
            .collect();
        out.push_str(&rest[..value_end + 1]);
        rest = &rest[value_end + 1..];
        if declarations.is_empty() {
            continue;
        }
        let inline = declarations.join(";");
        let tag_end = rest.find('>').unwrap_or(rest.len());
        match rest[..tag_end].find(r#" style=""#) {
            Some(style_at) => {
                let value = style_at + r#" style=""#.len();
                out.push_str(&rest[..value]);
                out.push_str(&inline);
                out.push(';');
                rest = &rest[value..];
            }
            None => {
                let _ = write!(out, r#" style="{inline}""#);
            }
        }
    }
    out.push_str(rest);
    out
}

/// The colour that marks a role's messages.
fn role_colour(role: &str) -> &'static str {
    match role {
        "user" => "#3b82f6",
        "assistant" => "#10b981",
        "system" | "developer" => "#8b5cf6",
        "tool" => "#d97706",
        _ => "#7f7f7f",
    }
}

/// Escapes text for HTML element content and attribute values.
pub fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// The text of some HTML, tags dropped and the common entities decoded (a plain-text fallback).
pub(crate) fn strip_tags(html: &str) -> String {
    let mut out = String::with_capacity(html.len());
    let mut in_tag = false;
    for c in html.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// A hue from red (worst) to green (best) for a reward within `[lo, hi]`; none when there is no
/// spread to compare against.
fn reward_hue(reward: f64, lo: f64, hi: f64) -> Option<f64> {
    (hi > lo && reward.is_finite()).then(|| ((reward - lo) / (hi - lo)).clamp(0.0, 1.0) * 130.0)
}

/// `hsl(hue, 70%, 45%)` with `alpha` (0-255) as `#rrggbbaa`: notebook sanitizers accept hex
/// colours in inline styles but not `hsla()`.
fn hue_colour(hue: f64, alpha: u8) -> String {
    let (s, l) = (0.70, 0.45);
    let chroma = (1.0 - (2.0 * l - 1.0f64).abs()) * s;
    let h = hue.rem_euclid(360.0) / 60.0;
    let x = chroma * (1.0 - (h % 2.0 - 1.0).abs());
    let (r, g, b) = match h as u32 {
        0 => (chroma, x, 0.0),
        1 => (x, chroma, 0.0),
        2 => (0.0, chroma, x),
        3 => (0.0, x, chroma),
        4 => (x, 0.0, chroma),
        _ => (chroma, 0.0, x),
    };
    let m = l - chroma / 2.0;
    let byte = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    format!("#{:02x}{:02x}{:02x}{alpha:02x}", byte(r), byte(g), byte(b))
}

fn reward_badge(label: &str, reward: f64, lo: f64, hi: f64) -> String {
    let style = match reward_hue(reward, lo, hi) {
        Some(h) => format!(
            "background-color:{};border-color:{}",
            hue_colour(h, 0x2e),
            hue_colour(h, 0x8c)
        ),
        None => "background-color:#3b82f624;border-color:#3b82f680".to_string(),
    };
    format!(
        r#"<span class="art-badge" style="{style}">{} <b>{}</b></span>"#,
        escape_html(label),
        format_number(reward)
    )
}

/// A number for people: integers plain, others with 3 significant decimals.
pub(crate) fn format_number(value: f64) -> String {
    // -0 (a loss that rounds to nothing below zero) reads as 0.
    let value = if value == 0.0 { 0.0 } else { value };
    if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.0}")
    } else if value.abs() >= 100.0 {
        format!("{value:.1}")
    } else {
        let text = format!("{value:.3}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn format_metric(value: &MetricValue) -> String {
    match value {
        MetricValue::Bool(true) => "✓".to_string(),
        MetricValue::Bool(false) => "✗".to_string(),
        MetricValue::Int(i) => i.to_string(),
        MetricValue::Float(f) => format_number(*f),
    }
}

fn format_metadata(value: &MetadataValue) -> String {
    match value {
        MetadataValue::Null => "null".to_string(),
        MetadataValue::Bool(b) => b.to_string(),
        MetadataValue::Int(i) => i.to_string(),
        MetadataValue::Float(f) => format_number(*f),
        MetadataValue::Text(t) => t.clone(),
    }
}

fn metric_badges(metrics: &BTreeMap<String, MetricValue>, skip: &[&str]) -> String {
    let mut out = String::new();
    for (name, value) in metrics.iter().filter(|(k, _)| !skip.contains(&k.as_str())) {
        let _ = write!(
            out,
            r#"<span class="art-badge">{} <b>{}</b></span>"#,
            escape_html(name),
            escape_html(&format_metric(value))
        );
    }
    out
}

fn metadata_chips(metadata: &BTreeMap<String, MetadataValue>) -> String {
    let mut out = String::new();
    for (name, value) in metadata {
        let _ = write!(
            out,
            r#"<span class="art-chip">{}=<code>{}</code></span>"#,
            escape_html(name),
            escape_html(&format_metadata(value))
        );
    }
    out
}

const RULER_PREFIX: &str = "RULER explanation: ";

/// The RULER explanation in a trajectory's logs, if it was judged.
fn ruler_explanation(trajectory: &Trajectory) -> Option<&str> {
    trajectory
        .logs
        .iter()
        .rev()
        .find_map(|line| line.strip_prefix(RULER_PREFIX))
}

fn content_html(content: &Content) -> String {
    match content {
        Content::Text(text) => text_block(text),
        Content::Parts(parts) => {
            let mut out = String::new();
            for part in parts {
                match part {
                    ContentPart::Text { text } => out.push_str(&text_block(text)),
                    ContentPart::Refusal { refusal } => {
                        let _ = write!(
                            out,
                            r#"<div class="art-err">refused: {}</div>"#,
                            escape_html(refusal)
                        );
                    }
                    ContentPart::ImageUrl { image_url } => {
                        let _ = write!(
                            out,
                            r#"<img class="art-img" src="{}" alt="image">"#,
                            escape_html(&image_url.url)
                        );
                    }
                    ContentPart::Other(value) => {
                        let kind = value.get("type").and_then(|t| t.as_str()).unwrap_or("part");
                        let _ = write!(
                            out,
                            r#"<div class="art-empty">[{} part]</div>"#,
                            escape_html(kind)
                        );
                    }
                }
            }
            out
        }
    }
}

fn text_block(text: &str) -> String {
    if text.trim().is_empty() {
        r#"<div class="art-text art-empty">(empty)</div>"#.to_string()
    } else {
        format!(r#"<div class="art-text">{}</div>"#, escape_html(text))
    }
}

fn pretty_arguments(arguments: &str) -> String {
    serde_json::from_str::<serde_json::Value>(arguments)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| arguments.to_string())
}

/// One conversation item as HTML. `tool_names` maps tool call ids to function names seen so far.
fn item_html(item: &MessageOrChoice, tool_names: &mut HashMap<String, String>) -> String {
    let (message, sampled) = match item {
        MessageOrChoice::Message(message) => (message.clone(), None),
        MessageOrChoice::Choice(choice) => (choice.to_message(), Some(choice)),
    };
    let mut out = String::new();
    match &message {
        Message::System(m) | Message::Developer(m) => {
            let text = m.content.text();
            let preview: String = text.chars().take(90).collect();
            let ellipsis = if text.chars().count() > 90 { "…" } else { "" };
            let _ = write!(
                out,
                r#"<details class="art-msg art-system" style="border-left-color:{c}"><summary class="art-role" style="color:{c}">{}<span class="art-tag">{}{}</span></summary>{}</details>"#,
                message.role(),
                escape_html(&preview.replace('\n', " ")),
                ellipsis,
                content_html(&m.content),
                c = role_colour("system")
            );
        }
        Message::User(m) => {
            let _ = write!(
                out,
                r#"<div class="art-msg art-user" style="border-left-color:{c}"><div class="art-role" style="color:{c}">user</div>{}</div>"#,
                content_html(&m.content),
                c = role_colour("user"),
            );
        }
        Message::Assistant(m) => {
            let mut tag = String::new();
            if let Some(choice) = sampled {
                tag.push_str("sampled");
                let tokens = choice
                    .sampled_token_ids()
                    .map(|ids| ids.len())
                    .or_else(|| choice.sampled_logprobs().map(|l| l.len()));
                if let Some(n) = tokens.filter(|&n| n > 0) {
                    let _ = write!(tag, " · {n} tokens");
                }
                if let Some(reason) = &choice.finish_reason {
                    let _ = write!(tag, " · {}", escape_html(reason));
                }
            }
            let _ = write!(
                out,
                r#"<div class="art-msg art-assistant" style="border-left-color:{c}"><div class="art-role" style="color:{c}">assistant<span class="art-tag">{tag}</span></div>"#,
                c = role_colour("assistant")
            );
            match &m.content {
                Some(content) if !content.text().is_empty() || m.tool_calls.is_empty() => {
                    out.push_str(&content_html(content))
                }
                None if m.tool_calls.is_empty() => out.push_str(&text_block("")),
                _ => {}
            }
            if let Some(refusal) = &m.refusal {
                let _ = write!(
                    out,
                    r#"<div class="art-err">refused: {}</div>"#,
                    escape_html(refusal)
                );
            }
            for call in &m.tool_calls {
                tool_names.insert(call.id.clone(), call.function.name.clone());
                let _ = write!(
                    out,
                    r#"<div class="art-call art-code"><span class="art-fn">{}</span>(<span class="art-chip">{}</span>)
{}</div>"#,
                    escape_html(&call.function.name),
                    escape_html(&call.id),
                    escape_html(&pretty_arguments(&call.function.arguments))
                );
            }
            out.push_str("</div>");
        }
        Message::Tool(m) => {
            let name = tool_names
                .get(&m.tool_call_id)
                .map(|n| format!("{} · ", escape_html(n)))
                .unwrap_or_default();
            let _ = write!(
                out,
                r#"<div class="art-msg art-tool" style="border-left-color:{c}"><div class="art-role" style="color:{c}">tool result<span class="art-tag">{name}{}</span></div><div class="art-call art-code">{}</div></div>"#,
                escape_html(&m.tool_call_id),
                escape_html(&pretty_arguments(&m.content.text())),
                c = role_colour("tool"),
            );
        }
    }
    out
}

fn items_html(items: &[MessageOrChoice], tool_names: &mut HashMap<String, String>) -> String {
    items
        .iter()
        .map(|item| item_html(item, tool_names))
        .collect()
}

fn tools_html(tools: Option<&[Tool]>) -> String {
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return String::new();
    };
    let mut out = format!(
        r#"<details class="art-more"><summary>tools ({})</summary>"#,
        tools.len()
    );
    for tool in tools {
        let params = tool
            .function
            .parameters
            .as_ref()
            .and_then(|p| serde_json::to_string_pretty(p).ok())
            .unwrap_or_default();
        let _ = write!(
            out,
            r#"<div class="art-call art-code"><span class="art-fn">{}</span> {}
{}</div>"#,
            escape_html(&tool.function.name),
            escape_html(tool.function.description.as_deref().unwrap_or("")),
            escape_html(&params)
        );
    }
    out.push_str("</details>");
    out
}

fn logs_html(logs: &[String]) -> String {
    let logs: Vec<&String> = logs
        .iter()
        .filter(|l| !l.starts_with(RULER_PREFIX))
        .collect();
    if logs.is_empty() {
        return String::new();
    }
    let mut out = format!(
        r#"<details class="art-more"><summary>logs ({})</summary><div class="art-call art-code">"#,
        logs.len()
    );
    for line in logs {
        out.push_str(&escape_html(line));
        out.push('\n');
    }
    out.push_str("</div></details>");
    out
}

fn ruler_note(trajectory: &Trajectory) -> String {
    match ruler_explanation(trajectory) {
        Some(explanation) => format!(
            r#"<div class="art-note"><b>RULER</b> {}</div>"#,
            escape_html(explanation)
        ),
        None => String::new(),
    }
}

/// The body of a trajectory from item `from` on: messages, extra histories, tools, logs.
fn trajectory_body(trajectory: &Trajectory, from: usize) -> String {
    let mut tool_names = HashMap::new();
    // Tool calls in the skipped prefix still name later results.
    for item in &trajectory.messages_and_choices[..from] {
        item_html(item, &mut tool_names);
    }
    let mut out = items_html(&trajectory.messages_and_choices[from..], &mut tool_names);
    if from >= trajectory.messages_and_choices.len() {
        out.push_str(r#"<div class="art-empty">(nothing after the shared part)</div>"#);
    }
    for (i, history) in trajectory.additional_histories.iter().enumerate() {
        let _ = write!(
            out,
            r#"<details class="art-more"><summary>additional history {} ({} messages)</summary>{}</details>"#,
            i + 1,
            history.messages_and_choices.len(),
            items_html(&history.messages_and_choices, &mut HashMap::new())
        );
    }
    out.push_str(&tools_html(trajectory.tools.as_deref()));
    out.push_str(&logs_html(&trajectory.logs));
    out
}

pub(crate) fn trajectory_html(trajectory: &Trajectory) -> String {
    let mut out = String::from(
        r#"<div class="art-root"><div class="art-card"><div class="art-head"><span class="art-title">Trajectory</span>"#,
    );
    out.push_str(&reward_badge("reward", trajectory.reward, 0.0, 0.0));
    out.push_str(&metric_badges(&trajectory.metrics, &[]));
    out.push_str(&metadata_chips(&trajectory.metadata));
    if let (Some(a), Some(b)) = (
        trajectory.initial_policy_version,
        trajectory.final_policy_version,
    ) {
        let version = if a == b {
            a.to_string()
        } else {
            format!("{a}→{b}")
        };
        let _ = write!(
            out,
            r#"<span class="art-chip">policy <code>{version}</code></span>"#
        );
    }
    out.push_str("</div>");
    out.push_str(&ruler_note(trajectory));
    out.push_str(&trajectory_body(trajectory, 0));
    out.push_str("</div></div>");
    styled(&out)
}

/// Ranks by reward, best first, equal rewards sharing a rank ("1224" ranking: 1 plus the number
/// of strictly better rewards). RULER often gives several answers the same score: numbering them
/// 2, 3, 4 would claim an order the judge did not give.
pub(crate) fn competition_ranks(rewards: &[f64]) -> Vec<usize> {
    rewards
        .iter()
        .map(|r| {
            1 + rewards
                .iter()
                .filter(|other| other.total_cmp(r).is_gt())
                .count()
        })
        .collect()
}

pub(crate) fn group_html(group: &TrajectoryGroup) -> String {
    let rewards = group.rewards();
    let lo = rewards.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut out = String::from(
        r#"<div class="art-root"><div class="art-card"><div class="art-head"><span class="art-title">TrajectoryGroup</span>"#,
    );
    let _ = write!(
        out,
        r#"<span class="art-badge">trajectories <b>{}</b></span>"#,
        group.trajectories.len()
    );
    if let (Some(mean), Some(std)) = (group.mean_reward(), group.reward_std()) {
        out.push_str(&reward_badge("mean reward", mean, 0.0, 0.0));
        let _ = write!(
            out,
            r#"<span class="art-badge">std <b>{}</b></span>"#,
            format_number(std)
        );
        if std == 0.0 && group.trajectories.len() > 1 {
            out.push_str(r#"<span class="art-chip" title="GRPO learns from differences within a group">all rewards equal: nothing to learn</span>"#);
        }
    }
    if !group.exceptions.is_empty() {
        let _ = write!(
            out,
            r#"<span class="art-badge" style="border-color:#dc262680;background-color:#dc26261a">exceptions <b>{}</b></span>"#,
            group.exceptions.len()
        );
    }
    out.push_str(&metric_badges(&group.metrics, &[]));
    out.push_str(&metadata_chips(&group.metadata));
    out.push_str("</div>");

    // The beginning all trajectories share (system prompt, task) is shown once.
    let conversations: Vec<Vec<Message>> = group
        .trajectories
        .iter()
        .map(Trajectory::messages)
        .collect();
    let shared = if conversations.len() > 1 {
        common_prefix_len(&conversations)
    } else {
        0
    };
    if shared > 0 {
        let mut tool_names = HashMap::new();
        let _ = write!(
            out,
            r#"<details class="art-more" open><summary>shared beginning ({} messages)</summary>{}</details>"#,
            shared,
            items_html(
                &group.trajectories[0].messages_and_choices[..shared],
                &mut tool_names
            )
        );
    }

    let rank = competition_ranks(&rewards);
    out.push_str(r#"<div class="art-cols">"#);
    for (i, trajectory) in group.trajectories.iter().enumerate() {
        let best = hi > lo && trajectory.reward == hi;
        let _ = write!(
            out,
            r#"<div class="art-col{}"><div class="art-head"><span class="art-title">#{}</span>"#,
            if best { " art-best" } else { "" },
            i + 1
        );
        out.push_str(&reward_badge("reward", trajectory.reward, lo, hi));
        if group.trajectories.len() > 1 {
            let _ = write!(out, r#"<span class="art-chip">rank {}</span>"#, rank[i]);
        }
        out.push_str(&metric_badges(&trajectory.metrics, &["ruler_score"]));
        out.push_str(&metadata_chips(&trajectory.metadata));
        out.push_str("</div>");
        if let Some(h) = reward_hue(trajectory.reward, lo, hi) {
            let width = (trajectory.reward - lo) / (hi - lo) * 100.0;
            let _ = write!(
                out,
                r#"<div class="art-bar"><span class="art-fill" style="width:{width:.0}%;background-color:{}"></span></div>"#,
                hue_colour(h, 0xcc)
            );
        }
        out.push_str(&ruler_note(trajectory));
        out.push_str(&trajectory_body(trajectory, shared));
        out.push_str("</div>");
    }
    out.push_str("</div>");
    for exception in &group.exceptions {
        let _ = write!(
            out,
            r#"<div class="art-err"><b>{}</b>: {}</div>"#,
            escape_html(&exception.kind),
            escape_html(&exception.message)
        );
    }
    out.push_str(&logs_html(&group.logs));
    out.push_str("</div></div>");
    styled(&out)
}

fn item_text(item: &MessageOrChoice) -> String {
    let message = match item {
        MessageOrChoice::Message(m) => m.clone(),
        MessageOrChoice::Choice(c) => c.to_message(),
    };
    let mut text = format!("[{}] {}", message.role(), message.text());
    if let Message::Assistant(m) = &message {
        for call in &m.tool_calls {
            let _ = write!(
                text,
                "\n  -> {}({})",
                call.function.name, call.function.arguments
            );
        }
    }
    text
}

pub(crate) fn trajectory_text(trajectory: &Trajectory) -> String {
    let mut out = format!("Trajectory reward={}", format_number(trajectory.reward));
    for (name, value) in &trajectory.metrics {
        let _ = write!(out, " {name}={}", format_metric(value));
    }
    for item in &trajectory.messages_and_choices {
        out.push('\n');
        out.push_str(&item_text(item));
    }
    if let Some(explanation) = ruler_explanation(trajectory) {
        let _ = write!(out, "\nRULER: {explanation}");
    }
    out
}

pub(crate) fn group_text(group: &TrajectoryGroup) -> String {
    let rewards: Vec<String> = group.rewards().into_iter().map(format_number).collect();
    let mut out = format!(
        "TrajectoryGroup: {} trajectories, rewards [{}]",
        group.trajectories.len(),
        rewards.join(", ")
    );
    if let Some(mean) = group.mean_reward() {
        let _ = write!(out, ", mean {}", format_number(mean));
    }
    if !group.exceptions.is_empty() {
        let _ = write!(out, ", {} exceptions", group.exceptions.len());
    }
    out
}

impl Render for Trajectory {
    fn render(&self) -> MimeBundle {
        MimeBundle::new()
            .with("text/html", trajectory_html(self))
            .with("text/plain", trajectory_text(self))
    }
}

impl Render for TrajectoryGroup {
    fn render(&self) -> MimeBundle {
        MimeBundle::new()
            .with("text/html", group_html(self))
            .with("text/plain", group_text(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{AssistantMessage, ToolCall};

    fn weather_trajectory(reward: f64, answer: &str) -> Trajectory {
        let mut t = Trajectory::new([
            Message::system("You are a weather assistant."),
            Message::user("Weather in Paris?"),
        ]);
        t.push_message(Message::Assistant(AssistantMessage {
            tool_calls: vec![ToolCall::new(
                "call_1",
                "get_weather",
                r#"{"city":"Paris"}"#,
            )],
            ..Default::default()
        }));
        t.push_message(Message::tool("call_1", r#"{"temp":18}"#));
        t.push_message(Message::assistant(answer));
        t.reward = reward;
        t.set_metric("correct", reward > 0.5);
        t
    }

    #[test]
    fn transcript_shows_roles_tool_calls_and_results() {
        let mut t = weather_trajectory(0.75, "It is <18°C> & clear.");
        t.log("RULER explanation: used the tool, answered briefly");
        let html = trajectory_html(&t);
        for needle in [
            "art-system",
            "art-user",
            "art-assistant",
            "tool result",
            "get_weather",
            "&quot;city&quot;: &quot;Paris&quot;",
            "It is &lt;18°C&gt; &amp; clear.",
            "reward <b>0.75</b>",
            "correct <b>✓</b>",
            "<b>RULER</b> used the tool, answered briefly",
        ] {
            assert!(html.contains(needle), "missing {needle:?} in\n{html}");
        }
        assert!(!html.contains("<18°C>"), "text must be escaped");
        let text = trajectory_text(&t);
        assert!(text.contains("[tool] {\"temp\":18}"));
        assert!(text.contains("-> get_weather({\"city\":\"Paris\"})"));
    }

    #[test]
    fn group_shows_shared_beginning_once_and_ranks() {
        let group = TrajectoryGroup::new([
            weather_trajectory(0.2, "no idea"),
            weather_trajectory(0.9, "18°C, clear"),
        ]);
        let html = group_html(&group);
        // The system prompt is rendered once (above the columns), not once per trajectory.
        assert_eq!(html.matches(r#"class="art-msg art-system""#).count(), 1);
        assert!(html.contains("shared beginning (4 messages)"));
        assert_eq!(html.matches("art-col art-best").count(), 1);
        assert!(html.contains("rank 1"));
        assert!(html.contains("mean reward <b>0.55</b>"));
        assert_eq!(
            group_text(&group),
            "TrajectoryGroup: 2 trajectories, rewards [0.2, 0.9], mean 0.55"
        );
    }

    #[test]
    fn class_styles_are_written_inline_before_an_elements_own_style() {
        let html = styled(
            r#"<div class="art-root"><span class="art-badge" style="border-color:#ff0000">a</span><b class="unknown">b</b></div>"#,
        );
        assert!(html.starts_with(STYLE));
        let body = &html[STYLE.len()..];
        let badge = CLASS_STYLES
            .iter()
            .find(|(c, _)| *c == "art-badge")
            .unwrap()
            .1;
        assert!(body.contains(&format!(
            r#"class="art-badge" style="{badge};border-color:#ff0000">a"#
        )));
        assert!(body.starts_with(r#"<div class="art-root" style="font-size:13px;"#));
        assert!(body.contains(r#"<b class="unknown">b</b>"#));
    }

    #[test]
    fn inline_styles_use_only_what_notebook_sanitizers_keep() {
        // JupyterLab validates each inline declaration and drops the ones it does not know
        // (4.6, checked in Chromium: `var()`, `overflow-wrap:anywhere`, `position:sticky`,
        // `minmax()` in `grid-auto-columns`).
        for (class, style) in CLASS_STYLES {
            for bad in [
                "var(",
                "hsl",
                "anywhere",
                "rgba(",
                "flex",
                "sticky",
                "grid-auto-columns",
            ] {
                assert!(!style.contains(bad), "{class}: {bad} in {style}");
            }
        }
        let group = TrajectoryGroup::new([
            weather_trajectory(0.2, "no idea"),
            weather_trajectory(0.9, "18°C, clear"),
        ]);
        let html = group_html(&group);
        let body = &html[STYLE.len()..];
        assert!(!body.contains("<style") && !body.contains("hsl") && !body.contains("<svg"));
        // Every message carries its role colour itself.
        assert!(body.contains("border-left-color:#10b981"));
    }

    #[test]
    fn equal_rewards_share_a_rank() {
        assert_eq!(competition_ranks(&[1.0, 0.3, 0.3, 0.3]), vec![1, 2, 2, 2]);
        assert_eq!(competition_ranks(&[0.2, 0.9, 0.9, 0.5]), vec![4, 1, 1, 3]);
        assert_eq!(competition_ranks(&[0.7; 3]), vec![1, 1, 1]);
        let group = TrajectoryGroup::new([
            weather_trajectory(0.9, "18°C"),
            weather_trajectory(0.9, "18°C, clear"),
            weather_trajectory(0.1, "no idea"),
        ]);
        let html = group_html(&group);
        assert_eq!(html.matches(">rank 1<").count(), 2, "{html}");
        assert_eq!(html.matches(">rank 3<").count(), 1);
        assert!(!html.contains(">rank 2<"));
    }

    #[test]
    fn reward_hues_are_hex_colours() {
        assert_eq!(hue_colour(0.0, 0xff), "#c32222ff");
        assert_eq!(hue_colour(120.0, 0x80), "#22c32280");
        assert_eq!(hue_colour(130.0, 0).len(), 9);
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(format_number(1.0), "1");
        assert_eq!(format_number(-0.0), "0");
        assert_eq!(format_number(0.5), "0.5");
        assert_eq!(format_number(0.123456), "0.123");
        assert_eq!(format_number(1234.56), "1234.6");
        assert_eq!(strip_tags("<b>a</b> &lt;b&gt;"), "a <b>");
    }
}
