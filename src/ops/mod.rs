//! Entry points, one family per file: validation, the family's custom op
//! and its device dispatch (`cpu_fwd`, `cuda_fwd`). The dense and packed
//! layouts lower to one op (`maxsim::MaxSimOp`), which the residual and
//! projection-head ops call for the parts they do not fuse.

pub(crate) mod dense;
pub(crate) mod encoder;
pub(crate) mod hidden;
pub(crate) mod maxsim;
pub(crate) mod normalize;
pub(crate) mod optim;
pub(crate) mod plaid_approx;
pub(crate) mod quantized;
pub(crate) mod residual;
pub(crate) mod retrieve;
pub(crate) mod rows;
pub(crate) mod topk;
pub(crate) mod varlen;
