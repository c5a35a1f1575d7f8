use crate::common::*;
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_maxsim::{self as ms, reference as r, MaxSimOptions};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn dense_case(nq: usize, nd: usize, lq: usize, ld: usize, dim: usize, dt: DType, masks: bool) -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[nq, lq, dim], dt, &dev)?;
    let d = randn(&[nd, ld, dim], dt, &dev)?;
    let qm = masks.then(|| rand_mask(&[nq, lq], 0.2, &dev)).transpose()?;
    let dm = masks.then(|| rand_mask(&[nd, ld], 0.2, &dev)).transpose()?;
    let out = ms::maxsim(&q, &d, qm.as_ref(), dm.as_ref())?;
    let want = r::maxsim(&q, &d, qm.as_ref(), dm.as_ref())?;
    assert_eq!(out.dtype(), DType::F32);
    assert_close(&format!("dense {nq}x{nd} lq{lq} ld{ld} d{dim} {dt:?} masks={masks}"), &out, &want, tol(dt))
}

#[test]
fn dense_dims_and_dtypes() -> Result<()> {
    for dt in DTYPES {
        for dim in [16, 33, 96, 128, 250] {
            dense_case(3, 5, 7, 19, dim, dt, true)?;
        }
    }
    Ok(())
}

#[test]
fn dense_edge_lengths() -> Result<()> {
    for dt in DTYPES {
        dense_case(4, 3, 1, 9, 32, dt, false)?; // Lq = 1
        dense_case(4, 3, 8, 1, 32, dt, false)?; // Ld = 1
        dense_case(2, 3, 600, 40, 64, dt, true)?; // Lq > 512: 128-token chunks
        dense_case(3, 9, 40, 700, 16, dt, true)?; // Ld spans several document tiles
        dense_case(70, 40, 5, 30, 24, dt, true)?; // many small items
    }
    Ok(())
}

#[test]
fn f64_inputs() -> Result<()> {
    dense_case(3, 4, 6, 11, 20, DType::F64, true)
}

#[test]
fn non_contiguous_inputs() -> Result<()> {
    let dev = Device::Cpu;
    for dt in DTYPES {
        let q = randn_strided(3, 9, 48, dt, &dev)?;
        let d = randn_strided(4, 13, 48, dt, &dev)?;
        let qm = rand_mask(&[3, 9], 0.2, &dev)?;
        // A broadcast (stride-0) mask view.
        let dm = rand_mask(&[1, 13], 0.2, &dev)?.broadcast_as((4, 13))?;
        let out = ms::maxsim(&q, &d, Some(&qm), Some(&dm))?;
        let want = r::maxsim(&q, &d, Some(&qm), Some(&dm))?;
        assert_close("non-contiguous", &out, &want, tol(dt))?;
        // Narrowed document batch.
        let dn = d.narrow(0, 1, 2)?;
        assert_close("narrowed", &ms::maxsim(&q, &dn, None, None)?, &r::maxsim(&q, &dn, None, None)?, tol(dt))?;
    }
    Ok(())
}

#[test]
fn masked_doc_and_query_are_exactly_zero() -> Result<()> {
    let dev = Device::Cpu;
    // Negative similarities everywhere: a masked token would win if not excluded.
    let q = randn(&[3, 5, 16], DType::F32, &dev)?.abs()?;
    let d = (randn(&[4, 6, 16], DType::F32, &dev)?.abs()? * -1.0)?;
    let mut qm = vec![1u8; 15];
    qm[5..10].fill(0); // query 1 fully masked
    let mut dm = vec![1u8; 24];
    dm[12..18].fill(0); // doc 2 fully masked
    dm[0] = 0;
    let qm = Tensor::from_vec(qm, (3, 5), &dev)?;
    let dm = Tensor::from_vec(dm, (4, 6), &dev)?;
    let out = ms::maxsim(&q, &d, Some(&qm), Some(&dm))?;
    let v: Vec<Vec<f32>> = out.to_vec2()?;
    for (i, row) in v.iter().enumerate() {
        for (j, &s) in row.iter().enumerate() {
            if i == 1 || j == 2 {
                assert_eq!(s, 0.0, "({i},{j}) should be exactly 0");
            } else {
                assert!(s < 0.0, "({i},{j}) = {s}: masked tokens must not win");
            }
        }
    }
    assert_close("masked", &out, &r::maxsim(&q, &d, Some(&qm), Some(&dm))?, 1e-5)
}

