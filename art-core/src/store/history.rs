//! history.jsonl: one JSON object per logged step. Keys are namespaced by split as OpenPipe ART
//! writes them (`{"step": 3, "train/reward": 0.5, ..., "recorded_at": "..."}`), plus a `"split"`
//! field of our own so a line says which split it is without parsing key names.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};

use crate::types::HistoryEntry;

impl HistoryEntry {
    /// The JSON line for history.jsonl (no trailing newline). Non-finite values become `null`
    /// (JSON has no NaN), as Python's json would not but pandas/polars readers expect.
    pub fn to_json_line(&self) -> String {
        let mut object = Map::new();
        object.insert("step".into(), Value::from(self.step));
        object.insert("split".into(), Value::from(self.split.clone()));
        for (name, value) in &self.metrics {
            let key = if self.split.is_empty() {
                name.clone()
            } else {
                format!("{}/{name}", self.split)
            };
            let value = serde_json::Number::from_f64(*value).map_or(Value::Null, Value::Number);
            object.insert(key, value);
        }
        if let Some(at) = &self.recorded_at {
            object.insert("recorded_at".into(), Value::from(at.clone()));
        }
        Value::Object(object).to_string()
    }
}

/// Parses one line of history.jsonl into entries (one per split found in it). Lines written by
/// ART have no `"split"` field: their keys' `split/` prefixes say it. Keys that are not numbers
/// (strings, nulls) are skipped.
pub(crate) fn parse_line(line: &str) -> Result<Vec<HistoryEntry>, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let Value::Object(object) = value else {
        return Err("not a JSON object".into());
    };
    let step = object
        .get("step")
        .and_then(Value::as_u64)
        .ok_or("no non-negative integer \"step\"")?;
    let split = object
        .get("split")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let recorded_at = object
        .get("recorded_at")
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut by_split: BTreeMap<String, HistoryEntry> = BTreeMap::new();
    for (key, value) in &object {
        if matches!(key.as_str(), "step" | "split" | "recorded_at") {
            continue;
        }
        let Some(number) = value.as_f64() else {
            continue;
        };
        let (entry_split, name) = match key.split_once('/') {
            Some((prefix, name)) => (prefix.to_string(), name.to_string()),
            None => (split.clone(), key.clone()),
        };
        by_split
            .entry(entry_split.clone())
            .or_insert_with(|| HistoryEntry {
                recorded_at: recorded_at.clone(),
                ..HistoryEntry::new(step, entry_split)
            })
            .metrics
            .insert(name, number);
    }
    if by_split.is_empty() {
        // A step logged with no metrics still marks the step.
        by_split.insert(
            split.clone(),
            HistoryEntry {
                recorded_at,
                ..HistoryEntry::new(step, split)
            },
        );
    }
    Ok(by_split.into_values().collect())
}

/// The entries of each non-empty line of a history.jsonl text, with the line's number (from 1).
pub(crate) fn parse_lines(
    text: &str,
) -> impl Iterator<Item = (usize, Result<Vec<HistoryEntry>, String>)> + '_ {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| (i + 1, parse_line(line)))
}

/// Now as RFC 3339 UTC with microseconds (`2025-06-14T18:08:45.123456Z`), without a date crate.
pub(crate) fn now_rfc3339() -> String {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339(since.as_secs(), since.subsec_micros())
}

fn rfc3339(unix_seconds: u64, micros: u32) -> String {
    let days = (unix_seconds / 86_400) as i64;
    let secs = unix_seconds % 86_400;
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Seconds since the Unix epoch of a `recorded_at` time: ours (`2025-06-14T18:08:45.123456Z`) or
/// ART's (Python's `isoformat()`, local time without an offset, read as UTC). None when it is
/// neither.
pub(crate) fn parse_rfc3339(text: &str) -> Option<f64> {
    let text = text.trim().trim_end_matches('Z');
    let (date, time) = text.split_once(['T', ' '])?;
    let mut date = date.splitn(3, '-').map(str::parse::<i64>);
    let (year, month, day) = (date.next()?.ok()?, date.next()?.ok()?, date.next()?.ok()?);
    // An explicit offset (`+02:00`) is dropped: the curves' wall times are for humans.
    let time = time.split(['+', '-']).next()?;
    let mut time = time.splitn(3, ':');
    let hours: f64 = time.next()?.parse().ok()?;
    let minutes: f64 = time.next()?.parse().ok()?;
    let seconds: f64 = time.next().unwrap_or("0").parse().ok()?;
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let days = days_from_civil(year, month as u32, day as u32);
    Some(days as f64 * 86_400.0 + hours * 3600.0 + minutes * 60.0 + seconds)
}

/// (year, month, day) to days since 1970-01-01, the inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = year - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days since 1970-01-01 to (year, month, day), Howard Hinnant's algorithm.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000000Z");
        // 2025-06-14T18:08:45Z, a leap-year-crossing date and the end of a century.
        assert_eq!(rfc3339(1_749_924_525, 42), "2025-06-14T18:08:45.000042Z");
        assert_eq!(rfc3339(951_782_400, 0), "2000-02-29T00:00:00.000000Z");
        assert_eq!(rfc3339(4_107_542_399, 0), "2100-02-28T23:59:59.000000Z");
        for seconds in [0, 1_749_924_525, 951_782_400, 4_107_542_399] {
            let back = parse_rfc3339(&rfc3339(seconds, 250_000)).unwrap();
            assert_eq!(back, seconds as f64 + 0.25);
        }
        assert_eq!(parse_rfc3339("2025-01-01T00:00:00"), Some(1_735_689_600.0));
        assert_eq!(parse_rfc3339("yesterday"), None);
    }

    #[test]
    fn round_trips_our_lines() {
        let mut entry = HistoryEntry::new(3, "val");
        entry.metrics.insert("reward".into(), 0.25);
        entry.metrics.insert("exception_rate".into(), 0.0);
        // Values serde_json's default parser reads back one unit off (workspace feature
        // `float_roundtrip` makes them exact).
        entry
            .metrics
            .insert("tokens_per_second".into(), 985.6906946328695);
        entry.metrics.insert("loss".into(), 212.91890726713459);
        entry.recorded_at = Some(rfc3339(1_749_924_525, 0));
        let line = entry.to_json_line();
        assert!(line.contains("\"val/reward\":0.25"), "{line}");
        assert_eq!(parse_line(&line).unwrap(), vec![entry]);
    }

    #[test]
    fn reads_art_lines_without_split() {
        let line = r#"{"step": 2, "train/loss": 0.5, "train/grad_norm": 1.5, "val/reward": 0.75, "recorded_at": "2025-01-01T00:00:00"}"#;
        let entries = parse_line(line).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].split, "train");
        assert_eq!(entries[0].get("grad_norm"), Some(1.5));
        assert_eq!(entries[1].split, "val");
        assert_eq!(entries[1].get("reward"), Some(0.75));
        assert_eq!(entries[1].step, 2);
    }

    #[test]
    fn rejects_lines_without_step() {
        assert!(parse_line(r#"{"train/reward": 1}"#).is_err());
        assert!(parse_line("[1, 2]").is_err());
    }
}
