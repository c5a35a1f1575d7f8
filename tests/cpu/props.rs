//! Property test: random shapes, masks and dims against `reference`.
use crate::common::*;
use candle_core::{DType, Device};
use candle_maxsim::{self as ms, reference as r};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn dense_matches_reference(nq in 0usize..5, nd in 0usize..6, lq in 1usize..140, ld in 0usize..40,
                               dim in 1usize..70, masks in any::<bool>(), kd in any::<bool>()) {
        let dev = Device::Cpu;
        let q = randn(&[nq, lq, dim], DType::F32, &dev).unwrap();
        let d = if kd { randn(&[nq, nd, ld, dim], DType::F32, &dev) } else { randn(&[nd, ld, dim], DType::F32, &dev) }.unwrap();
        let dshape: Vec<usize> = d.dims()[..d.rank() - 1].to_vec();
        let qm = masks.then(|| rand_mask(&[nq, lq], 0.3, &dev).unwrap());
        let dm = masks.then(|| rand_mask(&dshape, 0.3, &dev).unwrap());
        let out = ms::maxsim(&q, &d, qm.as_ref(), dm.as_ref()).unwrap();
        let want = r::maxsim(&q, &d, qm.as_ref(), dm.as_ref()).expect("reference");
        assert_close("prop", &out, &want, 1e-5).unwrap();
    }
}
