//! Small file-system helpers shared by the server and the store.

use std::path::Path;

/// Writes `bytes` to `path` so that readers see the old content or the new, never a torn file:
/// a uniquely named temporary file in the same directory, flushed to disk, renamed over the
/// target, then the directory synced (the store's implementation, [`crate::store`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    crate::store::atomic::write_atomic(path, bytes, &Default::default())
}
