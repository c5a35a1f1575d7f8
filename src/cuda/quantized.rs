//! 8-bit MaxSim on CUDA: the I8 (sm_80+) and e4m3 (sm_90a) tensor-core
//! kernels of kernels/maxsim_fwd.cu, and the decision whether they cover a
//! problem.

use super::device::device_info;
use super::maxsim_fwd::{fwd_launch, Variant};
use super::memory::{storage_ptr, tensor_ptr};
use super::params::Params;
use super::tile_size::{path_for, Path};
use crate::layout::Problem;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

/// Whether the 8-bit tensor-core kernels of `dtype` (U8: I8, sm_80+;
/// F8E4M3: sm_90) cover this dim on this device (dims up to 128), and the
/// device's compute capability.
pub(crate) fn quantized_supported(dev: &CudaDevice, dtype: DType, dim: usize) -> Result<(bool, i32)> {
    let info = device_info(dev)?;
    Ok((matches!(path_for(&info, dtype, dim), Path::Mma { .. }), info.cc))
}

/// A contiguous operand: its storage and layout.
type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// 8-bit scores `[n_pairs]` F32 of `pb` (its masks included): `q` and `d`
/// as (`values` U8 bytes of `pb`'s rows, `scales` F32 contiguous), in I8 or
/// (`e4m3`) FP8 e4m3. `None` where no kernel covers I8 at this dim on this
/// device (the caller scores dequantized rows); e4m3 without its kernels is
/// an `Err`.
pub(crate) fn maxsim_quantized(
    pb: &Problem,
    e4m3: bool,
    (qv, qs): (Operand, &Tensor),
    (dv, ds): (Operand, &Tensor),
) -> Result<Option<CudaStorage>> {
    let dev = &qv.0.device;
    // The kernels' element type: U8 for I8, F8E4M3 for e4m3 (a tag; the bytes are U8).
    let dtype = if e4m3 { DType::F8E4M3 } else { DType::U8 };
    let (supported, cc) = quantized_supported(dev, dtype, pb.dim)?;
    if !supported && e4m3 {
        bail!(
            "q.values: FP8 e4m3 scoring on CUDA runs on Hopper (sm_90) e4m3 tensor cores for dims up to 128; \
             this is sm_{cc} with dim {} (quantize with `quantize` for I8, or score `dequantize`d rows)",
            pb.dim
        )
    }
    if !supported {
        return Ok(None);
    }
    let (qp, dp) = (storage_ptr(qv.0, qv.1)?, storage_ptr(dv.0, dv.1)?);
    let vec_ok = pb.dim.is_multiple_of(16) && qp.is_multiple_of(16) && dp.is_multiple_of(16);
    let src = Params {
        q: qp,
        d: dp,
        q_scales: tensor_ptr(qs)?,
        d_scales: tensor_ptr(ds)?,
        vec_ok: vec_ok as i32,
        ..Default::default()
    };
    Ok(Some(fwd_launch(dev, pb, dtype, src, Variant::Nograd)?.0))
}
