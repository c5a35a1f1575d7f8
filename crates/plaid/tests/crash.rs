//! Builds and updates that survive being killed. A child process (this
//! test binary, run again on its entry point) builds an index, or adds,
//! deletes and compacts in a sequence; the parent kills it (SIGKILL) at
//! random moments. An update leaves the index in one of the states the
//! sequence passes through (before or after each update, never in
//! between), searchable, with nothing of the dead process left beside it;
//! a build, run again, resumes and gives the uninterrupted build's files.

mod support;

use candle_core::{Device, Result};
use candle_maxsim_plaid::{create, IndexConfig, PackedDocuments, PlaidIndex, SearchParams};
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::*;

/// The index directory a child process updates.
const DIR_VAR: &str = "CANDLE_MAXSIM_PLAID_CRASH_DIR";
/// The index directory a child process builds.
const BUILD_VAR: &str = "CANDLE_MAXSIM_PLAID_CRASH_BUILD";
const BASE_DOCS: usize = 200;

enum Op {
    Add(usize, u64),
    Delete(Vec<u32>),
    Compact,
}

/// The child's updates, in order.
fn ops() -> Vec<Op> {
    vec![
        Op::Add(30, 1),
        Op::Delete(vec![3, 205]),
        Op::Compact,
        Op::Add(30, 2),
        Op::Delete(vec![0, 1, 250]),
        Op::Compact,
        Op::Delete(vec![100]),
    ]
}

/// `(documents, deleted ids)` before the first update and after each.
fn states() -> Vec<(usize, Vec<u32>)> {
    let mut s = vec![(BASE_DOCS, Vec::new())];
    for op in ops() {
        let (mut n, mut del) = s.last().unwrap().clone();
        match op {
            Op::Add(k, _) => n += k,
            Op::Delete(ids) => {
                del.extend(ids);
                del.sort_unstable();
            }
            Op::Compact => {}
        }
        s.push((n, del));
    }
    s
}

/// The build the child runs: the collection its parent wrote beside `dir`
/// (`coll.npy`, `lens.npy`), in chunks of 20 documents.
fn build(dir: &Path) -> Result<PlaidIndex> {
    let root = dir.parent().expect("a directory in the test's root");
    let x = candle_core::Tensor::read_npy(root.join("coll.npy"))?;
    let lens: Vec<u32> = candle_core::Tensor::read_npy(root.join("lens.npy"))?.to_vec1()?;
    let config = IndexConfig { n_centroids: Some(32), chunk_documents: 20, ..Default::default() };
    create(dir, &PackedDocuments::new(x, &lens)?, &config, &Device::Cpu)
}

/// The child process's entry point (not a check): with `$CANDLE_MAXSIM_PLAID_CRASH_BUILD`
/// set, builds there; with `$CANDLE_MAXSIM_PLAID_CRASH_DIR`, runs [`ops`] on
/// the index there; without either, nothing.
#[test]
fn child_entry_point() -> Result<()> {
    if let Ok(dir) = std::env::var(BUILD_VAR) {
        build(Path::new(&dir))?;
        return Ok(());
    }
    let Ok(dir) = std::env::var(DIR_VAR) else { return Ok(()) };
    let mut index = PlaidIndex::load(&dir, &Device::Cpu)?;
    for op in ops() {
        match op {
            Op::Add(n, seed) => {
                let (x, lens, _) = clustered(n, 32, 8, seed)?;
                index.add(&PackedDocuments::new(x, &lens)?, 10)?;
            }
            Op::Delete(ids) => index.delete(&ids)?,
            Op::Compact => index.compact()?,
        }
    }
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        std::fs::copy(e.path(), to.join(e.file_name()))?;
    }
    Ok(())
}

/// The index in `dir` opens in one of [`states`] (returned), searches
/// without returning a deleted document, and nothing named after it is
/// left in its parent directory.
fn check_opens(dir: &Path, q: &candle_core::Tensor) -> anyhow::Result<usize> {
    let index = PlaidIndex::load(dir, &Device::Cpu)?;
    let state = (index.num_documents(), index.deleted().to_vec());
    let Some(at) = states().iter().position(|s| *s == state) else {
        anyhow::bail!("{}: opened in state {state:?}, not one the updates pass through", dir.display())
    };
    for hits in index.search(q, &SearchParams::default(), None)? {
        assert!(hits.iter().all(|(d, _)| index.deleted().binary_search(d).is_err()), "a deleted document returned");
    }
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    for e in std::fs::read_dir(dir.parent().unwrap())? {
        let n = e?.file_name().to_string_lossy().into_owned();
        assert!(!n.starts_with(&format!(".{name}.")), "{n} left beside {name}");
    }
    Ok(at)
}

