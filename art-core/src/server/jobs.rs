//! Training jobs of the ServerlessBackend API (`/v1/preview/training-jobs`): a step runs in the
//! background and the client polls its events. Events are kept in memory and appended (synced)
//! to `<art dir>/training-jobs/<id>.jsonl`, so that a client polling across a server restart
//! learns how its job ended instead of waiting forever: a job the previous process left running
//! reads as ended when its checkpoint was written, as failed otherwise.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::train::list_checkpoints;
use crate::types::{CursorPage, JobEventKind, TrainingJobEvent};

/// The first line of a job's file: what recovery needs to tell how the job ended (with the
/// `step` its `training_started` event names: the step it computes).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct JobHeader {
    model_id: String,
    /// The model's directory, where the job's checkpoint appears when it completes.
    model_dir: PathBuf,
}

/// One job's events, in order. Event ids are their positions, from "1".
pub struct Job {
    events: Mutex<Vec<TrainingJobEvent>>,
    file: Mutex<Option<File>>,
}

impl Job {
    /// Appends an event (and writes it through to the job's file). Nothing is added after a
    /// terminal event.
    pub fn push(&self, kind: JobEventKind, data: Map<String, Value>) {
        let mut events = self.events.lock().expect("job events lock");
        if events.last().is_some_and(|e| e.kind.is_terminal()) {
            return;
        }
        let event = TrainingJobEvent {
            id: (events.len() + 1).to_string(),
            kind,
            data,
        };
        if let Some(file) = self.file.lock().expect("job file lock").as_mut() {
            let mut line = serde_json::to_vec(&event).expect("events serialize");
            line.push(b'\n');
            // A job whose events cannot be recorded still runs; its client polls memory.
            if let Err(e) = file.write_all(&line).and_then(|()| file.sync_data()) {
                tracing::warn!(error = %e, "cannot record a training job event");
            }
        }
        events.push(event);
    }

    /// The events after the one with id `after` (all with `None`), at most `limit`.
    pub fn events(&self, after: Option<usize>, limit: usize) -> CursorPage<TrainingJobEvent> {
        let events = self.events.lock().expect("job events lock");
        let start = after.unwrap_or(0).min(events.len());
        CursorPage::of(&events[start..], limit)
    }
}

/// Every job this server knows: those it started, and those of earlier runs, read back from
/// their files when it started.
pub struct Jobs {
    dir: PathBuf,
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    counter: AtomicU64,
}

impl Jobs {
    /// The jobs under `art_dir`. Jobs an earlier run of the server left unfinished are closed
    /// now, before any new job can write a checkpoint that would be mistaken for theirs.
    pub fn new(art_dir: &Path) -> Self {
        let jobs = Jobs {
            dir: art_dir.join("training-jobs"),
            jobs: Mutex::default(),
            counter: AtomicU64::new(0),
        };
        let mut earlier = HashMap::new();
        for entry in std::fs::read_dir(&jobs.dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_suffix(".jsonl") {
                if let Some(job) = jobs.load(id) {
                    earlier.insert(id.to_string(), Arc::new(job));
                }
            }
        }
        *jobs.jobs.lock().expect("jobs lock") = earlier;
        jobs
    }

    /// A new job of `model_id`. Its id is unique across restarts (the creation time, then a
    /// counter).
    pub fn create(&self, model_id: &str, model_dir: &Path) -> std::io::Result<(String, Arc<Job>)> {
        let millis = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let id = format!(
            "job-{millis}-{}",
            self.counter.fetch_add(1, Ordering::SeqCst)
        );
        std::fs::create_dir_all(&self.dir)?;
        let mut file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(self.path(&id))?;
        let header = JobHeader {
            model_id: model_id.to_string(),
            model_dir: model_dir.to_path_buf(),
        };
        let mut line = serde_json::to_vec(&header).expect("job header serializes");
        line.push(b'\n');
        file.write_all(&line)?;
        file.sync_data()?;
        // The directory entry too: a job the client heard of must be found after a crash.
        File::open(&self.dir)?.sync_all()?;
        let job = Arc::new(Job {
            events: Mutex::default(),
            file: Mutex::new(Some(file)),
        });
        self.jobs
            .lock()
            .expect("jobs lock")
            .insert(id.clone(), job.clone());
        Ok((id, job))
    }

    /// The job `id`: one this server started or one an earlier run left.
    pub fn get(&self, id: &str) -> Option<Arc<Job>> {
        self.jobs.lock().expect("jobs lock").get(id).cloned()
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.jsonl"))
    }

