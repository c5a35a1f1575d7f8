//! The index directory on disk: JSON helpers, and updates that leave the old
//! directory intact on failure (a new directory is written beside it, then
//! renamed into place), recovered on the next open after a process died
//! anywhere inside one.

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
    /// Kept when dropped without a commit (a build to resume).
    keep: bool,
}

impl Staging {
    /// A staging directory for `live`: empty when `fresh`, else holding hard
    /// links (copies where links fail) of every file of the live directory.
    pub fn new(live: &Path, fresh: bool) -> Result<Self> {
        let (parent, prefix) = staging_prefix(live)?;
        std::fs::create_dir_all(&parent).map_err(|e| io_err(&parent, "create", e))?;
        recover(live)?;
        let dir = parent.join(format!("{prefix}{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).map_err(|e| io_err(&dir, "create", e))?;
        let staging = Self { live: live.to_path_buf(), dir, committed: false, keep: false };
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

    /// The directory of a new index for `live` built over several runs,
    /// `.NAME.building` beside it: kept when dropped without a commit (a
    /// failed or killed build leaves it for the next run to resume), made
    /// empty when `fresh`. Returns it and whether it held anything.
    pub fn building(live: &Path, fresh: bool) -> Result<(Self, bool)> {
        let (parent, _) = staging_prefix(live)?;
        std::fs::create_dir_all(&parent).map_err(|e| io_err(&parent, "create", e))?;
        recover(live)?;
        let name = live.file_name().expect("staging_prefix checked").to_string_lossy().into_owned();
        let dir = parent.join(format!(".{name}.building"));
        if fresh {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let existed = dir.exists();
        std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, "create", e))?;
        Ok((Self { live: live.to_path_buf(), dir, committed: false, keep: true }, existed))
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
        // `.NAME.staging-PID.old` (what `recover` looks for).
        let (parent, prefix) = staging_prefix(&self.live)?;
        let old = parent.join(format!("{prefix}{}.old", std::process::id()));
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

/// The directory holding `live` and the name prefix of its staging
/// directories (`.NAME.staging-PID`, and `.NAME.staging-PID.old` for the
/// live one moved aside during a commit).
fn staging_prefix(live: &Path) -> Result<(PathBuf, String)> {
    let name = live.file_name().ok_or_else(|| Error::Msg(format!("dir: {} has no name", live.display())))?;
    let parent = live.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Ok((parent.to_path_buf(), format!(".{}.staging-", name.to_string_lossy())))
}

/// Whether process `pid` may still be writing its staging directory: this
/// process, or (on Linux) any running one. Elsewhere only this process
/// counts, so concurrent writers to one index are not supported there.
fn writer_alive(pid: u32) -> bool {
    pid == std::process::id() || (cfg!(target_os = "linux") && Path::new(&format!("/proc/{pid}")).exists())
}

/// Brings `live` to a consistent state after a process died inside a
/// [`Staging`] update, and removes what such a process left behind. A
/// commit cut between its two renames (the live directory moved aside, the
/// complete staging one not yet in its place) is finished; a staging
/// directory whose commit never began is dropped (the live one is as
/// before). Staging directories of running processes are left alone.
pub(crate) fn recover(live: &Path) -> Result<()> {
    let (parent, prefix) = staging_prefix(live)?;
    let Ok(entries) = std::fs::read_dir(&parent) else { return Ok(()) };
    let mut dead = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&prefix) else { continue };
        let pid = rest.strip_suffix(".old").unwrap_or(rest);
        match pid.parse::<u32>() {
            Ok(pid) if !writer_alive(pid) => dead.push((pid, rest.ends_with(".old"))),
            _ => {}
        }
    }
    for &(pid, is_old) in &dead {
        let staging = parent.join(format!("{prefix}{pid}"));
        let old = parent.join(format!("{prefix}{pid}.old"));
        if is_old && !live.exists() {
            // The live directory was moved aside by a commit: the staging one
            // is complete (commits start after the last write). Roll forward,
            // or back if the staging one is gone.
            let from = if staging.exists() { &staging } else { &old };
            std::fs::rename(from, live).map_err(|e| io_err(live, "restore", e))?;
        }
    }
    for &(pid, is_old) in &dead {
        let p = parent.join(format!("{prefix}{pid}{}", if is_old { ".old" } else { "" }));
        if p.exists() {
            std::fs::remove_dir_all(&p).map_err(|e| io_err(&p, "remove the leftover", e))?;
        }
    }
    Ok(())
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed && !self.keep {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process id no process has (above Linux's pid_max).
    const DEAD: u32 = 4_000_000_000;

    fn dir_with(path: &Path, content: &str) {
        std::fs::create_dir_all(path).unwrap();
        std::fs::write(path.join("metadata.json"), content).unwrap();
    }

    fn content(path: &Path) -> String {
        std::fs::read_to_string(path.join("metadata.json")).unwrap()
    }

    /// Each point a dead writer can stop at, and the state `recover` makes of it.
    #[test]
    fn recover_finishes_or_drops_a_dead_writers_update() {
        let root = std::env::temp_dir().join(format!("candle-maxsim-plaid-recover-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let live = root.join("idx");
        let staging = root.join(format!(".idx.staging-{DEAD}"));
        let old = root.join(format!(".idx.staging-{DEAD}.old"));
        let listing = || {
            let mut v: Vec<String> =
                std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
            v.sort();
            v
        };
        // Killed while writing the staging directory: the update is dropped.
        dir_with(&live, "before");
        dir_with(&staging, "partial");
        recover(&live).unwrap();
        assert_eq!((content(&live), listing()), ("before".into(), vec!["idx".to_string()]));
        // Killed between the commit's renames: the complete update is finished.
        std::fs::rename(&live, &old).unwrap();
        dir_with(&staging, "after");
        recover(&live).unwrap();
        assert_eq!((content(&live), listing()), ("after".into(), vec!["idx".to_string()]));
        // Killed before removing the moved-aside directory: it is removed.
        dir_with(&old, "before");
        recover(&live).unwrap();
        assert_eq!((content(&live), listing()), ("after".into(), vec!["idx".to_string()]));
        // Only the moved-aside directory left: it is put back.
        std::fs::rename(&live, &old).unwrap();
        recover(&live).unwrap();
        assert_eq!((content(&live), listing()), ("after".into(), vec!["idx".to_string()]));
        // A running writer's staging directory (this process's) is left alone.
        let mine = root.join(format!(".idx.staging-{}", std::process::id()));
        dir_with(&mine, "in progress");
        recover(&live).unwrap();
        assert!(mine.exists(), "a running writer's staging directory was removed");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
