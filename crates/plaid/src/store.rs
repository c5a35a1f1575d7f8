//! The index directory on disk: JSON helpers, and updates that leave the old
//! directory intact on failure (a new directory is written beside it, then
//! renamed into place).

use candle_core::{bail, Error, Result};
use std::path::{Path, PathBuf};

pub(crate) fn io_err(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Msg(format!("dir: cannot {what} {}: {e}", path.display()))
}

pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, "read", e))?;
    serde_json::from_str(&text).map_err(|e| Error::Msg(format!("dir: {} is not valid JSON: {e}", path.display())))
}

pub(crate) fn json_usize(meta: &serde_json::Value, key: &str, path: &Path) -> Result<Option<usize>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n as usize)),
            None => bail!("dir: {}: `{key}` must be a non-negative integer, got {v}", path.display()),
        },
    }
}

/// Writes `value` as JSON to `path` (which must not be a hard link shared
/// with the live index: see [`Staging`]).
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Msg(format!("json: {e}")))?;
    std::fs::write(path, text).map_err(|e| io_err(path, "write", e))
}

/// A new version of an index directory, written beside it and committed by
/// renames: until [`Staging::commit`], the live directory is untouched; a
/// failure (or a drop without commit) removes the staging directory.
pub(crate) struct Staging {
    live: PathBuf,
    pub dir: PathBuf,
    committed: bool,
}

impl Staging {
    /// A staging directory for `live`: empty when `fresh`, else holding hard
    /// links (copies where links fail) of every file of the live directory.
    pub fn new(live: &Path, fresh: bool) -> Result<Self> {
        let name = live.file_name().ok_or_else(|| Error::Msg(format!("dir: {} has no name", live.display())))?;
        let parent = live.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(|e| io_err(parent, "create", e))?;
        let dir = parent.join(format!(".{}.staging-{}", name.to_string_lossy(), std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).map_err(|e| io_err(&dir, "create", e))?;
        let staging = Self { live: live.to_path_buf(), dir, committed: false };
        if !fresh {
            for entry in std::fs::read_dir(live).map_err(|e| io_err(live, "list", e))? {
                let entry = entry.map_err(|e| io_err(live, "list", e))?;
                if !entry.file_type().map_err(|e| io_err(&entry.path(), "stat", e))?.is_file() {
                    continue;
                }
                let to = staging.dir.join(entry.file_name());
                if std::fs::hard_link(entry.path(), &to).is_err() {
                    std::fs::copy(entry.path(), &to).map_err(|e| io_err(&to, "copy", e))?;
                }
            }
        }
        Ok(staging)
    }

    /// The path of `name` in the staging directory, its old link removed, so
    /// that writing it never touches the live directory's file.
    pub fn file(&self, name: &str) -> Result<PathBuf> {
        let p = self.dir.join(name);
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(p),
            Err(e) => Err(io_err(&p, "replace", e)),
        }
    }

    /// Replaces the live directory by the staging one: the live one is
    /// renamed aside, the staging one into its place, then the old removed.
    pub fn commit(mut self) -> Result<()> {
        let old = self.dir.with_extension("old");
        let _ = std::fs::remove_dir_all(&old);
        let had_live = self.live.exists();
        if had_live {
            std::fs::rename(&self.live, &old).map_err(|e| io_err(&self.live, "move aside", e))?;
        }
        if let Err(e) = std::fs::rename(&self.dir, &self.live) {
            if had_live {
                let _ = std::fs::rename(&old, &self.live);
            }
            return Err(io_err(&self.live, "replace", e));
        }
        self.committed = true;
        if had_live {
            let _ = std::fs::remove_dir_all(&old);
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
