//! `PlaidIndex`: indexes written here in fast-plaid's on-disk format (both its
//! per-chunk and its merged layout) against `reference`, bad indexes and bad
//! arguments, and the fixture written by the real fast-plaid package
//! (tests/fixtures/make_plaid_fixture.py) when it is present. Each check
//! runs on the CPU and, under the `cuda` feature, on the GPU.

mod support;

use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim::{self as ms, reference as r};
use candle_maxsim_plaid::PlaidIndex;
use candle_maxsim_testing::*;
use std::path::Path;
use support::*;

/// Exact scores `[Nq, Nd]` from `reference`: decompress, normalize, pad, MaxSim.
fn reference_scores(s: &Synth, q: &Tensor) -> Result<Tensor> {
    let d = ms::l2_normalize(&r::residual::decompress(&s.codes, &s.residuals, &s.codec)?)?;
    let mut cu = vec![0u32];
    for &l in &s.lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    let max_len = *s.lens.iter().max().unwrap();
    let (dp, dm) = r::pad_packed(&d, &Tensor::new(cu, &Device::Cpu)?, max_len)?;
    r::maxsim(&ms::l2_normalize(q)?, &dp, None, Some(&dm))
}

/// Top-k of each row of `scores` over the candidate columns `ids` (best first, ties by lower id).
fn top_k(scores: &Tensor, ids: &[u32], k: usize) -> Result<Vec<Vec<(f32, u32)>>> {
    let rows: Vec<Vec<f32>> = scores.to_vec2()?;
    Ok(rows
        .iter()
        .map(|row| {
            let mut v: Vec<(f32, u32)> = ids.iter().map(|&j| (row[j as usize], j)).collect();
            v.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
            v.truncate(k);
            v
        })
        .collect())
}

fn check_search(idx: &PlaidIndex, q: &Tensor, want: &Tensor, k: usize, subset: Option<&[u32]>) -> Result<()> {
    // The CPU sums in the reference's order up to f32 rounding; the GPU in its own.
    let tol = if idx.device().is_cpu() { 1e-5 } else { 1e-4 };
    let all: Vec<u32> = (0..idx.num_documents() as u32).collect();
    let mut cand = subset.map(|s| s.to_vec()).unwrap_or(all);
    cand.sort_unstable();
    cand.dedup();
    let want = top_k(want, &cand, k)?;
    let (scores, ids) = idx.search_exact(&q.to_device(idx.device())?, k, subset)?;
    assert_eq!(scores.dims(), &[q.dim(0)?, k.min(cand.len())]);
    let (scores, ids): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (scores.to_vec2()?, ids.to_vec2()?);
    for (qi, w) in want.iter().enumerate() {
        assert_eq!(ids[qi], w.iter().map(|x| x.1).collect::<Vec<_>>(), "query {qi}: top-{k} ids, subset {subset:?}");
        for (p, &(s, _)) in w.iter().enumerate() {
            assert!(
                (scores[qi][p] - s).abs() <= tol * s.abs().max(1.0),
                "query {qi} rank {p}: {} vs {s}",
                scores[qi][p]
            );
        }
    }
    Ok(())
}

