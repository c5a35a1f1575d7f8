//! The PLAID engine: building an index, PLAID search against exhaustive
//! exact search, adding and deleting documents, shards on two devices, and
//! bad indexes and arguments. Each check runs on the CPU and, under the
//! `cuda` feature, on the GPU.

mod support;

use candle_core::{DType, Device, Result, Tensor};
use candle_maxsim_plaid::{create, IndexConfig, PackedDocuments, PlaidIndex, SearchParams, ShardedIndex, Subset};
use candle_maxsim_testing::*;
use support::*;

/// A small clustered collection and an index of it in a fresh directory.
struct Built {
    dir: std::path::PathBuf,
    x: Tensor,
    lens: Vec<u32>,
    index: PlaidIndex,
}

impl Drop for Built {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn build(name: &str, dev: &Device, n_docs: usize, nbits: usize) -> Result<Built> {
    let (x, lens, _) = clustered(n_docs, 64, 40, n_docs as u64)?;
    let dir = temp_dir(&format!("{name}_{}", dev.is_cuda()));
    let docs = PackedDocuments::new(x.clone(), &lens)?;
    let config = IndexConfig { nbits, n_centroids: Some(256), chunk_documents: 70, ..Default::default() };
    let index = create(&dir, &docs, &config, dev)?;
    Ok(Built { dir, x, lens, index })
}

/// Search parameters under which PLAID scores every document exactly.
fn exhaustive(index: &PlaidIndex, top_k: usize) -> SearchParams {
    SearchParams {
        top_k,
        n_ivf_probe: index.num_centroids(),
        n_full_scores: 4 * index.num_documents(),
        ..Default::default()
    }
}

/// `search` results against `search_exact`'s: at each rank the score within
/// `tol`, and the same id unless the two are a tie within `tol` (the two
/// paths score with other arithmetic, so documents whose exact scores
/// differ by less than that may trade places): the id got at that rank has
/// the wanted score there within `tol` (or, past the wanted list, is at
/// its last rank).
fn assert_same(what: &str, got: &[Vec<(u32, f32)>], want: (&Tensor, &Tensor), tol: f32) -> Result<()> {
    let (ws, wi): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (want.0.to_vec2()?, want.1.to_vec2()?);
    for (qi, g) in got.iter().enumerate() {
        assert_eq!(g.len(), wi[qi].len(), "{what}: query {qi} results");
        let close = |a: f32, b: f32| (a - b).abs() <= tol * b.abs().max(1.0);
        for (rank, (r, (&id, &s))) in g.iter().zip(wi[qi].iter().zip(&ws[qi])).enumerate() {
            assert!(close(r.1, s), "{what}: query {qi} rank {rank}: {} vs {s}", r.1);
            if r.0 != id {
                let tie = match wi[qi].iter().position(|&d| d == r.0) {
                    Some(p) => close(ws[qi][p], s),
                    None => rank + 1 == g.len(),
                };
                assert!(tie, "{what}: query {qi} ids {:?} vs {:?}", g.iter().map(|r| r.0).collect::<Vec<_>>(), wi[qi]);
            }
        }
        let mut ids: Vec<u32> = g.iter().map(|r| r.0).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), g.len(), "{what}: query {qi}: an id twice");
    }
    Ok(())
}

fn tol(dev: &Device) -> f32 {
    if dev.is_cuda() {
        1e-4
    } else {
        1e-5
    }
}

