//! PLAID residual scoring on CUDA: the fused forward (tokens decompressed
//! inside the MaxSim tile loader, never written to device memory) and a
//! standalone decompression kernel for the gradient path.

use super::fwd::{fwd_launch, Params, Variant};
use super::{device_info, fwd_func, storage_ptr, tensor_ptr};
use crate::layout::Problem;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Result, Storage, Tensor};

/// Compressed documents on the device, validated by the caller: `codes`
/// `[T]` U32 (every code < the number of centroids), `residuals` `[T, dim·nbits/8]`
/// U8, `centroids` `[C, dim]` in the query dtype, `buckets` `[2^nbits]` F32.
pub(crate) struct ResidualDev {
    pub codes: Tensor,
    pub residuals: Tensor,
    pub centroids: Tensor,
    pub buckets: Tensor,
    pub nbits: usize,
    pub colbert_order: bool,
    pub normalize: bool,
}

impl ResidualDev {
    /// Contiguous operands with the alignment the kernels' vector loads need.
    fn prepared(&self) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let aligned = |t: &Tensor, a: u64| -> Result<Tensor> {
            let t = t.contiguous()?;
            Ok(if tensor_ptr(&t)? % a == 0 { t } else { t.copy()? })
        };
        Ok((
            self.codes.contiguous()?,
            aligned(&self.residuals, 8)?,
            aligned(&self.centroids, 16)?,
            self.buckets.contiguous()?,
        ))
    }

    fn params(&self, dim: usize, ops: &(Tensor, Tensor, Tensor, Tensor)) -> Result<Params> {
        Ok(Params {
            dim: dim as i32,
            res_codes: tensor_ptr(&ops.0)?,
            res_residuals: tensor_ptr(&ops.1)?,
            res_centroids: tensor_ptr(&ops.2)?,
            res_buckets: tensor_ptr(&ops.3)?,
            res_nbits: self.nbits as i32,
            res_colbert_order: self.colbert_order as i32,
            res_normalize: self.normalize as i32,
            ..Default::default()
        })
    }
}

/// Fused residual scores `[n_pairs]` F32 of packed queries `q` `[Tq, dim]`
/// against the compressed documents laid out by `pb.d`.
pub(crate) fn residual_scores(pb: &Problem, q: &Tensor, r: &ResidualDev) -> Result<Tensor> {
    let q = q.contiguous()?;
    let ops = r.prepared()?;
    let (qs, ql) = q.storage_and_layout();
    let Storage::Cuda(cs) = &*qs else { bail!("maxsim_residual: internal error, expected a CUDA tensor") };
    let qp = storage_ptr(cs, ql)?;
    let src =
        Params { q: qp, vec_ok: (qp.is_multiple_of(16) && pb.dim.is_multiple_of(8)) as i32, ..r.params(pb.dim, &ops)? };
    let (out, _) = fwd_launch(&cs.device, pb, q.dtype(), src, Variant::Residual)?;
    drop(ops); // stream-ordered free, after the launch
    Ok(Tensor::from((Storage::Cuda(out), pb.n_out())))
}

/// Dense `[T, dim]` tokens in `dtype` (F16 or BF16), normalized if `r.normalize`.
pub(crate) fn decompress(r: &ResidualDev, dtype: DType, dim: usize) -> Result<Tensor> {
    let n = r.codes.dim(0)?;
    let dev = match r.codes.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("maxsim_residual: internal error, expected a CUDA tensor"),
    };
    let ops = r.prepared()?;
    let p = r.params(dim, &ops)?;
    // SAFETY: the kernel writes every element (n rows of dim).
    let (out, ptr) = unsafe {
        match dtype {
            DType::F16 => {
                let s = dev.alloc::<half::f16>((n * dim).max(1))?;
                let ptr = super::slice_ptr(&dev, &s);
                (CudaStorage::wrap_cuda_slice(s, dev.clone()), ptr)
            }
            DType::BF16 => {
                let s = dev.alloc::<half::bf16>((n * dim).max(1))?;
                let ptr = super::slice_ptr(&dev, &s);
                (CudaStorage::wrap_cuda_slice(s, dev.clone()), ptr)
            }
            dt => bail!("maxsim_residual: internal error, no decompression kernel for {dt:?}"),
        }
    };
    if n > 0 {
        let name = format!("maxsim_decompress_{}", super::fwd::dtype_tag(dtype));
        let func = fwd_func(&dev, &name, 0)?;
        let rows_per_warp = 32 / (dim / 8).next_power_of_two().min(32);
        let warps = n.div_ceil(rows_per_warp);
        let blocks = warps.div_ceil(8).min(device_info(&dev)?.sm_count as usize * 16).max(1);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let n32 = n as i32;
        b.arg(&p);
        b.arg(&ptr);
        b.arg(&n32);
        // SAFETY: (MaxSimParams, T*, int) as declared in maxsim_fwd.cu.
        unsafe { b.launch(cfg) }.w()?;
    }
    drop(ops);
    Ok(Tensor::from((Storage::Cuda(out), (n, dim))))
}