/// Search, decompression and the loaded arrays of indexes in both of
/// fast-plaid's layouts, loaded on `dev`, against `reference` on the CPU.
fn index_matches_reference(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for nbits in [2usize, 4] {
        for layout in [Layout::Shards, Layout::Merged] {
            let s = write_index(&format!("ok_{nbits}_{layout:?}"), nbits, &[7, 1, 5], layout)?;
            let idx = PlaidIndex::load(&s.dir, dev)?;
            assert_eq!(idx.num_documents(), s.lens.len());
            assert_eq!(idx.dim(), 32);
            assert_eq!(idx.doc_lens(), s.lens.iter().map(|&l| l as u32).collect::<Vec<_>>());
            assert_eq!(
                idx.codes.to_vec1::<u32>()?,
                s.codes.to_dtype(DType::U32)?.to_vec1::<u32>()?,
                "{layout:?} codes"
            );
            assert_eq!(idx.residuals.to_vec2::<u8>()?, s.residuals.to_vec2::<u8>()?, "{layout:?} residuals");
            assert!(idx.bucket_cutoffs.is_some() && idx.avg_residual.is_some());
            // Decompression of every document vs the reference decoder.
            let dense = ms::l2_normalize(&r::residual::decompress(&s.codes, &s.residuals, &s.codec)?)?;
            let mut at = 0;
            for (doc, &len) in s.lens.iter().enumerate() {
                let e = idx.embeddings(doc)?;
                assert_eq!(e.dims(), &[len, 32]);
                if len > 0 {
                    assert_close(&format!("doc {doc} embeddings"), &e, &dense.narrow(0, at, len)?, 1e-6)?;
                }
                at += len;
            }
            let q = randn(&[3, 5, 32], DType::F32, &cpu)?;
            let want = reference_scores(&s, &q)?;
            let nd = idx.num_documents() as u32;
            for k in [1, 4, 100] {
                check_search(&idx, &q, &want, k, None)?;
            }
            check_search(&idx, &q, &want, 3, Some(&[nd - 1, 2, 0, 2, 5]))?;
            check_search(&idx, &q, &want, 10, Some(&[4, 5, 6]))?;
            let (e, _) = idx.search_exact(&q.to_device(dev)?, 3, Some(&[]))?;
            assert_eq!(e.dims(), &[3, 0]);
        }
    }
    Ok(())
}

test_device!(index_matches_reference, index_matches_reference_cpu, index_matches_reference_cuda);

/// Bad arguments and corrupted index files: each an `Err` naming the argument or the file.
fn index_errors(dev: &Device) -> Result<()> {
    let dev = dev.clone();
    let s = write_index(&format!("errors_{}", dev.is_cuda()), 2, &[4, 3], Layout::Shards)?;
    let idx = PlaidIndex::load(&s.dir, &dev)?;
    let q = randn(&[2, 3, 32], DType::F32, &dev)?;
    expect_err(idx.search_exact(&q, 0, None), "k");
    expect_err(idx.search_exact(&q, 2, Some(&[0, 99])), "subset");
    expect_err(idx.search_exact(&randn(&[2, 3, 16], DType::F32, &dev)?, 2, None), "q");
    expect_err(idx.search_exact(&q.to_dtype(DType::U32)?, 2, None), "q");
    expect_err(idx.embeddings(99), "doc");
    expect_err_containing(PlaidIndex::load(s.dir.join("nope"), &dev), "metadata.json");

    // Each corruption is an Err naming the file at fault.
    let corrupt = |name: &str, file: &str, f: &dyn Fn(&Path)| -> Result<()> {
        let s = write_index(&format!("{name}_{}", dev.is_cuda()), 2, &[4, 3], Layout::Shards)?;
        f(&s.dir);
        expect_err_containing(PlaidIndex::load(&s.dir, &dev), file);
        Ok(())
    };
    corrupt("missing_res", "1.residuals.npy", &|d| std::fs::remove_file(d.join("1.residuals.npy")).unwrap())?;
    corrupt("bad_code", "1.codes.npy", &|d| {
        let c = Tensor::read_npy(d.join("1.codes.npy")).unwrap();
        let mut v = c.to_vec1::<i64>().unwrap();
        v[0] = 24;
        Tensor::new(v, &Device::Cpu).unwrap().write_npy(d.join("1.codes.npy")).unwrap()
    })?;
    corrupt("short_chunk", "0.codes.npy", &|d| {
        let c = Tensor::read_npy(d.join("0.codes.npy")).unwrap();
        c.narrow(0, 1, c.dim(0).unwrap() - 1).unwrap().write_npy(d.join("0.codes.npy")).unwrap()
    })?;
    corrupt("bad_doclens", "doclens.1.json", &|d| std::fs::write(d.join("doclens.1.json"), "[1, -2]").unwrap())?;
    corrupt("bad_meta", "num_documents", &|d| {
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("metadata.json")).unwrap()).unwrap();
        v["num_documents"] = 1000.into();
        write_json(&d.join("metadata.json"), &v);
    })?;
    corrupt("bad_nbits", "nbits", &|d| {
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("metadata.json")).unwrap()).unwrap();
        v["nbits"] = 3.into();
        write_json(&d.join("metadata.json"), &v);
    })?;
    corrupt("bad_width", "dim·nbits/8", &|d| {
        let rows = Tensor::read_npy(d.join("0.residuals.npy")).unwrap().dim(0).unwrap();
        Tensor::zeros((rows, 4), DType::U8, &Device::Cpu).unwrap().write_npy(d.join("0.residuals.npy")).unwrap()
    })?;
    Ok(())
}