/// A built index holds every document, decodes close to the input tokens,
/// and PLAID search (default parameters) ranks each query's source
/// document first; with every centroid probed and every candidate scored it
/// equals the exhaustive exact search, with and without a subset.
fn build_and_search(dev: &Device) -> Result<()> {
    for nbits in [2, 4] {
        let b = build(&format!("build{nbits}"), dev, 300, nbits)?;
        let idx = &b.index;
        assert_eq!(idx.num_documents(), 300);
        assert_eq!(idx.doc_lens(), b.lens);
        // Decompressed tokens are close to the originals (cosine).
        let d0 = idx.embeddings(7)?.to_device(&Device::Cpu)?;
        let start: usize = b.lens[..7].iter().map(|&l| l as usize).sum();
        let orig = b.x.narrow(0, start, b.lens[7] as usize)?;
        let cos = (d0 * &orig)?.sum(1)?.mean_all()?.to_scalar::<f32>()?;
        let floor = if nbits == 2 { 0.85 } else { 0.93 };
        assert!(cos > floor, "nbits {nbits}: mean cosine of decoded tokens {cos}");
        let targets: Vec<usize> = (0..300).step_by(13).collect();
        let q = queries_from(&b.x, &b.lens, &targets, 32, 5)?.to_device(dev)?;
        let res = idx.search(&q, &SearchParams::default(), None)?;
        let hits = res.iter().zip(&targets).filter(|(r, &t)| r.first().map(|x| x.0) == Some(t as u32)).count();
        assert!(
            hits * 10 >= targets.len() * 9,
            "nbits {nbits}: {hits}/{} planted documents ranked first",
            targets.len()
        );
        let want = idx.search_exact(&q, 10, None)?;
        assert_same(
            &format!("nbits {nbits} exhaustive"),
            &idx.search(&q, &exhaustive(idx, 10), None)?,
            (&want.0, &want.1),
            tol(dev),
        )?;
        let subset: Vec<u32> = (0..300).filter(|d| d % 3 != 1).collect();
        let want = idx.search_exact(&q, 10, Some(&subset))?;
        let got = idx.search(&q, &exhaustive(idx, 10), Some(Subset::Shared(&subset)))?;
        assert_same(&format!("nbits {nbits} subset"), &got, (&want.0, &want.1), tol(dev))?;
        // Per-query subsets: each query restricted to its own target (and two others).
        let per: Vec<Vec<u32>> = targets.iter().map(|&t| vec![t as u32, (t as u32 + 1) % 300, 299]).collect();
        let got = idx.search(&q, &exhaustive(idx, 3), Some(Subset::PerQuery(&per)))?;
        for (qi, g) in got.iter().enumerate() {
            assert!(g.iter().all(|r| per[qi].contains(&r.0)), "query {qi}: results outside its subset");
        }
        // Small batches give the same results as one.
        let small = SearchParams { batch_size: 3, ..exhaustive(idx, 5) };
        let want = idx.search_exact(&q, 5, None)?;
        assert_same("batches of 3", &idx.search(&q, &small, None)?, (&want.0, &want.1), tol(dev))?;
        // Queries narrowed one by one out of the batch (views of its storage) too.
        let one_by_one: Vec<Vec<(u32, f32)>> = (0..q.dim(0)?)
            .map(|i| idx.search(&q.narrow(0, i, 1)?, &exhaustive(idx, 5), None).map(|mut r| r.remove(0)))
            .collect::<Result<_>>()?;
        assert_same("one by one", &one_by_one, (&want.0, &want.1), tol(dev))?;
    }
    Ok(())
}

test_device!(build_and_search, build_and_search_cpu, build_and_search_cuda);

/// `build` writes the index `create` writes and opens (the same files; on
/// the CPU the same bytes), which then searches alike.
fn build_writes_what_create_opens(dev: &Device) -> Result<()> {
    let (x, lens, _) = clustered(150, 64, 20, 7)?;
    let docs = PackedDocuments::new(x.clone(), &lens)?;
    let config = IndexConfig { nbits: 2, n_centroids: Some(64), chunk_documents: 40, ..Default::default() };
    let (a, b) =
        (temp_dir(&format!("build_only_{}", dev.is_cuda())), temp_dir(&format!("build_create_{}", dev.is_cuda())));
    candle_maxsim_plaid::build(&a, &docs, &config, dev)?;
    let created = create(&b, &docs, &config, dev)?;
    assert_eq!(list(&a), list(&b), "files and sizes");
    if !dev.is_cuda() {
        for f in std::fs::read_dir(&a)? {
            let name = f?.file_name();
            assert!(std::fs::read(a.join(&name))? == std::fs::read(b.join(&name))?, "{name:?} differs");
        }
    }
    let built = PlaidIndex::load(&a, dev)?;
    let q = queries_from(&x, &lens, &[3, 70, 141], 16, 2)?.to_device(dev)?;
    let want = created.search_exact(&q, 5, None)?;
    assert_same("built, then opened", &built.search(&q, &exhaustive(&built, 5), None)?, (&want.0, &want.1), tol(dev))?;
    drop((built, created));
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
    Ok(())
}

