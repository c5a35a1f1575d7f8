//! PLAID's centroid-only approximate score (src/ops/plaid_approx.rs)
//! against `reference` on the CPU.

use crate::common::*;
use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r};

/// The op on `dev` (inputs on the CPU), returned on the CPU.
fn approx_on(dev: &Device, qcs: &Tensor, codes: &Tensor, lens: &Tensor) -> Result<Tensor> {
    ms::plaid::plaid_approx_score(&qcs.to_device(dev)?, &codes.to_device(dev)?, &lens.to_device(dev)?)?
        .to_device(&Device::Cpu)
}

/// Empty and full documents, U32 and I64 codes, a narrowed (offset)
/// doc_lens view, an empty batch. On CUDA also query lengths that take
/// every kernel variant (the row kernel with full and partial lane groups;
/// the general kernel's 16-byte and scalar row loads, 8/16/32 lanes per
/// row, chunks of query tokens), rows that are not 16-byte aligned,
/// transposed codes, padding codes that are never read, and the benchmark
/// shape.
fn plaid_approx_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let qcs = randn(&[40, 8], DType::F32, &cpu)?;
    let codes = Tensor::rand(0f32, 40., (9, 16), &cpu)?.to_dtype(DType::U32)?;
    let lens = Tensor::new(&[16u32, 3, 0, 1, 16, 9, 12, 2, 5], &cpu)?;
    let want = r::plaid::plaid_approx_score(&qcs, &codes, &lens)?;
    let out = approx_on(dev, &qcs, &codes, &lens)?;
    assert_close("plaid approx", &out, &want, 1e-6)?;
    assert_eq!(out.to_vec1::<f32>()?[2], 0.0, "an empty document scores exactly 0");
    let out64 = approx_on(dev, &qcs, &codes.to_dtype(DType::I64)?, &lens)?;
    assert_close("plaid approx i64", &out64, &want, 1e-6)?;
    // A narrowed (offset) doc_lens view.
    let qcs = randn(&[10, 3], DType::F32, &cpu)?;
    let codes = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &cpu)?;
    let lens = Tensor::new(&[9u32, 3, 1], &cpu)?;
    let out = ms::plaid::plaid_approx_score(
        &qcs.to_device(dev)?,
        &codes.to_device(dev)?,
        &lens.to_device(dev)?.narrow(0, 1, 2)?,
    )?;
    assert_close(
        "narrowed doc_lens",
        &out,
        &r::plaid::plaid_approx_score(&qcs, &codes, &lens.narrow(0, 1, 2)?)?,
        1e-6,
    )?;
    // An empty batch.
    let e = ms::plaid::plaid_approx_score(
        &qcs.to_device(dev)?,
        &codes.to_device(dev)?.narrow(0, 0, 0)?,
        &lens.to_device(dev)?.narrow(0, 0, 0)?,
    )?;
    assert_eq!(e.dims(), &[0]);
    if gpu_cases(dev) {
        kernel_variants_match_reference(dev)?;
        bench_shape_matches_reference(dev)?;
    }
    Ok(())
}

test_device!(plaid_approx_matches_reference, plaid_approx_matches_reference_cpu, plaid_approx_matches_reference_cuda);

fn kernel_variants_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (n_c, lq, b, ld) in [
        (300, 32, 67, 64),
        (50, 7, 33, 20),
        (1000, 128, 40, 100),
        (200, 64, 50, 40),
        (64, 33, 21, 5),
        (9, 1, 10, 3),
        // The row kernel with lanes left out of each group (Lq / 4 = 1, 3, 5, 15).
        (100, 4, 30, 33),
        (500, 12, 40, 70),
        (70, 20, 25, 40),
        (100, 60, 30, 40),
    ] {
        for (lq, misaligned) in [(lq, false), (lq, true), (lq + 68, false)] {
            // A view that starts one element into its buffer: rows are not 16-byte aligned.
            let qcs = if misaligned {
                randn(&[n_c * lq + 1], DType::F32, &cpu)?.narrow(0, 1, n_c * lq)?.reshape((n_c, lq))?
            } else {
                randn(&[n_c, lq], DType::F32, &cpu)?
            };
            let mut lens: Vec<u32> = (0..b as u32).map(|i| (i * 7919) % (ld as u32 + 1)).collect();
            lens[0] = 0;
            lens[1] = ld as u32;
            let codes = Tensor::rand(0f32, n_c as f32, (b, ld), &cpu)?.to_dtype(DType::U32)?;
            // I64 codes with -1 past each length (fast-plaid's padding): never read.
            let padded: Vec<i64> = codes
                .flatten_all()?
                .to_vec1::<u32>()?
                .iter()
                .enumerate()
                .map(|(k, &c)| if (k % ld) as u32 >= lens[k / ld] { -1 } else { c as i64 })
                .collect();
            let codes64 = Tensor::from_vec(padded, (b, ld), &cpu)?;
            let lens = Tensor::new(lens, &cpu)?;
            let what = format!("plaid approx C{n_c} lq{lq} b{b} ld{ld} misaligned={misaligned}");
            let want = r::plaid::plaid_approx_score(&qcs, &codes, &lens)?;
            for c in [&codes, &codes64] {
                let out = approx_on(dev, &qcs, c, &lens)?;
                assert_close(&format!("{what} {:?}", c.dtype()), &out, &want, 1e-4)?;
                assert_eq!(out.to_vec1::<f32>()?[0], 0.0, "{what}: an empty document scores exactly 0");
            }
            // Non-contiguous codes: a transposed view.
            let ct = codes.t()?.contiguous()?.t()?;
            assert_close(&format!("{what} transposed codes"), &approx_on(dev, &qcs, &ct, &lens)?, &want, 1e-4)?;
        }
    }
    Ok(())
}