#[test]
fn ties_pick_lowest_index() -> Result<()> {
    let dev = Device::Cpu;
    // Every doc token identical: the gradient must land on token 0 only.
    let q = candle_core::Var::from_tensor(&randn(&[1, 2, 8], DType::F32, &dev)?)?;
    let row = randn(&[1, 1, 8], DType::F32, &dev)?;
    let d = candle_core::Var::from_tensor(&row.repeat((1, 4, 1))?)?;
    let s = ms::maxsim(q.as_tensor(), d.as_tensor(), None, None)?;
    let g = s.sum_all()?.backward()?;
    let gd = g.get(d.as_tensor()).unwrap();
    let per_token: Vec<f32> = gd.abs()?.sum(2)?.i(0)?.to_vec1()?;
    assert!(per_token[0] > 0.0 && per_token[1..].iter().all(|&x| x == 0.0), "{per_token:?}");
    Ok(())
}

#[test]
fn kd_layout() -> Result<()> {
    let dev = Device::Cpu;
    for dt in DTYPES {
        let q = randn(&[3, 7, 40], dt, &dev)?;
        let d = randn(&[3, 4, 11, 40], dt, &dev)?;
        let qm = rand_mask(&[3, 7], 0.2, &dev)?;
        let dm = rand_mask(&[3, 4, 11], 0.2, &dev)?;
        let out = ms::maxsim(&q, &d, Some(&qm), Some(&dm))?;
        assert_eq!(out.dims(), &[3, 4]);
        assert_close("kd", &out, &r::maxsim(&q, &d, Some(&qm), Some(&dm))?, tol(dt))?;
    }
    Ok(())
}

#[test]
fn pairs_layout() -> Result<()> {
    let dev = Device::Cpu;
    for dt in DTYPES {
        let q = randn(&[5, 7, 33], dt, &dev)?;
        let d = randn(&[5, 12, 33], dt, &dev)?;
        let qm = rand_mask(&[5, 7], 0.2, &dev)?;
        let dm = rand_mask(&[5, 12], 0.2, &dev)?;
        let out = ms::maxsim_pairs(&q, &d, Some(&qm), Some(&dm))?;
        assert_close("pairs", &out, &r::maxsim_pairs(&q, &d, Some(&qm), Some(&dm))?, tol(dt))?;
    }
    Ok(())
}

#[test]
fn normalize_option() -> Result<()> {
    let dev = Device::Cpu;
    let opts = MaxSimOptions { normalize: true, ..Default::default() };
    for dt in DTYPES {
        let q = randn(&[3, 6, 32], dt, &dev)?;
        let d = randn(&[4, 9, 32], dt, &dev)?;
        let out = ms::maxsim_with(&q, &d, None, None, &opts)?;
        assert_close("normalize", &out, &r::maxsim_with(&q, &d, None, None, &opts)?, tol(dt).max(1e-5))?;
    }
    Ok(())
}

fn packed(n: usize, max: usize, dim: usize, seed: u64, dt: DType) -> Result<(Tensor, Tensor, usize)> {
    let (cu, longest) = rand_offsets(n, max, seed);
    let rows = *cu.last().unwrap() as usize;
    let x = randn(&[rows, dim], dt, &Device::Cpu)?;
    Ok((x, Tensor::new(cu, &Device::Cpu)?, longest))
}

#[test]
fn varlen_and_packed_pairs() -> Result<()> {
    for dt in DTYPES {
        let (q, cu_q, lq) = packed(6, 20, 48, 1, dt)?;
        let (d, cu_d, ld) = packed(9, 60, 48, 2, dt)?;
        let out = ms::maxsim_varlen(&q, &cu_q, lq + 3, &d, &cu_d, ld)?;
        let want = r::maxsim_varlen(&q, &cu_q, lq + 3, &d, &cu_d, ld)?;
        assert_close("varlen", &out, &want, tol(dt))?;
        let pq = Tensor::new(&[0u32, 5, 3, 3, 1, 0], &Device::Cpu)?;
        let pd = Tensor::new(&[8u32, 0, 3, 4, 1, 8], &Device::Cpu)?;
        let out = ms::score_pairs_packed(&q, &cu_q, lq, &d, &cu_d, ld, &pq, &pd)?;
        let want = r::score_pairs_packed(&q, &cu_q, lq, &d, &cu_d, ld, &pq, &pd)?;
        assert_close("pairs packed", &out, &want, tol(dt))?;
    }
    Ok(())
}