test_device!(build_writes_what_create_opens, build_writes_what_create_opens_cpu, build_writes_what_create_opens_cuda);

/// Added documents are found under the ids after the last; deleted ones are
/// never returned, every other id is unchanged, and both survive a reload.
fn add_and_delete(dev: &Device) -> Result<()> {
    let mut b = build("life", dev, 200, 4)?;
    let (x2, lens2, _) = clustered(40, 64, 40, 999)?;
    let base_ivf = std::fs::read(b.dir.join("ivf.npy"))?;
    // Three adds into the room the index was opened with (each takes its
    // tokens from it; growing is tested with a device budget below). A view
    // taken in between keeps its rows.
    let lens2_u: Vec<usize> = lens2.iter().map(|&l| l as usize).collect();
    let cut = lens2_u[..36].iter().sum::<usize>();
    let spare = b.index.spare_tokens();
    let added = b.index.add(&PackedDocuments::new(x2.narrow(0, 0, cut)?, &lens2[..36])?, 15)?;
    assert_eq!(b.index.spare_tokens(), spare - cut, "the add wrote into the room");
    let held = b.index.residuals.to_device(&Device::Cpu)?.to_vec2::<u8>()?;
    let view = b.index.residuals.clone();
    let next = cut + lens2_u[36..38].iter().sum::<usize>();
    let added2 = b.index.add(&PackedDocuments::new(x2.narrow(0, cut, next - cut)?, &lens2[36..38])?, 15)?;
    let added3 = b.index.add(&PackedDocuments::new(x2.narrow(0, next, x2.dim(0)? - next)?, &lens2[38..])?, 15)?;
    assert_eq!(view.to_device(&Device::Cpu)?.to_vec2::<u8>()?, held, "a later add changed an earlier view");
    assert_eq!((added, added2, added3), (200..236, 236..238, 238..240));
    assert_eq!(b.index.spare_tokens(), spare - x2.dim(0)?);
    assert_eq!(std::fs::read(b.dir.join("ivf.npy"))?, base_ivf, "add leaves ivf.npy as it was");
    assert!(b.dir.join("delta_ivf.npy").exists(), "add writes the delta lists");
    assert_eq!(b.index.num_documents(), 240);
    let targets: Vec<usize> = (0..40).step_by(4).collect();
    let q = queries_from(&x2, &lens2, &targets, 32, 7)?.to_device(dev)?;
    let res = b.index.search(&q, &SearchParams::default(), None)?;
    let hits = res.iter().zip(&targets).filter(|(r, &t)| r.first().map(|x| x.0) == Some(200 + t as u32)).count();
    assert!(hits * 10 >= targets.len() * 8, "{hits}/{} added documents found first", targets.len());
    // The index extended in memory is the one on disk.
    let fresh = PlaidIndex::load(&b.dir, dev)?;
    assert_eq!(b.index.doc_lens(), fresh.doc_lens());
    for (a, f) in [(&b.index.codes, &fresh.codes), (&b.index.residuals, &fresh.residuals)] {
        assert_eq!(a.dims(), f.dims());
        assert_eq!(
            a.to_dtype(DType::F32)?
                .ne(&f.to_dtype(DType::F32)?)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()?,
            0.0
        );
    }
    assert_eq!(fresh.search(&q, &SearchParams::default(), None)?, res, "search in memory and after reopening");
    // Delete every other target, and an old document.
    let gone: Vec<u32> = targets.iter().step_by(2).map(|&t| 200 + t as u32).chain([3]).collect();
    let before = b.index.search_exact(&q, 20, None)?;
    let ivf_before = std::fs::read(b.dir.join("ivf.npy"))?;
    b.index.delete(&gone)?;
    assert_eq!(std::fs::read(b.dir.join("ivf.npy"))?, ivf_before, "delete rewrites only deleted.json");
    let reopened = PlaidIndex::load(&b.dir, dev)?;
    assert_eq!(reopened.deleted(), {
        let mut g = gone.clone();
        g.sort_unstable();
        g
    });
    for idx in [&b.index, &reopened] {
        for r in idx.search(&q, &exhaustive(idx, 20), None)? {
            assert!(r.iter().all(|(d, _)| !gone.contains(d)), "a deleted document was returned");
        }
        // The survivors keep their ids and scores: exact search minus the deleted.
        let (s, i) = idx.search_exact(&q, 20, None)?;
        let (bs, bi): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (before.0.to_vec2()?, before.1.to_vec2()?);
        let (s, i): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (s.to_vec2()?, i.to_vec2()?);
        for qi in 0..targets.len() {
            let kept: Vec<(u32, f32)> =
                bi[qi].iter().zip(&bs[qi]).filter(|(d, _)| !gone.contains(d)).map(|(&d, &s)| (d, s)).collect();
            let n = kept.len();
            assert_eq!(&i[qi][..n], &kept.iter().map(|k| k.0).collect::<Vec<_>>()[..], "query {qi} after delete");
            assert!(s[qi][..n].iter().zip(&kept).all(|(a, b)| (a - b.1).abs() <= 1e-5 * b.1.abs().max(1.0)));
        }
    }
    // Compaction drops the deleted documents from the inverted file on disk
    // and changes no search result.
    let params = SearchParams { top_k: 20, ..Default::default() };
    let pre = b.index.search(&q, &params, None)?;
    b.index.compact()?;
    // The inverted file is every live document under each of its codes, ascending.
    let listed: Vec<i64> = Tensor::read_npy(b.dir.join("ivf.npy"))?.to_dtype(DType::I64)?.to_vec1()?;
    let lengths: Vec<i64> = Tensor::read_npy(b.dir.join("ivf_lengths.npy"))?.to_dtype(DType::I64)?.to_vec1()?;
    let codes: Vec<u32> = b.index.codes.to_vec1()?;
    let mut want = vec![Vec::<i64>::new(); b.index.num_centroids()];
    let mut at = 0;
    for (d, &l) in b.index.doc_lens().iter().enumerate() {
        for &c in &codes[at..at + l as usize] {
            let list = &mut want[c as usize];
            if !gone.contains(&(d as u32)) && list.last() != Some(&(d as i64)) {
                list.push(d as i64);
            }
        }
        at += l as usize;
    }
    assert_eq!(lengths, want.iter().map(|l| l.len() as i64).collect::<Vec<_>>(), "compacted list lengths");
    assert_eq!(listed, want.concat(), "compact merges the added documents and drops exactly the deleted ones");
    assert!(!b.dir.join("delta_ivf.npy").exists(), "compact folds the delta lists in");
    for idx in [&b.index, &PlaidIndex::load(&b.dir, dev)?] {
        assert_eq!(idx.search(&q, &params, None)?, pre, "search after compact");
    }
    Ok(())
}