test_device!(index_errors, index_errors_cpu, index_errors_cuda);

/// The fast-plaid fixtures loaded on `dev` search as on the CPU.
fn fixture_search_matches_cpu(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    for dir in ["nb2", "nb4", "fp146"].into_iter().filter_map(fixture).map(|d| d.join("index")) {
        let (ic, ig) = (PlaidIndex::load(&dir, &cpu)?, PlaidIndex::load(&dir, dev)?);
        let q = randn(&[3, 16, ic.dim()], DType::F32, &cpu)?;
        let subset: Vec<u32> = (0..ic.num_documents() as u32).step_by(2).collect();
        for sub in [None, Some(subset.as_slice())] {
            let (sc, idc) = ic.search_exact(&q, 5, sub)?;
            let (sg, idg) = ig.search_exact(&q.to_device(dev)?, 5, sub)?;
            assert_close(&format!("{} search scores", dir.display()), &sg, &sc, 1e-4)?;
            assert_eq!(idg.to_device(&cpu)?.to_vec2::<u32>()?, idc.to_vec2::<u32>()?, "{} search ids", dir.display());
        }
        assert_close("embeddings", &ig.embeddings(1)?, &ic.embeddings(1)?, 1e-6)?;
    }
    Ok(())
}

test_device!(fixture_search_matches_cpu, fixture_search_matches_cpu_cpu, fixture_search_matches_cpu_cuda);

// ---------------------------------------------------------------------------
// The fixture written by the real fast-plaid package.
// ---------------------------------------------------------------------------

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// fast-plaid computes in F16 (centroids, bucket weights, queries, scores):
/// the tolerance of one of its MaxSim scores of 32 query tokens.
fn fp16_score_tol(score: f32) -> f32 {
    5e-3 + 1.5e-3 * score.abs()
}

