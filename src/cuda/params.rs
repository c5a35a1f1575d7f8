//! Launch parameters shared by the MaxSim forward, backward and residual
//! launches (mirrors of the kernels' C structs), and the dtype tags of
//! kernel names.

use super::launch::kernel_params;
use super::memory::tensor_ptr;
use crate::layout::{Pairing, Problem, Seqs};
use candle_core::{DType, Result};

/// Mirror of `MaxSimParams` in kernels/common.cuh (same field order, C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Params {
    pub(crate) q: u64,
    pub(crate) d: u64,
    pub(crate) q_valid: u64,
    pub(crate) d_valid: u64,
    pub(crate) cu_q: u64,
    pub(crate) cu_d: u64,
    pub(crate) q_groups: u64,
    pub(crate) pair_q: u64,
    pub(crate) pair_d: u64,
    pub(crate) out: u64,
    pub(crate) argmax: u64,
    pub(crate) nq: i32,
    pub(crate) nd: i32,
    pub(crate) lq: i32,
    pub(crate) ld: i32,
    pub(crate) dim: i32,
    pub(crate) max_lq: i32,
    pub(crate) n_groups: i32,
    pub(crate) group_size: i32,
    pub(crate) n_pairs: i32,
    pub(crate) docs_per_block: i32,
    pub(crate) vec_ok: i32,
    pub(crate) res_centroids: u64,
    pub(crate) res_buckets: u64,
    pub(crate) res_codes: u64,
    pub(crate) res_residuals: u64,
    pub(crate) res_nbits: i32,
    pub(crate) res_colbert_order: i32,
    pub(crate) res_normalize: i32,
    pub(crate) argmax_i16: i32,
    pub(crate) q_scales: u64,
    pub(crate) d_scales: u64,
    pub(crate) lazy_cols: i32,
}
kernel_params!(Params);

/// The dtype part of a kernel's name (`maxsim_mma_bf16_...`).
pub(crate) fn dtype_tag(dt: DType) -> &'static str {
    match dt {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        DType::U8 => "i8",
        DType::F8E4M3 => "e4m3",
        _ => "f64",
    }
}

/// The sizes, offsets and pair lists of a problem (no data pointers).
pub(crate) fn layout_params(pb: &Problem) -> Result<Params> {
    let mut p = Params {
        nq: pb.q.n() as i32,
        nd: pb.d.n() as i32,
        lq: pb.q.max_len() as i32,
        ld: pb.d.max_len() as i32,
        dim: pb.dim as i32,
        max_lq: pb.q.max_len() as i32,
        ..Default::default()
    };
    if let Seqs::Packed { cu_dev, .. } = &pb.q {
        p.cu_q = tensor_ptr(cu_dev)?;
    }
    if let Seqs::Packed { cu_dev, .. } = &pb.d {
        p.cu_d = tensor_ptr(cu_dev)?;
    }
    if let Pairing::List { pq_dev, pd_dev, pq, .. } = &pb.pairs {
        if pq.is_empty() {
            return Ok(p);
        }
        p.pair_q = tensor_ptr(pq_dev)?;
        p.pair_d = tensor_ptr(pd_dev)?;
        p.n_pairs = pq.len() as i32;
    }
    Ok(p)
}
