//! CUDA path: modules built from kernels/ by build.rs (PTX, and SASS for
//! sm_80 / sm_90a), picked per device at run time, and the launch code of
//! each op family, one file per kernels/*.cu. Each family's device
//! decisions (the MaxSim tiles in tile_size.rs, the residual path, the
//! 8-bit dispatch) are made here, behind the entry point its op's
//! `cuda_fwd` calls.

mod device;
pub(crate) mod encoder;
pub(crate) mod flash_attn;
mod hidden;
pub(crate) mod launch;
mod maxsim_bwd;
mod maxsim_fwd;
mod memory;
mod normalize;
pub(crate) mod optim;
mod params;
pub(crate) mod plaid_approx;
mod quantized;
mod residual;
mod rows;
mod tile_size;
mod topk;

#[cfg(test)]
pub(crate) use device::device_info;
pub(crate) use hidden::{from_hidden_fwd, FusedHeadPlan};
pub(crate) use maxsim_bwd::maxsim_bwd;
pub(crate) use maxsim_fwd::{maxsim_argmax, maxsim_fwd, Variant};
pub(crate) use memory::{deferred_checks, i32_bits_as_u32};
pub(crate) use normalize::{l2norm_bwd, l2norm_fwd};
pub(crate) use quantized::{maxsim_quantized, quantized_supported};
pub(crate) use residual::{compress_residual, decompress_residual, residual_pairs, residual_scores, CodecDev};
pub(crate) use rows::{add_bias, add_bias_in_place, gather_rows, geglu, gelu_bwd, scatter_add_rows, sum_rows};
pub(crate) use topk::topk_rows;