test_device!(add_and_delete, add_and_delete_cpu, add_and_delete_cuda);

/// A clone of an index holds no room for adds, so an add to one never
/// writes into rows the other uses: the clone's first add copies into
/// buffers of its own, and the original's next add leaves the clone's rows
/// as they were. (Both writing to one directory is the caller's to avoid;
/// this checks the memory.)
fn clones_never_share_room(dev: &Device) -> Result<()> {
    let mut b = build("clones", dev, 120, 4)?;
    let mut other = b.index.clone();
    assert_eq!(other.spare_tokens(), 0, "a clone holds no room");
    let (xa, la, _) = clustered(10, 64, 40, 5)?;
    let (xb, lb, _) = clustered(10, 64, 40, 6)?;
    other.add(&PackedDocuments::new(xa, &la)?, 15)?;
    let held = other.residuals.to_device(&Device::Cpu)?.to_vec2::<u8>()?;
    let codes = other.codes.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
    b.index.add(&PackedDocuments::new(xb, &lb)?, 15)?;
    assert_eq!(other.residuals.to_device(&Device::Cpu)?.to_vec2::<u8>()?, held, "the original's add changed the clone");
    assert_eq!(other.codes.to_device(&Device::Cpu)?.to_vec1::<u32>()?, codes);
    Ok(())
}

test_device!(clones_never_share_room, clones_never_share_room_cpu, clones_never_share_room_cuda);

