//! Durable, atomic file replacement, for everything the project writes that must survive a crash
//! (the store's history and trajectories, TensorBoard files, training checkpoints): write a temp
//! file (or directory) beside the target, fsync it, rename it over the target, fsync the parent
//! directory. A crash at any point leaves either the old content or the new, never a half-written
//! one; a stray temp entry is all that can remain, and readers skip it ([`TEMP_PREFIX`]).

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Temp files start with this, so listings (trajectories, checkpoints) can skip them.
pub const TEMP_PREFIX: &str = ".tmp-";

/// A failure injected between "temp file written and synced" and "renamed into place": what a
/// crash or a full disk at the worst moment looks like. Shared, so clones of a store see it.
#[derive(Debug, Clone, Default)]
pub(crate) struct FaultInjector {
    /// File names (last path component) whose next write fails before the rename; each fires once.
    armed: Arc<Mutex<Vec<String>>>,
}

impl FaultInjector {
    pub(crate) fn arm(&self, file_name: &str) {
        self.lock().push(file_name.to_string());
    }

    /// True (and disarmed) when a failure is armed for this path.
    fn fire(&self, path: &Path) -> bool {
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            return false;
        };
        let mut armed = self.lock();
        match armed.iter().position(|a| a == name) {
            Some(i) => {
                armed.remove(i);
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        // A panic while holding this lock cannot leave the list inconsistent; keep going.
        self.armed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Replaces `path` with `bytes` atomically (see the module doc).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomic_with(path, bytes, &FaultInjector::default())
}

/// [`write_atomic`], failing where `faults` says (the store's crash tests).
pub(crate) fn write_atomic_with(
    path: &Path,
    bytes: &[u8],
    faults: &FaultInjector,
) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let temp = temp_path(dir, path);
    if let Err(e) = write_synced(&temp, bytes) {
        let _ = fs::remove_file(&temp);
        return Err(e);
    }
    if faults.fire(path) {
        // The temp file stays behind, as after a crash at this point.
        return Err(io::Error::other(
            "injected failure between writing the temp file and renaming it",
        ));
    }
    if let Err(e) = fs::rename(&temp, path) {
        let _ = fs::remove_file(&temp);
        return Err(e);
    }
    sync_dir(dir)
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

fn temp_path(dir: &Path, target: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    dir.join(format!("{TEMP_PREFIX}{}-{n}-{name}", std::process::id()))
}

/// Makes a rename durable: the directory entry itself must reach the disk.
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        // Windows cannot open a directory as a file; NTFS renames are journaled.
        let _ = dir;
        Ok(())
    }
}

/// Publishes the directory `temp` (already filled, beside `target`) as `target`: every file in
/// it and the directory itself are synced, then it is renamed into place and the parent synced.
/// An existing `target` is first moved aside (and removed after), so that a crash leaves the old
/// directory or the new one under `target`'s name, never neither.
pub fn publish_dir(temp: &Path, target: &Path) -> io::Result<()> {
    for entry in fs::read_dir(temp)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            File::open(entry.path())?.sync_all()?;
        }
    }
    sync_dir(temp)?;
    let parent = target.parent().unwrap_or(Path::new("."));
    let old = target.exists().then(|| temp_path(parent, target));
    if let Some(old) = &old {
        fs::rename(target, old)?;
    }
    fs::rename(temp, target)?;
    sync_dir(parent)?;
    if let Some(old) = old {
        fs::remove_dir_all(old)?;
    }
    Ok(())
}

/// A fresh temp path beside `target` (for a directory to fill and [`publish_dir`]).
pub fn temp_path_for(target: &Path) -> PathBuf {
    temp_path(target.parent().unwrap_or(Path::new(".")), target)
}

/// Removes temp files left in `dir` by an interrupted write (ours or an older process's).
pub fn remove_stale_temps(dir: &Path) -> io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            let path = entry.path();
            let _ = if path.is_dir() {
                fs::remove_dir_all(path)
            } else {
                fs::remove_file(path)
            };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_and_leaves_no_temp() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path();
        let path = dir.join("a.txt");
        let faults = FaultInjector::default();
        write_atomic_with(&path, b"one", &faults).unwrap();
        write_atomic_with(&path, b"two", &faults).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(fs::read_dir(dir).unwrap().count(), 1);
    }

    #[test]
    fn injected_failure_keeps_old_content_and_fires_once() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path();
        let path = dir.join("a.txt");
        let faults = FaultInjector::default();
        write_atomic_with(&path, b"old", &faults).unwrap();
        faults.arm("a.txt");
        assert!(write_atomic_with(&path, b"new", &faults).is_err());
        assert_eq!(fs::read(&path).unwrap(), b"old");
        // The temp file stays, as after a crash; cleanup removes it.
        assert_eq!(fs::read_dir(dir).unwrap().count(), 2);
        remove_stale_temps(dir).unwrap();
        assert_eq!(fs::read_dir(dir).unwrap().count(), 1);
        write_atomic_with(&path, b"new", &faults).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
    }

    #[test]
    fn a_published_directory_replaces_the_old_one_whole() {
        let scratch = tempfile::tempdir().unwrap();
        let target = scratch.path().join("0003");
        for content in ["old", "new"] {
            let temp = temp_path_for(&target);
            fs::create_dir_all(&temp).unwrap();
            fs::write(temp.join("state.json"), content).unwrap();
            publish_dir(&temp, &target).unwrap();
            assert_eq!(
                fs::read_to_string(target.join("state.json")).unwrap(),
                content
            );
        }
        // Only the published directory is left: no temp, no moved-aside old copy.
        assert_eq!(fs::read_dir(scratch.path()).unwrap().count(), 1);
    }
}
