//! The ops against `reference`, one module per source family (src/ops/*.rs),
//! plus gradients, errors and random-shape properties. Each check is written
//! once for a `&Device` and instantiated by `test_device!` on the CPU and,
//! under the `cuda` feature, on CUDA device 0, where it also runs its
//! CUDA-specific cases (`gpu_cases`); a CUDA instance without a GPU fails.

#[path = "../common/mod.rs"]
mod common;

mod dense;
mod encoder;
mod encoder_layer;
mod errors;
mod flash_attn;
mod grads;
mod hidden;
mod layers;
mod normalize;
mod optim;
mod plaid_approx;
mod props;
mod quantize;
mod residual;
mod retrieve;
mod rows;
mod topk;
mod varlen;