/// The benchmark shape: 65 536 centroids, Lq 32, 100 000 documents of up
/// to 64 codes. Documents score independently: the reference scores every
/// 5th (20 000 of them) and the last.
fn bench_shape_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let (n_c, lq, b, ld) = (65536, 32, 100_000, 64);
    let qcs = randn(&[n_c, lq], DType::F32, &cpu)?;
    let codes = Tensor::rand(0f32, n_c as f32, (b, ld), &cpu)?.to_dtype(DType::U32)?.to_dtype(DType::I64)?;
    let lens = Tensor::rand(0f32, ld as f32 + 1.0, b, &cpu)?.to_dtype(DType::U32)?.clamp(0u32, ld as u32)?;
    let out = approx_on(dev, &qcs, &codes, &lens)?;
    let pick: Vec<u32> = (0..b as u32).step_by(5).chain([b as u32 - 1]).collect();
    let pick = Tensor::new(pick, &cpu)?;
    let want = r::plaid::plaid_approx_score(&qcs, &codes.index_select(&pick, 0)?, &lens.index_select(&pick, 0)?)?;
    assert_close("plaid approx bench shape", &out.index_select(&pick, 0)?, &want, 1e-4)
}

/// Inputs full of near-ties: many scores a hair apart, exact ties, repeated
/// codes, documents of up to 200 codes, query lengths from 16 to 520, a
/// table of one value, and a table whose range overflows f32 (in a row no
/// document uses): a hard parity test of the gather kernels.
fn plaid_approx_near_ties_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for (n_c, lq, b, ld) in [
        (40, 16, 300, 200),
        (64, 20, 200, 64),
        (50, 40, 100, 130),
        (30, 100, 60, 33),
        (20, 300, 20, 9),
        (16, 520, 10, 7),
    ] {
        // Few levels, each with nearby distinct values: the same byte, different floats.
        let levels = (randn(&[n_c, lq], DType::F32, &cpu)? * 2.0)?.round()?;
        let jitter = (randn(&[n_c, lq], DType::F32, &cpu)? * 1e-3)?;
        let ties = Tensor::rand(0f32, 1., (n_c, lq), &cpu)?.ge(0.5)?.to_dtype(DType::F32)?;
        let tables = [
            ("levels", (&levels + jitter.mul(&ties)?)?),
            ("one value", Tensor::full(0.25f32, (n_c, lq), &cpu)?),
            ("overflowing range", levels.slice_assign(&[0..1, 0..2], &Tensor::new(&[[3e38f32, -3e38]], &cpu)?)?),
        ];
        let lens: Vec<u32> = (0..b as u32).map(|i| 1 + (i * 7919) % ld as u32).collect();
        let lens = Tensor::new(lens, &cpu)?;
        // Few centroids for many tokens: repeated codes. Code 0 is never used.
        let codes = Tensor::rand(1f32, n_c as f32, (b, ld), &cpu)?.to_dtype(DType::U32)?.clamp(1u32, n_c as u32 - 1)?;
        for (what, qcs) in &tables {
            let want = r::plaid::plaid_approx_score(qcs, &codes, &lens)?;
            for c in [codes.clone(), codes.to_dtype(DType::I64)?] {
                let out = approx_on(dev, qcs, &c, &lens)?;
                assert_close(&format!("{what} C{n_c} lq{lq} b{b} ld{ld} {:?}", c.dtype()), &out, &want, 1e-4)?;
            }
        }
    }
    Ok(())
}

