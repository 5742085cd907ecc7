//! The Hugging Face hub's local cache, read offline.
//!
//! Layout (the same as `huggingface_hub` and the `hf-hub` crate write it):
//! `<cache>/models--<org>--<name>/refs/<revision>` holds a commit hash, and
//! `<cache>/models--<org>--<name>/snapshots/<commit>/<files>` the files of that commit (symlinks
//! into `blobs/` on Unix). The cache directory is `$HF_HUB_CACHE`, else
//! `$HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`.
//!
//! The `hf-hub` crate (1.x) implements this too, but it always builds its HTTP and xet download
//! stack (reqwest, hf-xet); for an offline lookup these few lines are the lighter dependency.

use std::path::{Path, PathBuf};

use super::error::{EngineError, Result};

/// The default hub cache directory, from the environment as `huggingface_hub` resolves it.
pub fn default_cache_dir() -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(p) = env("HF_HUB_CACHE").or_else(|| env("HUGGINGFACE_HUB_CACHE")) {
        return p;
    }
    if let Some(home) = env("HF_HOME") {
        return home.join("hub");
    }
    let base = env("XDG_CACHE_HOME").unwrap_or_else(|| {
        env("HOME")
            .unwrap_or_else(|| PathBuf::from("."))
            .join(".cache")
    });
    base.join("huggingface").join("hub")
}

/// The folder of a model repository in the cache: `models--org--name`.
pub fn repo_folder(repo_id: &str) -> String {
    format!("models--{}", repo_id.replace('/', "--"))
}

/// The repository id of a path inside the cache (`.../models--org--name/snapshots/<commit>`):
/// the name a model loaded from there has on the hub.
pub fn repo_id_of(path: &Path) -> Option<String> {
    path.components().rev().find_map(|part| {
        let folder = part.as_os_str().to_str()?.strip_prefix("models--")?;
        // The hub forbids `--` in names, so the first one separates the owner.
        let (org, name) = folder.split_once("--")?;
        Some(format!("{org}/{name}"))
    })
}

/// The snapshot directory of `repo_id` at `revision` (a branch or tag name resolved through
/// `refs/`, or a full commit hash) inside `cache_dir`.
pub fn snapshot_dir(cache_dir: &Path, repo_id: &str, revision: &str) -> Result<PathBuf> {
    let repo = cache_dir.join(repo_folder(repo_id));
    if !repo.is_dir() {
        return Err(EngineError::NotFound {
            path: repo,
            hint: format!(
                "`{repo_id}` is not in the Hugging Face cache; download it on a machine with hub \
                 access (huggingface-cli download {repo_id}) and copy the cache, set HF_HUB_CACHE, \
                 or pass a local directory or .gguf file"
            ),
        });
    }
    let is_commit = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
    let commit = if is_commit {
        revision.to_string()
    } else {
        let ref_path = repo.join("refs").join(revision);
        std::fs::read_to_string(&ref_path)
            .map_err(|_| EngineError::NotFound {
                path: ref_path.clone(),
                hint: format!(
                    "revision `{revision}` of `{repo_id}` is not in the cache; pass a commit hash \
                     or a revision that was downloaded"
                ),
            })?
            .trim()
            .to_string()
    };
    let snapshot = repo.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        return Err(EngineError::NotFound {
            path: snapshot,
            hint: format!("the cache has no snapshot for commit {commit} of `{repo_id}`"),
        });
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_path_names_its_repository() {
        let path = Path::new("/c/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/abc123");
        assert_eq!(
            repo_id_of(path).as_deref(),
            Some("Qwen/Qwen2.5-0.5B-Instruct")
        );
        assert_eq!(
            repo_folder("Qwen/Qwen2.5-0.5B-Instruct"),
            "models--Qwen--Qwen2.5-0.5B-Instruct"
        );
        assert_eq!(repo_id_of(Path::new("models/SmolLM2.gguf")), None);
    }
}
