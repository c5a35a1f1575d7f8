//! The bit layout of packed residual bucket indices: `nbits` per feature,
//! LSB-first or in the ColBERTv2 / fast-plaid order.

use super::codec::BitOrder;
use candle_core::{bail, Result};

#[inline]
fn reverse_bits(v: u8, nbits: usize) -> u8 {
    v.reverse_bits() >> (8 - nbits)
}

/// Bucket index of feature `k` in a packed residual row (nbits checked by the caller).
#[inline]
pub(super) fn bucket_index(row: &[u8], k: usize, nbits: usize, order: BitOrder) -> u8 {
    let per = 8 / nbits;
    let byte = row[k / per];
    let field = k % per;
    let mask = ((1u16 << nbits) - 1) as u8;
    match order {
        BitOrder::Lsb => (byte >> (field * nbits)) & mask,
        BitOrder::ColBert => reverse_bits((byte >> (8 - nbits * (field + 1))) & mask, nbits),
    }
}

/// Packs bucket indices (one per feature, each < 2^nbits) into bytes; the
/// inverse of [`unpack_bucket_indices`]. `indices.len()` must be a multiple of 8/nbits.
pub fn pack_bucket_indices(indices: &[u8], nbits: usize, order: BitOrder) -> Result<Vec<u8>> {
    check_nbits(nbits)?;
    let per = 8 / nbits;
    if !indices.len().is_multiple_of(per) {
        bail!("indices: length {} is not a multiple of {per} (8 / nbits)", indices.len())
    }
    let mut out = vec![0u8; indices.len() / per];
    for (k, &v) in indices.iter().enumerate() {
        if (v as usize) >> nbits != 0 {
            bail!("indices: indices[{k}] = {v} does not fit in {nbits} bits")
        }
        let field = k % per;
        out[k / per] |= match order {
            BitOrder::Lsb => v << (field * nbits),
            BitOrder::ColBert => reverse_bits(v, nbits) << (8 - nbits * (field + 1)),
        };
    }
    Ok(out)
}

pub(super) fn check_nbits(nbits: usize) -> Result<()> {
    if !matches!(nbits, 2 | 4 | 8) {
        bail!("nbits: must be 2, 4 or 8, got {nbits}")
    }
    Ok(())
}

/// Unpacks every bucket index of packed residual rows (for tests and tools).
pub fn unpack_bucket_indices(bytes: &[u8], nbits: usize, order: BitOrder) -> Result<Vec<u8>> {
    check_nbits(nbits)?;
    Ok((0..bytes.len() * 8 / nbits).map(|k| bucket_index(bytes, k, nbits, order)).collect())
}