test_device!(
    plaid_approx_near_ties_match_reference,
    plaid_approx_near_ties_match_reference_cpu,
    plaid_approx_near_ties_match_reference_cuda
);

/// A random packed index: `(codes [T] U32, cu_d [Nd+1], ivf [E], ivf_offsets [C+1])`,
/// the inverted file built from the codes (each centroid's documents, sorted,
/// unique); documents 0 and 5 are empty.
fn packed_index(n_c: usize, nd: usize, max_len: u32, seed: u64) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let (cu, _) = rand_offsets(nd, max_len as usize, seed);
    let cu: Vec<u32> = {
        // Documents 0 and 5 empty.
        let lens: Vec<u32> =
            cu.windows(2).enumerate().map(|(j, w)| if j == 0 || j == 5 { 0 } else { w[1] - w[0] }).collect();
        std::iter::once(0)
            .chain(lens.iter().scan(0, |a, l| {
                *a += l;
                Some(*a)
            }))
            .collect()
    };
    let t = *cu.last().unwrap() as usize;
    let codes: Vec<u32> = (0..t as u64).map(|i| ((i * 2654435761 + seed * 97) % n_c as u64) as u32).collect();
    let mut lists = vec![Vec::new(); n_c];
    for j in 0..nd {
        for &c in &codes[cu[j] as usize..cu[j + 1] as usize] {
            lists[c as usize].push(j as u32);
        }
    }
    let mut off = vec![0u32];
    let mut ivf = Vec::new();
    for l in &mut lists {
        l.sort_unstable();
        l.dedup();
        ivf.extend_from_slice(l);
        off.push(ivf.len() as u32);
    }
    let cpu = Device::Cpu;
    let n_ivf = ivf.len();
    Ok((
        Tensor::new(codes, &cpu)?,
        Tensor::new(cu, &cpu)?,
        Tensor::from_vec(ivf, n_ivf, &cpu)?,
        Tensor::new(off, &cpu)?,
    ))
}

/// `plaid_candidates` and `plaid_approx_candidates` against `reference`:
/// bitmaps exactly, scores within 1e-6, -inf exactly where a document is
/// not a candidate; repeated probes, a per-query and a shared mask, pruned
/// centroids (rows of -inf), empty documents, U32 and I64 codes, Lq with
/// full and partial lane groups, F32 and F16 tables; on CUDA also an index
/// of 20 000 documents.
fn candidates_match_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let mut cases = vec![(40usize, 70usize, 3usize, 8usize, 6usize), (13, 33, 2, 4, 3), (64, 100, 2, 12, 5)];
    if gpu_cases(dev) {
        cases.extend([(1024, 20_000, 4, 32, 64), (300, 2000, 3, 64, 16), (500, 3000, 2, 20, 8)]);
    }
    let g = |t: &Tensor| t.to_device(dev);
    for (n_c, nd, nq, lq, n_probe) in cases {
        let what = format!("candidates C{n_c} Nd{nd} Nq{nq} Lq{lq}");
        let (codes, cu, ivf, off) = packed_index(n_c, nd, 40, (n_c + nd) as u64)?;
        let probes = Tensor::rand(0f32, n_c as f32, (nq, n_probe), &cpu)?.to_dtype(DType::U32)?;
        // A padding token's probe: nothing.
        let probes = probes.slice_assign(&[0..1, 0..1], &Tensor::new(&[[ms::plaid::NO_CENTROID]], &cpu)?)?;
        let bits = ms::plaid::plaid_candidates(&g(&probes)?, &g(&ivf)?, &g(&off)?, nd)?;
        let want_bits = r::plaid::plaid_candidates(&probes, &ivf, &off, nd)?;
        assert_eq!(bits.to_vec2::<u32>()?, want_bits.to_vec2::<u32>()?, "{what}: bitmap");
        let mut qcs = randn(&[n_c, nq * lq], DType::F32, &cpu)?;
        // Prune centroid 1 for query 0 (its rows -inf).
        let prune = Tensor::ones((n_c, nq * lq), DType::U8, &cpu)?
            .slice_assign(&[1..2, 0..lq], &Tensor::zeros((1, lq), DType::U8, &cpu)?)?;
        qcs = prune.where_cond(&qcs, &Tensor::full(f32::NEG_INFINITY, qcs.shape(), &cpu)?)?;
        let words = nd.div_ceil(32);
        let shared = Tensor::rand(0f32, u32::MAX as f32, (1, words), &cpu)?.to_dtype(DType::U32)?;
        let per_query = Tensor::rand(0f32, u32::MAX as f32, (nq, words), &cpu)?.to_dtype(DType::U32)?;
        // F16 tables: the reference scores the same values widened to F32.
        let half = qcs.to_dtype(DType::F16)?;
        let tables = [(qcs.clone(), qcs.clone()), (half.clone(), half.to_dtype(DType::F32)?)];
        for mask in [None, Some(&shared), Some(&per_query)] {
            for codes in [codes.clone(), codes.to_dtype(DType::I64)?] {
                for (table, wide) in &tables {
                    let what = format!("{what} {:?} {:?} mask {}", table.dtype(), codes.dtype(), mask.is_some());
                    let want = r::plaid::plaid_approx_candidates(wide, lq, &codes, &cu, &want_bits, mask)?;
                    let mg = mask.map(g).transpose()?;
                    let out =
                        ms::plaid::plaid_approx_candidates(&g(table)?, lq, &g(&codes)?, &g(&cu)?, &bits, mg.as_ref())?;
                    let (ov, wv): (Vec<f32>, Vec<f32>) =
                        (out.flatten_all()?.to_vec1()?, want.flatten_all()?.to_vec1()?);
                    let mut n_cand = 0;
                    for (o, w) in ov.iter().zip(&wv) {
                        assert_eq!(o.is_finite(), w.is_finite(), "{what}: {o} vs {w}");
                        if w.is_finite() {
                            n_cand += 1;
                            assert!((o - w).abs() <= 1e-5 * w.abs().max(1.0), "{what}: {o} vs {w}");
                        }
                    }
                    assert!(n_cand > 0, "{what}: some candidates");
                }
            }
        }
    }
    Ok(())
}

