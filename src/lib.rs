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
//!
//! The crate root holds what a model author calls: the MaxSim family
//! ([`maxsim`], [`maxsim_with`], [`maxsim_pairs`], [`maxsim_varlen`],
//! [`score_pairs_packed`], [`retrieve`]), its options, the Sentence
//! Transformers scoring layers ([`MaxSim`], [`MaxSimPairwise`]),
//! [`l2_normalize`] and the fused projection head ([`maxsim_from_hidden`]).
//! The rest is grouped by what it is for:
//!
//! | module | contents |
//! |---|---|
//! | [`quantized`] | 8-bit (I8, FP8 e4m3) embeddings and MaxSim over them |
//! | [`residual`] | the ColBERTv2 / PLAID residual codec and exact MaxSim over compressed documents |
//! | [`plaid`] | PLAID's search steps: candidate generation and centroid-only approximate scores |
//! | [`nn`] | encoder building blocks with fused kernels: attention softmax, layer norm, bias + GELU, embedding and row ops |
//! | [`optim`] | AdamW on F32 parameters, in place |
//! | [`mod@reference`] | naive, materializing implementations of every entry point: the ground truth of the tests |
//!
//! The ColBERT models and the PLAID index built on these ops live in the
//! member crates `candle-maxsim-colbert` and `candle-maxsim-plaid`.
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

#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub(crate) mod cpu;
pub(crate) mod knobs;
mod layers;
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
pub use ops::hidden::{maxsim_from_hidden, maxsim_from_hidden_value_and_grads, FromHiddenGrads};
pub use ops::normalize::l2_normalize;
pub use ops::retrieve::{retrieve, TopK};
pub use ops::varlen::{maxsim_varlen, score_pairs_packed};
pub use options::{set_tile_selection, Backward, MaxSimOptions, TileSelection};

pub mod quantized {
    //! Symmetric 8-bit embeddings (I8 and FP8 e4m3, one F32 scale per
    //! token) and MaxSim over them: half the memory of BF16, scored by I8 /
    //! e4m3 tensor cores on CUDA and VNNI on AVX-512 CPUs.
    //!
    //! ```
    //! use candle_core::{Device, Tensor};
    //! use candle_maxsim::quantized::{maxsim_quantized, quantize};
    //! let dev = Device::Cpu;
    //! let q = quantize(&Tensor::randn(0f32, 1., (2, 32, 128), &dev)?)?;
    //! let d = quantize(&Tensor::randn(0f32, 1., (5, 180, 128), &dev)?)?;
    //! let scores = maxsim_quantized(&q, &d, None, None)?; // [2, 5] F32
    //! assert_eq!(scores.dims(), &[2, 5]);
    //! # Ok::<(), candle_core::Error>(())
    //! ```
    pub use crate::ops::quantized::{
        dequantize, e4m3_supported, maxsim_quantized, maxsim_quantized_varlen, quantize, quantize_e4m3,
        retrieve_quantized, score_pairs_quantized, QuantFormat, Quantized,
    };
}

pub mod residual {
    //! ColBERTv2 / PLAID compressed documents: each token is a centroid code
    //! plus `nbits` bucket indices per feature. The codec ([`ResidualCodec`]:
    //! compress, decompress), the centroid assignment ([`nearest_centroids`])
    //! and exact MaxSim over compressed documents, whose CUDA forward never
    //! writes the dense tokens to device memory.
    pub use crate::ops::residual::{
        maxsim_residual, maxsim_residual_pairs, maxsim_residual_varlen, nearest_centroids, pack_bucket_indices,
        unpack_bucket_indices, BitOrder, ResidualCodec, NO_DOCUMENT,
    };
}

pub mod plaid {
    //! PLAID's search steps on centroid codes: the candidate documents of
    //! probed centroids ([`plaid_candidates`]) and the centroid-only
    //! approximate score that prunes them ([`plaid_approx_score`],
    //! [`plaid_approx_candidates`]).
    pub use crate::ops::plaid_approx::{plaid_approx_candidates, plaid_approx_score, plaid_candidates, NO_CENTROID};
}

pub mod nn {
    //! Encoder building blocks with fused CUDA kernels and a CPU op of the
    //! same semantics, each with a closed-form backward: the attention
    //! softmax (scale, additive mask and softmax in one pass), layer norm
    //! with F32 statistics, bias + GELU, embedding lookup, row scatter-add,
    //! and the top-k of each row.
    pub use crate::ops::encoder::{attention_softmax, layer_norm};
    pub use crate::ops::rows::{add_bias, add_bias_gelu, embedding, scatter_add_rows};
    pub use crate::ops::topk::{topk_rows, TOPK_MAX_K};
}

pub mod optim {
    //! AdamW on F32 parameters, updated in place on their device (one fused
    //! kernel per parameter on CUDA), with global-norm gradient clipping.
    pub use crate::ops::optim::{adamw_sum_sq, adamw_update, AdamWStep};
}
