//! Host helpers of the CPU ops: contiguous views of a `CpuStorage` by
//! layout, in place or widened to F32, and F32 results stored back in a
//! dtype.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Storage, WithDType};
use half::{bf16, f16};
use std::borrow::Cow;

/// The element range of a contiguous operand `arg`.
pub(crate) fn range(arg: &str, l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{arg}: internal error, operand is not contiguous"),
    }
}

/// A contiguous F16 / BF16 / F32 operand's elements as F32: borrowed for
/// F32, widened otherwise.
pub(crate) fn f32s<'a>(arg: &str, s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [f32]>> {
    let (a, b) = range(arg, l)?;
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[a..b]),
        CpuStorage::F16(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::BF16(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_f32()).collect()),
        s => bail!("{arg}: expected F16, BF16 or F32, got {:?}", s.dtype()),
    })
}

/// A contiguous operand's elements of type `T`, in place.
pub(crate) fn slice<'a, T: WithDType>(arg: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let (a, b) = range(arg, l)?;
    match s.as_slice::<T>() {
        Ok(v) => Ok(&v[a..b]),
        Err(_) => bail!("{arg}: expected a contiguous {:?} tensor, got {:?}", T::DTYPE, s.dtype()),
    }
}

/// A CPU tensor's storage, contiguous elements of type `T`, in place.
pub(crate) fn tensor_slice<'a, T: WithDType>(arg: &str, s: &'a Storage, l: &Layout) -> Result<&'a [T]> {
    match s {
        Storage::Cpu(c) => slice(arg, c, l),
        _ => bail!("{arg}: internal error, expected a CPU tensor"),
    }
}

/// A vector of `n` elements that `fill` writes, without zeroing them first
/// (a large output's memset runs on the calling thread alone, which on
/// many cores costs as much as the parallel work it precedes).
///
/// # Safety
/// `fill` must write every element of the slice it is given.
pub(crate) unsafe fn filled<T>(n: usize, fill: impl FnOnce(&mut [std::mem::MaybeUninit<T>])) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    fill(&mut v.spare_capacity_mut()[..n]);
    // SAFETY: the caller's promise: `fill` wrote all n elements.
    unsafe { v.set_len(n) };
    v
}

/// F32 values as a storage of `dtype`, each rounded once (widened for F64).
pub(crate) fn store(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::F64 => CpuStorage::F64(v.into_iter().map(f64::from).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        dt => bail!("internal error, no float values in {dt:?}"),
    })
}