test_device!(candidates_match_reference, candidates_match_reference_cpu, candidates_match_reference_cuda);

/// Bad inverted files, offsets, codes and probes: an error naming the
/// argument, from the op itself and from the end of a `deferred_checks`
/// scope (where the first bad op's error comes back after the later ops
/// ran); a good pipeline in a scope gives the same results as outside.
fn candidate_errors_name_the_argument(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let (n_c, nd, nq, lq) = (50usize, 80usize, 2usize, 8usize);
    let (codes, cu, ivf, off) = packed_index(n_c, nd, 30, 7)?;
    let g = |t: &Tensor| t.to_device(dev);
    let probes = Tensor::rand(0f32, n_c as f32, (nq, 6), &cpu)?.to_dtype(DType::U32)?;
    let qcs = randn(&[n_c, nq * lq], DType::F32, dev)?;
    let set = |t: &Tensor, i: usize, v: u32| -> Result<Tensor> {
        let mut x: Vec<u32> = t.flatten_all()?.to_vec1()?;
        x[i] = v;
        Tensor::from_vec(x, t.shape(), &cpu)
    };
    // Every list names at least one document: a probe of centroid 0 reads ivf[0].
    let probes0 = set(&probes, 0, 0)?;
    let n_ivf = ivf.dim(0)?;
    // A non-empty candidate document of query 0, whose code and offset go bad below.
    let words: Vec<u32> = r::plaid::plaid_candidates(&probes0, &ivf, &off, nd)?.get(0)?.to_vec1()?;
    let cu_h: Vec<u32> = cu.to_vec1()?;
    let j = (0..nd).find(|&j| words[j / 32] >> (j % 32) & 1 == 1 && cu_h[j + 1] > cu_h[j]).expect("a candidate");
    let pipeline = |probes: &Tensor, ivf: &Tensor, off: &Tensor, codes: &Tensor, cu: &Tensor| -> Result<Vec<f32>> {
        let bits = ms::plaid::plaid_candidates(&g(probes)?, &g(ivf)?, &g(off)?, nd)?;
        let s = ms::plaid::plaid_approx_candidates(&qcs, lq, &g(codes)?, &g(cu)?, &bits, None)?;
        s.flatten_all()?.to_vec1()
    };
    let cases: Vec<(&str, Tensor, Tensor, Tensor, Tensor, Tensor)> = vec![
        ("probes", set(&probes0, 1, n_c as u32)?, ivf.clone(), off.clone(), codes.clone(), cu.clone()),
        ("ivf", probes0.clone(), set(&ivf, 0, nd as u32 + 3)?, off.clone(), codes.clone(), cu.clone()),
        ("ivf_offsets", probes0.clone(), ivf.clone(), set(&off, 1, n_ivf as u32 + 9)?, codes.clone(), cu.clone()),
        ("codes", probes0.clone(), ivf.clone(), off.clone(), set(&codes, cu_h[j] as usize, n_c as u32)?, cu.clone()),
        ("cu_d", probes0.clone(), ivf.clone(), off.clone(), codes.clone(), set(&cu, j + 1, 100_000)?),
    ];
    let good = pipeline(&probes0, &ivf, &off, &codes, &cu)?;
    let deferred = ms::plaid::deferred_checks(|| pipeline(&probes0, &ivf, &off, &codes, &cu))?;
    assert_eq!(good.len(), deferred.len());
    for (a, b) in good.iter().zip(&deferred) {
        assert!(a.to_bits() == b.to_bits(), "deferred checks change no result: {a} vs {b}");
    }
    for (arg, p, i, o, c, u) in cases {
        for e in [pipeline(&p, &i, &o, &c, &u), ms::plaid::deferred_checks(|| pipeline(&p, &i, &o, &c, &u))] {
            let e = e.expect_err(arg).to_string();
            assert!(e.starts_with(&format!("{arg}:")), "{arg}: {e}");
        }
    }
    Ok(())
}

