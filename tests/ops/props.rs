//! Property test on the CPU: random shapes (empty batches, one-token and
//! long queries, odd dims), masks and the KD layout against `reference` in
//! F64. Past failures are replayed from tests/proptest-regressions/props.txt
//! (proptest's default location for this file: the folder beside the
//! target's root, tests/ops, named after the file).

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r};
use proptest::prelude::*;

/// Σ_s |max_t ⟨q_s, d_t⟩| per score, from the reference in F64: each query
/// token is scored as its own one-token query, then the terms' magnitudes are
/// summed. A random score can cancel to near 0 (ld = 1-2 with masks makes its
/// terms symmetric about 0), so its error is measured against this instead.
fn term_magnitude(q: &Tensor, d: &Tensor, qm: Option<&Tensor>, dm: Option<&Tensor>) -> Result<Tensor> {
    let (nq, lq, dim) = q.dims3()?;
    let qt = q.to_dtype(DType::F64)?.reshape((nq * lq, 1, dim))?;
    let qmt = qm.map(|m| m.reshape((nq * lq, 1))).transpose()?;
    let d = d.to_dtype(DType::F64)?;
    let terms = if d.rank() == 3 {
        r::maxsim(&qt, &d, qmt.as_ref(), dm)?
    } else {
        // KD: query i's token s sees query i's documents.
        let (_, k, ld, _) = d.dims4()?;
        let dt = d.unsqueeze(1)?.broadcast_as((nq, lq, k, ld, dim))?.reshape((nq * lq, k, ld, dim))?;
        let dmt = dm.map(|m| m.unsqueeze(1)?.broadcast_as((nq, lq, k, ld))?.reshape((nq * lq, k, ld))).transpose()?;
        r::maxsim(&qt, &dt, qmt.as_ref(), dmt.as_ref())?
    };
    let n = terms.dim(1)?;
    terms.reshape((nq, lq, n))?.abs()?.sum(1)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn dense_matches_reference_on_random_shapes(nq in 0usize..5, nd in 0usize..6, lq in 1usize..140, ld in 0usize..40,
                                                dim in 1usize..70, masks in any::<bool>(), kd in any::<bool>()) {
        let dev = Device::Cpu;
        let q = randn(&[nq, lq, dim], DType::F32, &dev).unwrap();
        let d = if kd { randn(&[nq, nd, ld, dim], DType::F32, &dev) } else { randn(&[nd, ld, dim], DType::F32, &dev) }.unwrap();
        let dshape: Vec<usize> = d.dims()[..d.rank() - 1].to_vec();
        let qm = masks.then(|| rand_mask(&[nq, lq], 0.3, &dev).unwrap());
        let dm = masks.then(|| rand_mask(&dshape, 0.3, &dev).unwrap());
        let out = ms::maxsim(&q, &d, qm.as_ref(), dm.as_ref()).unwrap();
        // The reference in F64 on the same F32 values: its own rounding is not
        // part of the measured error.
        let (q64, d64) = (q.to_dtype(DType::F64).unwrap(), d.to_dtype(DType::F64).unwrap());
        let want = r::maxsim(&q64, &d64, qm.as_ref(), dm.as_ref()).expect("reference");
        let scale = term_magnitude(&q, &d, qm.as_ref(), dm.as_ref()).unwrap();
        assert_close_scaled("prop", &out, &want, &scale, 1e-5).unwrap();
    }
}