/// 60 children (`$CRASH_TRIALS` for more) killed at random moments of the
/// update sequence (and one left to finish): every index opens before or
/// after an update.
#[test]
fn killed_updates_leave_the_index_before_or_after() -> anyhow::Result<()> {
    let root = temp_dir("crash");
    let base = root.join("base");
    let (x, lens, _) = clustered(BASE_DOCS, 32, 8, 0)?;
    let config = IndexConfig { n_centroids: Some(32), chunk_documents: 70, ..Default::default() };
    create(&base, &PackedDocuments::new(x.clone(), &lens)?, &config, &Device::Cpu)?;
    let q = queries_from(&x, &lens, &[0, 50, 150], 16, 3)?;
    let exe = std::env::current_exe()?;
    let child = |dir: &Path| {
        Command::new(&exe)
            .args(["--exact", "child_entry_point", "--test-threads", "1"])
            .env(DIR_VAR, dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
    };
    // Uninterrupted: the end state, and how long the sequence takes.
    let full = root.join("full");
    copy_dir(&base, &full)?;
    let t = Instant::now();
    assert!(child(&full)?.wait()?.success(), "the update sequence runs");
    let span = t.elapsed();
    assert_eq!(check_opens(&full, &q)?, states().len() - 1, "the uninterrupted run ends after the last update");
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut seen = vec![0usize; states().len()];
    let trials: usize = std::env::var("CRASH_TRIALS").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    for trial in 0..trials {
        let dir = root.join(format!("t{trial}"));
        copy_dir(&base, &dir)?;
        let mut c = child(&dir)?;
        std::thread::sleep(Duration::from_secs_f64(span.as_secs_f64() * rng.random_range(0.0..1.1)));
        let _ = c.kill();
        c.wait()?;
        seen[check_opens(&dir, &q)?] += 1;
        std::fs::remove_dir_all(&dir)?;
    }
    let reached = seen.iter().filter(|&&n| n > 0).count();
    eprintln!("states reached: {seen:?}");
    assert!(reached >= 3, "kills landed in {reached} distinct states: {seen:?}");
    std::fs::remove_dir_all(&root)?;
    Ok(())
}

/// Every file of `dir` by name, with its bytes.
fn files(dir: &Path) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        v.push((e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path())?));
    }
    v.sort();
    Ok(v)
}

/// 30 builds (half of `$CRASH_TRIALS`) killed at random moments, each run again to the end: the
/// index is the uninterrupted build's, file for file, byte for byte (the
/// codec and chunks written before the kill reused, the rest continued).
#[test]
fn killed_builds_resume_to_the_same_index() -> anyhow::Result<()> {
    let root = temp_dir("crash_build");
    let exe = std::env::current_exe()?;
    let child = |dir: &Path| {
        Command::new(&exe)
            .args(["--exact", "child_entry_point", "--test-threads", "1"])
            .env(BUILD_VAR, dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
    };
    let (x, lens, _) = clustered(BASE_DOCS, 32, 8, 0)?;
    x.write_npy(root.join("coll.npy"))?;
    candle_core::Tensor::new(lens.as_slice(), &Device::Cpu)?.write_npy(root.join("lens.npy"))?;
    let full = root.join("full");
    let t = Instant::now();
    assert!(child(&full)?.wait()?.success(), "the build runs");
    // The kill times are drawn over a warm build's duration: the first one
    // also pays for cold caches, and timed alone it let most kills land
    // after the build had finished.
    let again = root.join("again");
    let t2 = Instant::now();
    let mut c = child(&again)?;
    // From the codec's write to the rename into place (the span a resume
    // continues): half the kills land there, the other half anywhere.
    let (state, mut coding, mut renamed) = (root.join(".again.building").join("build.json"), None, None);
    while c.try_wait()?.is_none() {
        if coding.is_none() && state.exists() {
            coding = Some(t2.elapsed());
        }
        if renamed.is_none() && again.exists() {
            renamed = Some(t2.elapsed());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(c.wait()?.success(), "the build runs again");
    let span = t2.elapsed().min(t2 - t);
    let renamed = renamed.unwrap_or(span).min(span);
    let coding = coding.unwrap_or_default().min(renamed);
    std::fs::remove_dir_all(&again)?;
    let want = files(&full)?;
    assert!(want.iter().any(|(n, _)| n == "9.codes.npy"), "ten chunks written");
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (mut resumed, mut finished) = (0, 0);
    let trials: usize = std::env::var("CRASH_TRIALS").ok().and_then(|v| v.parse().ok()).unwrap_or(60) / 2;
    for trial in 0..trials {
        let dir = root.join(format!("b{trial}"));
        let mut c = child(&dir)?;
        let at = if trial % 2 == 0 {
            span.as_secs_f64() * rng.random_range(0.0..1.1)
        } else {
            rng.random_range(coding.as_secs_f64()..=renamed.as_secs_f64())
        };
        std::thread::sleep(Duration::from_secs_f64(at));
        let _ = c.kill();
        c.wait()?;
        let building = root.join(format!(".b{trial}.building"));
        if dir.exists() {
            // Killed after the rename: the whole index, loadable.
            PlaidIndex::load(&dir, &Device::Cpu)?;
            finished += 1;
        } else if building.join("build.json").exists() {
            resumed += 1;
        }
        build(&dir)?;
        assert!(!building.exists(), "trial {trial}: the build directory is gone after the build");
        let got = files(&dir)?;
        let differ: Vec<&String> = got.iter().zip(&want).filter(|(a, b)| a != b).map(|(a, _)| &a.0).collect();
        assert!(
            got.len() == want.len() && differ.is_empty(),
            "trial {trial}: the resumed build differs from the uninterrupted one in {differ:?} ({} vs {} files)",
            got.len(),
            want.len()
        );
        std::fs::remove_dir_all(&dir)?;
    }
    eprintln!("builds killed with progress to resume: {resumed}, after finishing: {finished}");
    assert!(resumed >= 5, "only {resumed} kills left a build to resume");
    std::fs::remove_dir_all(&root)?;
    Ok(())
}
