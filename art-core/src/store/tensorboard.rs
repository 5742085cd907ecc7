//! TensorBoard's view of history.jsonl: every history entry is also one TensorBoard event (one
//! scalar per metric, tagged `split/metric` as in history.jsonl), appended to
//! `<model dir>/tensorboard/events.out.tfevents.<seconds>.<host>.art`, so that
//! `tensorboard --logdir <art dir>` shows every model's curves (scripts/wandb-log.py sends the
//! same history to W&B).
//!
//! The file is TensorFlow's TFRecord framing (length, masked CRC-32C of the length, the bytes,
//! masked CRC-32C of the bytes) around `Event` protobufs (tensorflow/core/util/event.proto), the
//! first one carrying `file_version: "brain.Event:2"`. Only the fields we write are declared.
//!
//! The file is derived from history.jsonl and kept in step with it under the history lock: each
//! append scans the file (a few hundred bytes per step), cuts a record a crash left half-written,
//! and writes every history entry the file does not have yet. So a resumed model continues its
//! curves in the same file, a model logged before this writer existed gets its curves on its next
//! step, and a crash between the two writes heals on the next one. TensorBoard reads only the
//! newest file of a directory as it grows, so there is one file per model, shared by every
//! process that writes its history (a notebook logging rollouts, `art serve` logging steps).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use super::history;
use crate::types::HistoryEntry;

/// The directory under a model's directory that holds its event file.
pub const TENSORBOARD_DIR: &str = "tensorboard";

/// `ART_TENSORBOARD=0` (or `off`, `false`) turns the event files off; they are on by default
/// (a few hundred bytes per step, written beside history.jsonl).
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        !matches!(
            std::env::var("ART_TENSORBOARD").as_deref().map(str::trim),
            Ok("0" | "off" | "false" | "no")
        )
    })
}

/// tensorflow.Event, with the fields we write.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// tensorflow.Summary.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// tensorflow.Summary.Value: a tag and a `simple_value` scalar (what TensorBoard's scalar
/// dashboard and its EventAccumulator read).
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

const FILE_VERSION: &str = "brain.Event:2";

/// TFRecord's CRC: CRC-32C, rotated and offset so that CRCs of data containing CRCs stay strong.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn record(payload: &[u8]) -> Vec<u8> {
    let length = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc(&length).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc(payload).to_le_bytes());
    out
}

fn entry_event(entry: &HistoryEntry) -> Event {
    let wall_time = entry
        .recorded_at
        .as_deref()
        .and_then(history::parse_rfc3339)
        .unwrap_or_else(now_seconds);
    let value = entry
        .metrics
        .iter()
        .map(|(name, value)| SummaryValue {
            tag: if entry.split.is_empty() {
                name.clone()
            } else {
                format!("{}/{name}", entry.split)
            },
            simple_value: Some(*value as f32),
        })
        .collect();
    Event {
        wall_time,
        step: entry.step as i64,
        file_version: None,
        summary: Some(Summary { value }),
    }
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn encode(event: &Event) -> Vec<u8> {
    record(&prost::Message::encode_to_vec(event))
}

/// The payloads of the complete records at the start of `bytes`, and where the last one ends. A
/// record whose length, CRCs or bytes do not check out ends the scan (a crash cut it).
fn complete_records(bytes: &[u8]) -> (Vec<&[u8]>, usize) {
    let (mut payloads, mut at) = (Vec::new(), 0);
    while bytes.len() - at >= 12 {
        let length_bytes = &bytes[at..at + 8];
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().expect("4 bytes"));
        if masked_crc(length_bytes) != crc {
            break;
        }
        let length = u64::from_le_bytes(length_bytes.try_into().expect("8 bytes")) as usize;
        let end = at + 12 + length + 4;
        if length > bytes.len() || end > bytes.len() {
            break;
        }
        let payload = &bytes[at + 12..at + 12 + length];
        let crc = u32::from_le_bytes(bytes[end - 4..end].try_into().expect("4 bytes"));
        if masked_crc(payload) != crc {
            break;
        }
        payloads.push(payload);
        at = end;
    }
    (payloads, at)
}

/// The event file of a model directory: the newest `*tfevents*` file of its tensorboard
/// directory, or a new name when there is none.
fn event_file(model_dir: &Path) -> io::Result<PathBuf> {
    let dir = model_dir.join(TENSORBOARD_DIR);
    fs::create_dir_all(&dir)?;
    let mut existing: Vec<PathBuf> = fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("events.out.tfevents."))
        })
        .collect();
    existing.sort();
    if let Some(newest) = existing.pop() {
        return Ok(newest);
    }
    let seconds = now_seconds() as u64;
    Ok(dir.join(format!("events.out.tfevents.{seconds}.{}.art", host_name())))
}