/// Our decompression reproduces fast-plaid's `get_embeddings` (decompressed, L2-normalized, F16 math).
#[test]
fn fast_plaid_fixture_decompression() -> Result<()> {
    for name in ["nb2", "nb4", "fp146"] {
        let Some(dir) = fixture(name) else { continue };
        let idx = PlaidIndex::load(dir.join("index"), &Device::Cpu)?;
        let ids: Vec<usize> = serde_json::from_value(read_json(&dir.join("expected/embeddings_ids.json"))).unwrap();
        let theirs = Tensor::read_npy(dir.join("expected/embeddings.npy"))?.to_dtype(DType::F32)?;
        let mut at = 0;
        let mut worst = 0f32;
        for &doc in &ids {
            let ours = idx.embeddings(doc)?;
            let len = ours.dim(0)?;
            let diff = (ours - theirs.narrow(0, at, len)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            worst = worst.max(diff);
            at += len;
        }
        assert_eq!(at, theirs.dim(0)?, "{name}: token count of the expected embeddings");
        eprintln!("{name}: {} documents, max |ours - fast-plaid| = {worst:e}", ids.len());
        assert!(worst < 2e-3, "{name}: decompressed embeddings differ from fast-plaid's by {worst}");
    }
    Ok(())
}

/// Checks our ranking `ours` (ids, scores, best first) against fast-plaid's:
/// every document it returns has our score within its F16 tolerance, and at
/// every rank we return its document or one whose score is within that
/// tolerance of it (a near-tie).
/// Returns (ranks where the documents are identical, largest score difference).
fn check_ranking(what: &str, ours: (&[u32], &[f32]), theirs: (&[u32], &[f32]), all: &[f32]) -> (usize, f32) {
    assert_eq!(ours.0.len(), theirs.0.len(), "{what}: result count");
    let (mut exact, mut worst) = (0, 0f32);
    for (p, (&id, &s)) in theirs.0.iter().zip(theirs.1).enumerate() {
        let mine = all[id as usize];
        worst = worst.max((mine - s).abs());
        assert!((mine - s).abs() <= fp16_score_tol(s), "{what}: doc {id} (rank {p}) scores {mine}, fast-plaid {s}");
        let other = ours.0[p];
        assert!(
            other == id || (all[other as usize] - mine).abs() <= 2.0 * fp16_score_tol(s),
            "{what}: rank {p} is doc {other} ({}) for us, doc {id} ({mine}) for fast-plaid",
            all[other as usize]
        );
        exact += (other == id) as usize;
        assert!((ours.1[p] - all[other as usize]).abs() < 1e-6);
    }
    (exact, worst)
}

/// Our exact scores rank the documents as fast-plaid's (exhaustive) search does.
#[test]
fn fast_plaid_fixture_ranking() -> Result<()> {
    for name in ["nb2", "nb4", "fp146"] {
        let Some(dir) = fixture(name) else { continue };
        let idx = PlaidIndex::load(dir.join("index"), &Device::Cpu)?;
        let q = Tensor::read_npy(dir.join("expected/queries.npy"))?.to_dtype(DType::F32)?;
        let exp = read_json(&dir.join("expected/search.json"));
        let list = |k: &str| -> Vec<Vec<serde_json::Value>> { serde_json::from_value(exp[k].clone()).unwrap() };
        let nd = idx.num_documents();
        // Every document's exact score, per query.
        let (all_s, all_i) = idx.search_exact(&q, nd, None)?;
        let (all_s, all_i): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (all_s.to_vec2()?, all_i.to_vec2()?);
        let by_id: Vec<Vec<f32>> = all_s
            .iter()
            .zip(&all_i)
            .map(|(s, i)| {
                let mut v = vec![0f32; nd];
                i.iter().zip(s).for_each(|(&j, &x)| v[j as usize] = x);
                v
            })
            .collect();
        let subset: Vec<u32> = serde_json::from_value(exp["subset"].clone()).unwrap();
        let (sub_s, sub_i) = idx.search_exact(&q, exp["subset_top_k"].as_u64().unwrap() as usize, Some(&subset))?;
        let (sub_s, sub_i): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (sub_s.to_vec2()?, sub_i.to_vec2()?);
        let (ids, scores, s_ids, s_scores) = (list("ids"), list("scores"), list("subset_ids"), list("subset_scores"));
        let as_u32 = |v: &[serde_json::Value]| v.iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let as_f32 = |v: &[serde_json::Value]| v.iter().map(|x| x.as_f64().unwrap() as f32).collect::<Vec<_>>();
        let (mut exact, mut total, mut worst) = (0, 0, 0f32);
        for qi in 0..q.dim(0)? {
            let (ti, ts) = (as_u32(&ids[qi]), as_f32(&scores[qi]));
            let k = ti.len();
            assert_eq!(k, nd, "{name}: the fixture ranks every document");
            let (e, w) = check_ranking(&format!("{name} q{qi}"), (&all_i[qi], &all_s[qi]), (&ti, &ts), &by_id[qi]);
            (exact, worst) = (exact + e, worst.max(w));
            total += k;
            let (ti, ts) = (as_u32(&s_ids[qi]), as_f32(&s_scores[qi]));
            assert!(ti.iter().all(|i| subset.contains(i)), "{name} q{qi}: fast-plaid's subset results");
            check_ranking(&format!("{name} q{qi} subset"), (&sub_i[qi], &sub_s[qi]), (&ti, &ts), &by_id[qi]);
        }
        eprintln!(
            "{name}: {exact}/{total} ranks identical to fast-plaid's, the rest near-ties; \
             max score difference {worst:e}"
        );
    }
    Ok(())
}