    /// Reads a job of an earlier run back. One that had not ended then never will: it is
    /// closed (in its file too), as ended when it had started and the checkpoint of the step it
    /// computed exists (nothing else could write it: steps of a model hold its trainer, and
    /// this runs before the server takes new jobs), as failed otherwise.
    fn load(&self, id: &str) -> Option<Job> {
        let text = std::fs::read_to_string(self.path(id)).ok()?;
        let mut lines = text.lines();
        let header: JobHeader = serde_json::from_str(lines.next()?).ok()?;
        // A line cut short by the crash is dropped.
        let events: Vec<TrainingJobEvent> = lines
            .map_while(|line| serde_json::from_str(line).ok())
            .collect();
        let file = OpenOptions::new().append(true).open(self.path(id)).ok();
        let ended = events.last().is_some_and(|e| e.kind.is_terminal());
        let job = Job {
            events: Mutex::new(events),
            file: Mutex::new(file),
        };
        if ended {
            return Some(job);
        }
        let started = job
            .events
            .lock()
            .expect("job events lock")
            .iter()
            .find(|e| e.kind == JobEventKind::TrainingStarted)
            .and_then(|e| e.data.get("step")?.as_u64());
        match started {
            Some(step) if list_checkpoints(&header.model_dir).contains(&step) => {
                job.push(JobEventKind::TrainingEnded, object(json!({"step": step})));
            }
            _ => {
                let stays = started.map_or(String::new(), |step| format!(" at step {}", step - 1));
                job.push(
                    JobEventKind::TrainingFailed,
                    object(json!({"error_message": format!(
                        "the server stopped while this job was running, before its checkpoint \
                         was written; `{}` stays{stays} as it was. Train on the groups again.",
                        header.model_id
                    )})),
                );
            }
        }
        Some(job)
    }
}

/// A JSON object's map (`value` must be an object).
pub fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("not a JSON object: {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(job: &Job) -> Vec<JobEventKind> {
        job.events(None, 100).data.iter().map(|e| e.kind).collect()
    }

    #[test]
    fn events_page_after_an_id_and_stop_at_the_terminal_one() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = Jobs::new(dir.path());
        let (id, job) = jobs.create("m", dir.path()).unwrap();
        job.push(
            JobEventKind::TrainingStarted,
            object(json!({"num_sequences": 1})),
        );
        job.push(JobEventKind::GradientStep, object(json!({"loss": 0.5})));
        job.push(JobEventKind::TrainingEnded, object(json!({"step": 1})));
        job.push(JobEventKind::TrainingFailed, Map::new()); // ignored: the job has ended
        let CursorPage {
            data: page,
            has_more: more,
        } = job.events(Some(1), 1);
        assert_eq!(
            (page[0].id.as_str(), page[0].kind, more),
            ("2", JobEventKind::GradientStep, true)
        );
        assert_eq!(
            job.events(Some(3), 10),
            CursorPage {
                data: Vec::new(),
                has_more: false
            }
        );
        assert!(Arc::ptr_eq(&jobs.get(&id).unwrap(), &job));
        assert!(jobs.get("job-../../etc").is_none() && jobs.get("nope").is_none());
    }

    #[test]
    fn a_job_left_running_by_a_killed_server_reads_as_failed_or_ended() {
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("model");
        let (failed, ended, done, queued) = {
            let jobs = Jobs::new(dir.path());
            let started = |step: u64| object(json!({"num_sequences": 1, "step": step}));
            let (failed, job) = jobs.create("m", &model_dir).unwrap();
            job.push(JobEventKind::TrainingStarted, started(4));
            let (ended, job) = jobs.create("m", &model_dir).unwrap();
            job.push(JobEventKind::TrainingStarted, started(5));
            let (done, job) = jobs.create("m", &model_dir).unwrap();
            job.push(JobEventKind::TrainingEnded, object(json!({"step": 5})));
            let (queued, _) = jobs.create("m", &model_dir).unwrap();
            (failed, ended, done, queued)
        };
        // The second job's checkpoint (step 5) was written before the server died.
        let checkpoint = crate::train::checkpoint_dir(&model_dir, 5);
        std::fs::create_dir_all(&checkpoint).unwrap();
        std::fs::write(checkpoint.join("adapter_model.safetensors"), b"").unwrap();

        let restarted = Jobs::new(dir.path());
        let job = restarted.get(&failed).unwrap();
        assert_eq!(
            kinds(&job),
            [JobEventKind::TrainingStarted, JobEventKind::TrainingFailed]
        );
        let message = job.events(Some(1), 1).data[0].data["error_message"].to_string();
        assert!(message.contains("stays at step 3"), "{message}");
        let job = restarted.get(&ended).unwrap();
        assert_eq!(
            kinds(&job),
            [JobEventKind::TrainingStarted, JobEventKind::TrainingEnded]
        );
        assert_eq!(
            kinds(&restarted.get(&done).unwrap()),
            [JobEventKind::TrainingEnded]
        );
        // A job still waiting for the trainer never started: failed.
        assert_eq!(
            kinds(&restarted.get(&queued).unwrap()),
            [JobEventKind::TrainingFailed]
        );
        // The verdict was written down: a third server reads the same.
        let again = Jobs::new(dir.path());
        assert_eq!(
            kinds(&again.get(&failed).unwrap()),
            [JobEventKind::TrainingStarted, JobEventKind::TrainingFailed]
        );
    }
}