fn host_name() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().replace(['/', '\\'], "_"))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Brings the model's event file in step with `history` (every entry of history.jsonl, in file
/// order, the newest last). Called with the history lock held.
pub(crate) fn sync(model_dir: &Path, history: &[HistoryEntry]) -> io::Result<()> {
    let path = event_file(model_dir)?;
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    let (payloads, valid_len) = complete_records(&bytes);
    let records = payloads.len();
    if valid_len < bytes.len() {
        file.set_len(valid_len as u64)?;
    }
    // The first record is the file-version event; each later one is one history entry.
    let written = records.saturating_sub(1);
    if written > history.len() {
        // The history was cut or replaced: the file no longer describes it. Write it afresh.
        drop(file);
        let mut fresh = encode(&header());
        for entry in history {
            fresh.extend(encode(&entry_event(entry)));
        }
        return crate::fsutil::write_atomic(&path, &fresh);
    }
    let mut out = Vec::new();
    if records == 0 {
        out.extend(encode(&header()));
    }
    for entry in &history[written..] {
        out.extend(encode(&entry_event(entry)));
    }
    if out.is_empty() {
        return Ok(());
    }
    // The file was opened without O_APPEND (it may have been cut above): write at its end.
    file.seek(SeekFrom::End(0))?;
    file.write_all(&out)?;
    file.sync_data()
}

fn header() -> Event {
    Event {
        wall_time: now_seconds(),
        step: 0,
        file_version: Some(FILE_VERSION.into()),
        summary: None,
    }
}

/// Reads back the scalars of an event file: `(step, tag, value)` in file order. For tests and
/// for readers without TensorBoard.
pub fn read_scalars(path: &Path) -> io::Result<Vec<(u64, String, f32)>> {
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    let mut scalars = Vec::new();
    for payload in complete_records(&bytes).0 {
        let event: Event = prost::Message::decode(payload)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        for value in event.summary.into_iter().flat_map(|s| s.value) {
            if let Some(v) = value.simple_value {
                scalars.push((event.step as u64, value.tag, v));
            }
        }
    }
    Ok(scalars)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(step: u64, split: &str, metrics: &[(&str, f64)]) -> HistoryEntry {
        let mut e = HistoryEntry::new(step, split);
        for (k, v) in metrics {
            e.metrics.insert((*k).into(), *v);
        }
        e.recorded_at = Some("2025-06-14T18:08:45.000042Z".into());
        e
    }

    #[test]
    fn crc_is_tfrecords() {
        // CRC-32C's check value of "123456789", and TensorFlow's masking of it
        // (((crc >> 15) | (crc << 17)) + 0xa282ead8, computed by hand).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    #[test]
    fn follows_history_and_heals_a_cut_record() {
        let dir = std::env::temp_dir().join(format!("art-tb-unit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let mut history = vec![entry(1, "train", &[("reward", 0.25), ("loss", 1.5)])];
        sync(&dir, &history).unwrap();
        history.push(entry(1, "val", &[("reward", 0.5)]));
        history.push(entry(2, "train", &[("reward", 0.75)]));
        sync(&dir, &history).unwrap();
        let path = event_file(&dir).unwrap();
        let expected = vec![
            (1, "train/loss".to_string(), 1.5),
            (1, "train/reward".to_string(), 0.25),
            (1, "val/reward".to_string(), 0.5),
            (2, "train/reward".to_string(), 0.75),
        ];
        assert_eq!(read_scalars(&path).unwrap(), expected);

        // A crash in the middle of the next record: the cut record goes, the entry comes back.
        history.push(entry(3, "train", &[("reward", 1.0)]));
        let mut bytes = fs::read(&path).unwrap();
        let whole = encode(&entry_event(&history[3]));
        bytes.extend_from_slice(&whole[..whole.len() / 2]);
        fs::write(&path, &bytes).unwrap();
        sync(&dir, &history).unwrap();
        let mut expected = expected;
        expected.push((3, "train/reward".to_string(), 1.0));
        assert_eq!(read_scalars(&path).unwrap(), expected);

        // A history that lost lines: the file is rewritten to match it.
        history.truncate(1);
        sync(&dir, &history).unwrap();
        assert_eq!(read_scalars(&path).unwrap(), expected[..2].to_vec());
        fs::remove_dir_all(&dir).unwrap();
    }
}