/// Opened within a device budget below its size, the index keeps its
/// residuals in host memory and searches as the whole index on the device
/// does: the same results (default and exhaustive parameters, a subset,
/// exact search), also after an add and a delete; a budget below the rest
/// of the index is an error naming `device_bytes`. The room for adds is
/// kept within the budget: none when the index just fits.
fn device_budget_changes_no_result(dev: &Device) -> Result<()> {
    let mut b = build("budget", dev, 200, 4)?;
    let (full, res_bytes) = PlaidIndex::device_bytes_needed(&b.dir)?;
    assert!(!b.index.residuals_on_host());
    assert_eq!(res_bytes, b.index.residuals.elem_count(), "residual bytes read from the files");
    let spare = b.index.spare_tokens();
    assert!(spare >= 1 << 16, "an unbudgeted load keeps room for adds, got {spare} tokens");
    assert!(b.index.device_bytes() >= full + spare * (4 + b.index.residuals.dim(1)?));
    let mut exact = PlaidIndex::load_with_device_budget(&b.dir, dev, full)?;
    assert!(!exact.residuals_on_host());
    assert_eq!((exact.device_bytes(), exact.spare_tokens()), (full, 0), "a budget the index just fits: no room");
    let mut small = PlaidIndex::load_with_device_budget(&b.dir, dev, full - 1)?;
    assert!(small.residuals_on_host() && small.residuals.device().is_cpu());
    assert!(small.device_bytes() >= full - res_bytes && small.device_bytes() < full, "within the budget");
    expect_err(PlaidIndex::load_with_device_budget(&b.dir, dev, full - res_bytes - 1), "device_bytes");
    let targets: Vec<usize> = (0..200).step_by(9).collect();
    let q = queries_from(&b.x, &b.lens, &targets, 32, 3)?.to_device(dev)?;
    let subset: Vec<u32> = (0..200).filter(|d| d % 3 != 0).collect();
    let check = |whole: &PlaidIndex, small: &PlaidIndex, what: &str| -> Result<()> {
        for params in [SearchParams::default(), exhaustive(whole, 15)] {
            assert_eq!(small.search(&q, &params, None)?, whole.search(&q, &params, None)?, "{what}: {params:?}");
            let (sa, wa) = (
                small.search(&q, &params, Some(Subset::Shared(&subset)))?,
                whole.search(&q, &params, Some(Subset::Shared(&subset)))?,
            );
            assert_eq!(sa, wa, "{what}: subset, {params:?}");
        }
        let (ss, si) = small.search_exact(&q, 12, None)?;
        let (ws, wi) = whole.search_exact(&q, 12, None)?;
        assert_eq!(
            (ss.to_vec2::<f32>()?, si.to_vec2::<u32>()?),
            (ws.to_vec2::<f32>()?, wi.to_vec2::<u32>()?),
            "{what}: exact"
        );
        let (se, we) = (small.embeddings(17)?, whole.embeddings(17)?);
        assert_eq!(se.to_vec2::<f32>()?, we.to_vec2::<f32>()?, "{what}: embeddings");
        Ok(())
    };
    check(&b.index, &small, "opened")?;
    let (x2, lens2, _) = clustered(30, 64, 40, 77)?;
    let more = PackedDocuments::new(x2, &lens2)?;
    b.index.add(&more, 15)?;
    small.add(&more, 15)?;
    // Without room the add grows the buffers, with room to spare after.
    exact.add(&more, 15)?;
    assert!(exact.spare_tokens() > 0 && exact.device_bytes() > full, "the add grew the index");
    assert!(small.residuals_on_host() && small.residuals.device().is_cpu(), "added rows stay on the host");
    for idx in [&mut b.index, &mut small, &mut exact] {
        idx.delete(&[5, 201])?;
    }
    check(&b.index, &small, "after add and delete")?;
    check(&b.index, &exact, "grown by an add")?;
    Ok(())
}

test_device!(
    device_budget_changes_no_result,
    device_budget_changes_no_result_cpu,
    device_budget_changes_no_result_cuda
);

