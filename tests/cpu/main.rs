//! CPU tests: parity with `reference`, gradients, codecs, errors, properties.

#[path = "../common/mod.rs"]
mod common;

mod errors;
mod grads;
mod normalize;
mod parity;
mod props;
mod residual;
