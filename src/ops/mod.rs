//! Entry points, one family per file; all of them lower to one custom op (`maxsim::MaxSimOp`).

pub(crate) mod dense;
pub(crate) mod hidden;
pub(crate) mod maxsim;
pub(crate) mod normalize;
pub(crate) mod plaid_approx;
pub(crate) mod residual;
pub(crate) mod retrieve;
pub(crate) mod varlen;
