//! # candle-maxsim
//!
//! Fused MaxSim (late-interaction) scoring for [candle](https://github.com/huggingface/candle):
//!
//! `score[i, j] = Σ_{s : q_mask[i,s]} max_{t : d_mask[j,t]} ⟨Q[i,s], D[j,t]⟩`
//!
//! as used by ColBERT, ColBERTv2/PLAID and ColPali. The naive way writes the
//! whole `[Nq, Nd, Lq, Ld]` similarity tensor before reducing it; the ops here
//! never do: the CPU op tiles a GEMM and keeps a running max/argmax per query
//! row, and the CUDA op (feature `cuda`) does the same on tensor cores.
//! Gradients flow through a closed-form backward from the saved argmax.
//!
//! Every entry point takes candle `Tensor`s on any device and returns
//! `candle_core::Result`; invalid input is an `Err` naming the argument.
//! [`mod@reference`] holds the naive, materializing implementations used as the
//! ground truth in tests. The ColBERT models and the PLAID index built on
//! these ops live in the workspace's member crates `candle-maxsim-colbert`
//! and `candle-maxsim-plaid`.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1., (2, 32, 128), &dev)?;   // [Nq, Lq, dim]
//! let d = Tensor::randn(0f32, 1., (5, 180, 128), &dev)?;  // [Nd, Ld, dim]
//! let scores = candle_maxsim::maxsim(&q, &d, None, None)?; // [Nq, Nd] F32
//! assert_eq!(scores.dims(), &[2, 5]);
//! # Ok::<(), candle_core::Error>(())
//! ```

#![warn(missing_docs)]

pub(crate) mod cpu;
#[doc(hidden)]
pub mod knobs;
pub mod layers;
pub(crate) mod layout;
mod ops;
mod options;
pub mod reference;

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

pub use layers::{MaxSim, MaxSimPairwise, EMPTY_DOC_SCORE};
pub use ops::dense::{
    maxsim, maxsim_pairs, maxsim_pairs_with, maxsim_value_and_grads, maxsim_with, maxsim_with_argmax,
};
pub use ops::encoder::{attention_softmax, layer_norm};
pub use ops::hidden::{
    maxsim_from_hidden, maxsim_from_hidden_is_fused, maxsim_from_hidden_value_and_grads, FromHiddenGrads,
};
pub use ops::normalize::l2_normalize;
pub use ops::optim::{adamw_sum_sq, adamw_update, AdamWStep};
pub use ops::plaid_approx::{plaid_approx_candidates, plaid_approx_score, plaid_candidates, NO_CENTROID};
pub use ops::quantize::{
    dequantize, e4m3_supported, maxsim_quantized, maxsim_quantized_varlen, quantize, quantize_e4m3, retrieve_quantized,
    score_pairs_quantized, QuantFormat, Quantized,
};
pub use ops::residual::{
    maxsim_residual, maxsim_residual_pairs, maxsim_residual_varlen, nearest_centroids, pack_bucket_indices,
    unpack_bucket_indices, BitOrder, ResidualCodec, NO_DOCUMENT,
};
pub use ops::retrieve::{retrieve, TopK};
pub use ops::rows::{add_bias, add_bias_gelu, embedding, scatter_add_rows};
pub use ops::topk::{topk_rows, TOPK_MAX_K};
pub use ops::varlen::{maxsim_varlen, score_pairs_packed};
pub use options::{set_tile_selection, tile_selection, Backward, MaxSimOptions, TileSelection};
