//! Entry points, one family per file: validation, the family's custom op
//! and its device dispatch (`cpu_fwd`, `cuda_fwd`). The dense and packed
//! layouts lower to one op (`maxsim::MaxSimOp`), which the residual and
//! projection-head ops call for the parts they do not fuse.

pub(crate) mod dense;
pub(crate) mod encoder;
pub(crate) mod encoder_layer;
pub(crate) mod flash_attn;
pub(crate) mod hidden;
pub(crate) mod linear;
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

/// The storage of a fresh, contiguous result `t` (offset 0), for an op
/// whose forward computes through other ops.
pub(crate) fn owned_storage(t: &candle_core::Tensor) -> candle_core::Result<candle_core::Storage> {
    use candle_core::{bail, Storage};
    let t = t.contiguous()?;
    let (s, l) = t.storage_and_layout();
    if l.start_offset() != 0 {
        bail!("internal error, a result at an offset")
    }
    Ok(match &*s {
        Storage::Cpu(c) => Storage::Cpu(c.clone()),
        #[cfg(feature = "cuda")]
        Storage::Cuda(c) => {
            use candle_core::backend::BackendStorage;
            Storage::Cuda(c.try_clone(l)?)
        }
        _ => bail!("internal error, unsupported device"),
    })
}
