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
    //!
    //! ```
    //! use candle_core::{Device, Tensor};
    //! use candle_maxsim::residual::{maxsim_residual_varlen, nearest_centroids, BitOrder, ResidualCodec};
    //! let dev = Device::Cpu;
    //! let centroids = Tensor::randn(0f32, 1., (16, 64), &dev)?;
    //! let codec = ResidualCodec {
    //!     centroids: centroids.clone(),
    //!     bucket_weights: Tensor::new(&[-0.1f32, -0.03, 0.03, 0.1], &dev)?,
    //!     nbits: 2,
    //!     bit_order: BitOrder::ColBert,
    //! };
    //! // Three documents of 100 tokens, packed: codes and 2-bit residuals.
    //! let tokens = Tensor::randn(0f32, 1., (300, 64), &dev)?;
    //! let codes = nearest_centroids(&tokens, &centroids)?; // [300] U32
    //! let residuals = codec.compress(&tokens, &codes, &Tensor::new(&[-0.06f32, 0., 0.06], &dev)?)?; // [300, 16] U8
    //! let cu_d = Tensor::new(&[0u32, 100, 200, 300], &dev)?;
    //! let q = Tensor::randn(0f32, 1., (2, 32, 64), &dev)?;
    //! let scores = maxsim_residual_varlen(&q, &codes, &residuals, &cu_d, 100, &codec, true)?;
    //! assert_eq!(scores.dims(), &[2, 3]);
    //! # Ok::<(), candle_core::Error>(())
    //! ```
    pub use crate::ops::residual::{
        maxsim_residual, maxsim_residual_pairs, maxsim_residual_pairs_offsets, maxsim_residual_varlen,
        nearest_centroids, pack_bucket_indices, unpack_bucket_indices, BitOrder, DocOffsets, ResidualCodec,
        NO_DOCUMENT,
    };
}

pub mod plaid {
    //! PLAID's search steps on centroid codes: the candidate documents of
    //! probed centroids ([`plaid_candidates`]), the centroid-only
    //! approximate score that prunes them ([`plaid_approx_score`],
    //! [`plaid_approx_candidates`]), and the centroids a search filtered to
    //! a subset of documents may probe ([`plaid_subset_centroids`]).
    //!
    //! ```
    //! use candle_core::{Device, Tensor};
    //! use candle_maxsim::plaid::plaid_approx_score;
    //! let dev = Device::Cpu;
    //! // Each query token's score against each of 1000 centroids: [C, Lq].
    //! let qcs = Tensor::randn(0f32, 1., (1000, 32), &dev)?;
    //! // Four documents of at most 8 tokens, as centroid codes, and their lengths.
    //! let codes = Tensor::arange(0u32, 32, &dev)?.reshape((4, 8))?;
    //! let lens = Tensor::new(&[8u32, 5, 8, 1], &dev)?;
    //! let approx = plaid_approx_score(&qcs, &codes, &lens)?; // [4]
    //! assert_eq!(approx.dims(), &[4]);
    //! # Ok::<(), candle_core::Error>(())
    //! ```
    pub use crate::ops::plaid_approx::{
        deferred_checks, plaid_approx_candidates, plaid_approx_score, plaid_candidates, plaid_subset_centroids,
        NO_CENTROID,
    };
}

pub mod nn {
    //! Encoder building blocks with fused CUDA kernels and a CPU op of the
    //! same semantics, each with a closed-form backward: the attention
    //! softmax (scale, additive mask and softmax in one pass), multi-head
    //! attention, FlashAttention-2 over packed variable-length sequences
    //! ([`attention_varlen`]: no padding, no `[B, H, L, L]`, a sliding
    //! window), the linear projection (tiled on all CPU cores; product,
    //! bias and BERT's GELU one graph node elsewhere), layer norm with F32 statistics
    //! (also of a residual sum, without keeping the sum), a whole BERT or
    //! ModernBERT layer as one graph node ([`bert_layer`],
    //! [`modernbert_layer`]), bias + GELU,
    //! GeGLU, rotary embeddings of a fused QKV projection, embedding lookup,
    //! row scatter-add, and the top-k of each row.
    //!
    //! ```
    //! use candle_core::{DType, Device, Tensor};
    //! use candle_maxsim::nn::{attention_softmax, layer_norm};
    //! let dev = Device::Cpu;
    //! let scores = Tensor::randn(0f32, 1., (2, 4, 16, 16), &dev)?; // [B, H, Lq, Lk]
    //! let mask = Tensor::zeros((2, 1, 1, 16), DType::F32, &dev)?; // additive, F32
    //! let p = attention_softmax(&scores, &mask, 0.125)?;
    //! let x = Tensor::randn(0f32, 1., (32, 64), &dev)?;
    //! let y = layer_norm(&x, &Tensor::ones(64, DType::F32, &dev)?, None, 1e-5)?;
    //! assert_eq!((p.dims(), y.dims()), (scores.dims(), x.dims()));
    //! # Ok::<(), candle_core::Error>(())
    //! ```
    pub use crate::ops::encoder::{attention, attention_softmax, layer_norm, residual_layer_norm, rotary_qk};
    pub use crate::ops::encoder_layer::{bert_layer, modernbert_layer, BertLayerWeights, ModernBertLayerWeights};
    pub use crate::ops::flash_attn::{
        attention_varlen, attention_varlen_offsets, attention_varlen_qkv, attention_varlen_qkv_offsets, SeqOffsets,
        ATTENTION_HEAD_DIMS,
    };
    pub use crate::ops::linear::{linear, linear_gelu};
    pub use crate::ops::rows::{add_bias, add_bias_gelu, embedding, geglu, scatter_add_rows};
    pub use crate::ops::topk::{topk_rows, TOPK_MAX_K};
}

pub mod optim {
    //! AdamW on F32 parameters, updated in place on their device (one fused
    //! kernel per parameter on CUDA), with global-norm gradient clipping.
    //!
    //! ```
    //! use candle_core::{DType, Device, Tensor};
    //! use candle_maxsim::optim::{adamw_sum_sq, adamw_update, AdamWStep};
    //! let dev = Device::Cpu;
    //! let p = Tensor::randn(0f32, 1., 10, &dev)?;
    //! let g = Tensor::randn(0f32, 1., 10, &dev)?;
    //! let mv = Tensor::zeros((2, 10), DType::F32, &dev)?; // the moments
    //! let sum_sq = Tensor::zeros(1, DType::F32, &dev)?;
    //! adamw_sum_sq(&sum_sq, &g)?; // once per gradient of the step
    //! let step = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, max_grad_norm: 1.0, t: 1 };
    //! adamw_update(&p, &mv, &g, &sum_sq, &step)?; // p, mv updated in place
    //! # Ok::<(), candle_core::Error>(())
    //! ```
    pub use crate::ops::optim::{adamw_sum_sq, adamw_update, AdamWStep};
}