/// Two shards, one on `dev` and one on the CPU, search as one index with the
/// same codec: every document scored, the merged top-k equals the exact
/// search of the whole collection.
fn shards_search_as_one(dev: &Device) -> Result<()> {
    let (x, lens, _) = clustered(260, 64, 40, 11)?;
    let dir = temp_dir(&format!("shards_{}", dev.is_cuda()));
    let docs = PackedDocuments::new(x.clone(), &lens)?;
    let config = IndexConfig { n_centroids: Some(128), chunk_documents: 50, ..Default::default() };
    let sharded = ShardedIndex::create(&dir, &docs, &config, &[dev.clone(), Device::Cpu])?;
    assert_eq!(sharded.num_documents(), 260);
    let single = create(dir.join("single"), &docs, &config, dev)?;
    let targets: Vec<usize> = (0..260).step_by(17).collect();
    let q = queries_from(&x, &lens, &targets, 32, 3)?.to_device(dev)?;
    let params = SearchParams { n_ivf_probe: 128, n_full_scores: 4 * 260, top_k: 12, ..Default::default() };
    let got = sharded.search(&q, &params, None)?;
    let want = single.search_exact(&q, 12, None)?;
    assert_same("shards", &got, (&want.0, &want.1), 1e-4)?;
    let subset: Vec<u32> = (100..200).collect();
    let got = sharded.search(&q, &params, Some(Subset::Shared(&subset)))?;
    let want = single.search_exact(&q, 12, Some(&subset))?;
    assert_same("shards subset", &got, (&want.0, &want.1), 1e-4)?;
    // Reopened with the devices swapped.
    let reopened = ShardedIndex::load(&dir, &[Device::Cpu, dev.clone()])?;
    let want = single.search_exact(&q, 12, None)?;
    assert_same("reopened shards", &reopened.search(&q, &params, None)?, (&want.0, &want.1), 1e-4)?;
    // Within a device budget below every shard's size (their residuals on
    // the host): the same results.
    let needs: Vec<(usize, usize)> =
        reopened.shards().iter().map(|s| PlaidIndex::device_bytes_needed(s.dir())).collect::<Result<_>>()?;
    let budget = needs.iter().map(|n| n.0).min().unwrap() - 1;
    assert!(needs.iter().all(|n| n.0 - n.1 <= budget), "{needs:?}");
    let budgeted = ShardedIndex::load_with_device_budget(&dir, &[Device::Cpu, dev.clone()], budget)?;
    assert!(budgeted.shards().iter().all(|s| s.residuals_on_host()));
    assert_eq!(budgeted.search(&q, &params, None)?, reopened.search(&q, &params, None)?, "budgeted shards");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

test_device!(shards_search_as_one, shards_search_as_one_cpu, shards_search_as_one_cuda);

/// The fast-plaid fixture (built by the real package) searched with every
/// centroid probed returns what its exhaustive exact search returns.
fn fixture_plaid_search(dev: &Device) -> Result<()> {
    for dir in ["nb2", "nb4", "fp146"].into_iter().filter_map(fixture).map(|d| d.join("index")) {
        let idx = PlaidIndex::load(&dir, dev)?;
        let q = Tensor::read_npy(dir.parent().unwrap().join("expected/queries.npy"))?.to_device(dev)?;
        let want = idx.search_exact(&q, 10, None)?;
        assert_same(
            &format!("{}", dir.display()),
            &idx.search(&q, &exhaustive(&idx, 10), None)?,
            (&want.0, &want.1),
            tol(dev),
        )?;
        // Default parameters still find most of the exact top 10.
        let got = idx.search(&q, &SearchParams::default(), None)?;
        let wi: Vec<Vec<u32>> = want.1.to_vec2()?;
        let overlap: usize = got.iter().zip(&wi).map(|(g, w)| g.iter().filter(|r| w.contains(&r.0)).count()).sum();
        assert!(overlap * 10 >= 8 * 10 * wi.len(), "{}: {overlap} of the exact top-10 entries", dir.display());
    }
    Ok(())
}

test_device!(fixture_plaid_search, fixture_plaid_search_cpu, fixture_plaid_search_cuda);

/// Bad arguments and damaged files: each an `Err` naming the argument or the
/// file; a failed add leaves the index on disk as it was.
fn engine_errors(dev: &Device) -> Result<()> {
    let mut b = build("errors", dev, 120, 2)?;
    let q = randn(&[2, 8, 64], DType::F32, dev)?;
    expect_err(b.index.search(&randn(&[2, 8, 32], DType::F32, dev)?, &SearchParams::default(), None), "q");
    expect_err(b.index.search(&randn(&[2, 70, 64], DType::F32, dev)?, &SearchParams::default(), None), "q");
    expect_err(b.index.search(&q, &SearchParams { top_k: 0, ..Default::default() }, None), "params");
    // A NaN or an infinity in any query (here the second of three) is an error naming q.
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut v: Vec<f32> = randn(&[3, 8, 64], DType::F32, &Device::Cpu)?.flatten_all()?.to_vec1()?;
        v[8 * 64 + 5] = bad;
        let qb = Tensor::from_vec(v, (3, 8, 64), dev)?;
        let e = b.index.search(&qb, &SearchParams::default(), None).expect_err("a non-finite query");
        assert!(e.to_string().starts_with("q: query 1 "), "{e}");
        // ... also when it is a view of that batch; its neighbours search.
        let e = b.index.search(&qb.narrow(0, 1, 2)?, &SearchParams::default(), None).expect_err("a view");
        assert!(e.to_string().starts_with("q: query 0 "), "{e}");
        b.index.search(&qb.narrow(0, 2, 1)?, &SearchParams::default(), None)?;
        expect_err(b.index.search_exact(&qb, 3, None), "q");
    }
    expect_err(b.index.search(&q, &Default::default(), Some(Subset::Shared(&[5, 500]))), "subset");
    expect_err(b.index.search(&q, &Default::default(), Some(Subset::PerQuery(&[vec![1]]))), "subset");
    expect_err(b.index.delete(&[120]), "ids");
    // An add whose documents have the wrong dim fails before writing anything;
    // one that fails halfway (a document whose embeddings cannot be read) too.
    let before: Vec<String> = list(&b.dir);
    let (x2, lens2, _) = clustered(10, 32, 4, 1)?;
    expect_err(b.index.add(&PackedDocuments::new(x2, &lens2)?, 5), "docs");
    struct Failing;
    impl candle_maxsim_plaid::Documents for Failing {
        fn len(&self) -> usize {
            20
        }
        fn dim(&self) -> usize {
            64
        }
        fn doc_len(&self, _: usize) -> usize {
            3
        }
        fn embeddings(&self, ids: &[u32]) -> Result<Tensor> {
            if ids.contains(&12) {
                candle_core::bail!("docs: cannot read document 12")
            }
            Tensor::ones((3 * ids.len(), 64), DType::F32, &Device::Cpu)
        }
    }
    expect_err(b.index.add(&Failing, 5), "docs");
    assert_eq!(list(&b.dir), before, "a failed add changed the index directory");
    assert_eq!(PlaidIndex::load(&b.dir, dev)?.num_documents(), 120);
    // Damaged files, each named.
    let damage = |file: &str, f: &dyn Fn(&std::path::Path)| -> Result<()> {
        let c = build(&format!("damage_{}", file.replace('.', "_")), dev, 80, 2)?;
        f(&c.dir);
        expect_err_containing(PlaidIndex::load(&c.dir, dev), file);
        Ok(())
    };
    damage("0.residuals.npy", &|d| truncate(&d.join("0.residuals.npy"), 100))?;
    damage("ivf.npy", &|d| truncate(&d.join("ivf.npy"), 200))?;
    damage("ivf_lengths.npy", &|d| std::fs::remove_file(d.join("ivf_lengths.npy")).unwrap())?;
    damage("centroids.npy", &|d| std::fs::write(d.join("centroids.npy"), b"not an array").unwrap())?;
    damage("ivf.npy", &|d| {
        let mut v = Tensor::read_npy(d.join("ivf.npy")).unwrap().to_vec1::<i64>().unwrap();
        v[0] = 10_000;
        Tensor::new(v, &Device::Cpu).unwrap().write_npy(d.join("ivf.npy")).unwrap()
    })?;
    damage("deleted.json", &|d| std::fs::write(d.join("deleted.json"), r#"{"deleted": [5, 999]}"#).unwrap())?;
    // Codes of one token more than the chunk's documents have.
    damage("0.codes.npy", &|d| {
        let mut v = Tensor::read_npy(d.join("0.codes.npy")).unwrap().to_vec1::<i64>().unwrap();
        v.push(0);
        Tensor::new(v, &Device::Cpu).unwrap().write_npy(d.join("0.codes.npy")).unwrap()
    })?;
    Ok(())
}

test_device!(engine_errors, engine_errors_cpu, engine_errors_cuda);

fn list(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            format!("{} {}", e.file_name().to_string_lossy(), e.metadata().unwrap().len())
        })
        .collect();
    v.sort();
    v
}

fn truncate(path: &std::path::Path, keep: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(keep).unwrap();
}
