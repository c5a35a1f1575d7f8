//! Entry points, one family per file; all of them lower to one custom op (`core::MaxSimOp`).

pub(crate) mod core;
pub mod dense;
pub mod hidden;
pub mod normalize;
pub mod residual;
pub mod retrieve;
pub mod varlen;

pub use normalize::l2_normalize;