#[test]
fn empty_batches() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[0, 4, 16], DType::F32, &dev)?;
    let d = randn(&[3, 5, 16], DType::F32, &dev)?;
    assert_eq!(ms::maxsim(&q, &d, None, None)?.dims(), &[0, 3]);
    let q = randn(&[2, 4, 16], DType::F32, &dev)?;
    let d = randn(&[0, 5, 16], DType::F32, &dev)?;
    assert_eq!(ms::maxsim(&q, &d, None, None)?.dims(), &[2, 0]);
    let d = randn(&[3, 0, 16], DType::F32, &dev)?; // Ld = 0: every doc empty
    assert_eq!(ms::maxsim(&q, &d, None, None)?.to_vec2::<f32>()?, vec![vec![0f32; 3]; 2]);
    Ok(())
}

#[test]
fn from_hidden() -> Result<()> {
    let dev = Device::Cpu;
    for dt in DTYPES {
        for normalize in [false, true] {
            let q = randn(&[3, 5, 24], dt, &dev)?;
            let h = randn(&[4, 9, 40], dt, &dev)?;
            let w = (randn(&[24, 40], dt, &dev)? * 0.2)?;
            let b = randn(&[24], dt, &dev)?;
            let dm = rand_mask(&[4, 9], 0.2, &dev)?;
            let out = ms::maxsim_from_hidden(&q, &h, &w, Some(&b), Some(&dm), normalize)?;
            let want = r::maxsim_from_hidden(&q, &h, &w, Some(&b), Some(&dm), normalize)?;
            // Half precision rounds the projected tokens: allow for the extra rounding.
            let t = if dt == DType::F32 { 1e-5 } else { 3e-2 };
            assert_close("from_hidden", &out, &want, t)?;
        }
    }
    Ok(())
}

#[test]
fn retrieve_top_k() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[3, 6, 32], DType::F32, &dev)?;
    let d = randn(&[50, 10, 32], DType::F32, &dev)?;
    let dm = rand_mask(&[50, 10], 0.2, &dev)?;
    for (k, chunk) in [(5, 7), (50, 16), (80, 50), (1, 1)] {
        let (s, i) = ms::retrieve(&q, &d, None, Some(&dm), k, chunk)?;
        let (ws, wi) = r::retrieve(&q, &d, None, Some(&dm), k)?;
        assert_eq!(i.to_vec2::<u32>()?, wi.to_vec2::<u32>()?, "k={k} chunk={chunk}");
        assert_close("retrieve", &s, &ws, 1e-5)?;
    }
    // Equal scores keep the lower document index first.
    let d = randn(&[1, 10, 32], DType::F32, &dev)?.repeat((6, 1, 1))?;
    let (_, i) = ms::retrieve(&q, &d, None, None, 4, 4)?;
    assert_eq!(i.to_vec2::<u32>()?[0], vec![0, 1, 2, 3]);
    Ok(())
}

#[test]
fn layers() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[2, 5, 16], DType::F32, &dev)?;
    let d = randn(&[3, 7, 16], DType::F32, &dev)?;
    let mut m = vec![1u8; 21];
    m[7..14].fill(0);
    let dm = Tensor::from_vec(m, (3, 7), &dev)?;
    let s: Vec<Vec<f32>> = ms::MaxSim.forward(&q, &d, None, Some(&dm))?.to_vec2()?;
    let f: Vec<Vec<f32>> = ms::maxsim(&q, &d, None, Some(&dm))?.to_vec2()?;
    for i in 0..2 {
        assert_eq!(s[i][1], -1e9);
        assert_eq!(s[i][0], f[i][0]);
        assert_eq!(s[i][2], f[i][2]);
    }
    let d2 = randn(&[2, 7, 16], DType::F32, &dev)?;
    let dm2 = Tensor::from_vec([vec![0u8; 7], vec![1u8; 7]].concat(), (2, 7), &dev)?;
    let p: Vec<f32> = ms::MaxSimPairwise.forward(&q, &d2, None, Some(&dm2))?.to_vec1()?;
    let want: Vec<f32> = r::maxsim_pairs(&q, &d2, None, Some(&dm2))?.to_vec1()?;
    assert_eq!(p[0], -1e9);
    assert!((p[1] - want[1]).abs() < 1e-4);
    Ok(())
}

#[test]
fn empty_kd_and_retrieve() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn(&[2, 4, 16], DType::F32, &dev)?;
    assert_eq!(ms::maxsim(&q, &randn(&[2, 0, 5, 16], DType::F32, &dev)?, None, None)?.dims(), &[2, 0]);
    let (s, i) = ms::retrieve(&q, &randn(&[0, 5, 16], DType::F32, &dev)?, None, None, 3, 8)?;
    assert_eq!((s.dims(), i.dims()), (&[2usize, 0][..], &[2usize, 0][..]));
    Ok(())
}
