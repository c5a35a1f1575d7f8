//! Test helpers shared by the workspace's test targets: comparisons in F64,
//! tolerances per dtype, random inputs (never zeros), error-message checks,
//! and [`test_device!`], which writes a check once and instantiates it on
//! the CPU and, under the `cuda` feature, on the first CUDA device. The
//! READMEs' snippets run as this crate's doctests.

use candle_core::{DType, Device, Result, Tensor};

/// Instantiates `$fn(&Device) -> Result<()>` as one test per device:
/// `$cpu` on the CPU and, under the crate's `cuda` feature, `$cuda` on
/// CUDA device 0. A CUDA instance fails (never passes) where no GPU is
/// present, so a CUDA test run on a machine without one cannot succeed by
/// accident.
#[macro_export]
macro_rules! test_device {
    ($fn:ident, $cpu:ident, $cuda:ident) => {
        #[test]
        fn $cpu() -> candle_core::Result<()> {
            $fn(&candle_core::Device::Cpu)
        }

        #[cfg(feature = "cuda")]
        #[test]
        fn $cuda() -> candle_core::Result<()> {
            $fn(&$crate::cuda_device())
        }
    };
}

/// CUDA device 0; panics with a clear message where there is none.
pub fn cuda_device() -> Device {
    match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            panic!("a CUDA test ran without a usable CUDA device (build without `--features cuda` to skip it): {e}")
        }
    }
}

/// max|out − ref| / max|ref| over all elements (both cast to F64).
pub fn rel_err(out: &Tensor, reference: &Tensor) -> Result<f64> {
    Ok(max_abs_diff(out, reference)? / max_abs(reference)?)
}

/// max|out − ref| over all elements, in F64 (on the CPU).
pub fn max_abs_diff(out: &Tensor, reference: &Tensor) -> Result<f64> {
    assert_eq!(out.dims(), reference.dims(), "shape mismatch");
    let o = out.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?;
    let r = reference.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?;
    let diff = (o - r)?.abs()?.max(0)?.to_scalar::<f64>()?;
    assert!(diff.is_finite(), "non-finite difference");
    Ok(diff)
}

/// max|x| in F64, floored so that an all-zero tensor divides safely.
pub fn max_abs(x: &Tensor) -> Result<f64> {
    let x = x.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    Ok(x.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?.max(1e-30))
}

/// Asserts `rel_err(out, reference) < tol` (shapes only, for empty tensors).
pub fn assert_close(what: &str, out: &Tensor, reference: &Tensor, tol: f64) -> Result<()> {
    if out.elem_count() == 0 {
        assert_eq!(out.dims(), reference.dims(), "{what}: shape");
        return Ok(());
    }
    let e = rel_err(out, reference)?;
    assert!(e < tol, "{what}: rel err {e:e} >= {tol:e}");
    Ok(())
}

/// Like [`assert_close`], but the error is divided by `scale`'s largest entry
/// instead of the reference's: for a sum of terms of both signs this is
/// Σ|term|, the quantity the sum's rounding error is proportional to (a score
/// near 0 by cancellation has no meaningful relative error of its own).
pub fn assert_close_scaled(what: &str, out: &Tensor, reference: &Tensor, scale: &Tensor, tol: f64) -> Result<()> {
    if out.elem_count() == 0 {
        assert_eq!(out.dims(), reference.dims(), "{what}: shape");
        return Ok(());
    }
    let s = max_abs(scale)?;
    let e = max_abs_diff(out, reference)? / s;
    assert!(e < tol, "{what}: err {e:e} (of Σ|term| = {s:e}) >= {tol:e}");
    Ok(())
}

/// Relative tolerance of scores for each input dtype on the CPU op (its sums
/// run in the input precision's accumulator: f32 for the 16-bit types).
pub fn tol(dt: DType) -> f64 {
    match dt {
        DType::F16 => 5e-3,
        DType::BF16 => 2e-2,
        DType::F32 => 1e-5,
        _ => 1e-9,
    }
}

/// Standard-normal entries in `dt`.
pub fn randn(shape: &[usize], dt: DType, dev: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1f32, shape, dev)?.to_dtype(dt)
}

/// U8 mask with about `drop` of the entries 0.
pub fn rand_mask(shape: &[usize], drop: f32, dev: &Device) -> Result<Tensor> {
    Tensor::rand(0f32, 1f32, shape, dev)?.ge(drop)
}

/// `[n, l, dim]` with a non-contiguous layout (a transposed view).
pub fn randn_strided(n: usize, l: usize, dim: usize, dt: DType, dev: &Device) -> Result<Tensor> {
    let t = randn(&[n, dim, l], dt, dev)?.transpose(1, 2)?;
    assert!(!t.is_contiguous());
    Ok(t)
}

/// Offsets (U32 `[n+1]`) of random lengths in `0..=max`, some empty.
pub fn rand_offsets(n: usize, max: usize, seed: u64) -> (Vec<u32>, usize) {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut cu = vec![0u32];
    let mut longest = 0;
    for k in 0..n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let len = if k % 5 == 3 { 0 } else { ((x >> 33) as usize) % (max + 1) };
        longest = longest.max(len);
        cu.push(cu.last().unwrap() + len as u32);
    }
    (cu, longest)
}

/// Asserts that `r` is an `Err` whose message starts with `arg` followed by
/// `:` (this workspace's convention: the argument or file named first).
/// A fresh, empty directory under the system's temporary directory, a new
/// one per call (tests run in parallel threads of one process).
pub fn tmpdir(name: &str) -> std::path::PathBuf {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("candle-maxsim-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("a temporary directory");
    d
}

pub fn expect_err<T: std::fmt::Debug>(r: Result<T>, arg: &str) {
    match r {
        Ok(v) => panic!("expected an error naming `{arg}`, got Ok({v:?})"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with(&format!("{arg}:")), "error does not start with `{arg}:`: {msg}");
        }
    }
}

/// Asserts that `r` is an `Err` whose message contains `text` (for errors
/// that name a file, whose path comes first).
pub fn expect_err_containing<T: std::fmt::Debug>(r: Result<T>, text: &str) {
    match r {
        Ok(v) => panic!("expected an error mentioning `{text}`, got Ok({v:?})"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(text), "error does not mention `{text}`: {msg}");
        }
    }
}

/// The Rust snippets of the READMEs, run as doctests: the workspace README
/// (its snippets use all three crates) and each member crate's.
#[cfg(doctest)]
pub mod readme {
    #[doc = include_str!("../../../README.md")]
    pub struct Workspace;
    #[doc = include_str!("../../colbert/README.md")]
    pub struct Colbert;
    #[doc = include_str!("../../plaid/README.md")]
    pub struct Plaid;
}