test_device!(
    candidate_errors_name_the_argument,
    candidate_errors_name_the_argument_cpu,
    candidate_errors_name_the_argument_cuda
);

/// `plaid_subset_centroids` against the inverted file, an independent path
/// (a centroid is used by a subset iff its list names a listed document):
/// repeated ids, empty documents, an empty list; on CUDA also an index of
/// 20 000 documents. Out-of-range ids and codes are errors naming `docs`
/// and `codes`.
fn subset_centroids_match_the_inverted_file(dev: &Device) -> Result<()> {
    let mut cases = vec![(40usize, 70usize, 20usize, 1u64), (13, 33, 50, 2), (300, 500, 0, 3), (64, 100, 1, 5)];
    if gpu_cases(dev) {
        cases.push((4096, 20_000, 3_000, 4));
    }
    let g = |t: &Tensor| t.to_device(dev);
    for (n_c, nd, n_list, seed) in cases {
        let (codes, cu, ivf, off) = packed_index(n_c, nd, 30, seed)?;
        let (cu_h, ivf_h, off_h): (Vec<u32>, Vec<u32>, Vec<u32>) = (cu.to_vec1()?, ivf.to_vec1()?, off.to_vec1()?);
        let max_len = cu_h.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        let offsets = ms::residual::DocOffsets::new(&g(&cu)?, *cu_h.last().unwrap() as usize, max_len)?;
        // Ids drawn with repeats, the empty documents 0 and 5 among them.
        let mut docs: Vec<u32> = (0..n_list as u64).map(|i| ((i * 40503 + seed * 7919) % nd as u64) as u32).collect();
        if n_list > 1 {
            docs[0] = 0;
            docs[1] = 5;
        }
        let set: std::collections::HashSet<u32> = docs.iter().copied().collect();
        let want: Vec<u8> = (0..n_c)
            .map(|c| ivf_h[off_h[c] as usize..off_h[c + 1] as usize].iter().any(|d| set.contains(d)) as u8)
            .collect();
        let list = Tensor::from_vec(docs.clone(), docs.len(), &Device::Cpu)?;
        let got: Vec<u8> = ms::plaid::plaid_subset_centroids(&g(&codes)?, &offsets, &g(&list)?, n_c)?.to_vec1()?;
        assert_eq!(got, want, "{n_c} centroids, {nd} documents, {n_list} listed");
        if n_list > 2 {
            assert!(got.contains(&1), "some centroid used");
        }
        // Errors: an id past the last document; a bad code of a listed document.
        let mut bad = docs.clone();
        bad.push(nd as u32);
        let e = ms::plaid::plaid_subset_centroids(&g(&codes)?, &offsets, &g(&Tensor::new(bad, &Device::Cpu)?)?, n_c);
        assert!(e.expect_err("docs").to_string().starts_with("docs:"));
        if let Some(&j) = docs.iter().find(|&&j| cu_h[j as usize + 1] > cu_h[j as usize]) {
            let mut c: Vec<u32> = codes.to_vec1()?;
            c[cu_h[j as usize] as usize] = n_c as u32;
            let c = Tensor::from_vec(c, codes.dims1()?, &Device::Cpu)?;
            let e = ms::plaid::plaid_subset_centroids(&g(&c)?, &offsets, &g(&list)?, n_c);
            assert!(e.expect_err("codes").to_string().starts_with("codes:"));
        }
    }
    Ok(())
}

test_device!(
    subset_centroids_match_the_inverted_file,
    subset_centroids_match_the_inverted_file_cpu,
    subset_centroids_match_the_inverted_file_cuda
);
