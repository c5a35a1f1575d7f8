//! CPU benchmark (`cargo bench`): time and peak heap memory of the fused CPU
//! op against `reference` at a ColBERT in-batch shape and rerank shapes, in
//! F32, BF16 and symmetric 8-bit (`maxsim_quantized`).
//! Prints one JSON line per (case, implementation).

use candle_core::{DType, Device, Tensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Counts live heap bytes and their high-water mark.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
}
#[global_allocator]
static A: Counting = Counting;

fn measure(iters: usize, f: &dyn Fn() -> Tensor) -> (f64, f64) {
    drop(f()); // warm-up
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    drop(f());
    let peak = (PEAK.load(Ordering::Relaxed) - base) as f64 / 1e6;
    let mut ts: Vec<f64> = (0..iters)
        .map(|_| {
            let t0 = Instant::now();
            drop(f());
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ts.sort_by(f64::total_cmp);
    (ts[ts.len() / 2], peak)
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let cases = [
        ("colbert_inbatch_32", [32usize, 32, 32, 256, 128]),
        ("rerank_1q_1000", [1, 1000, 32, 300, 128]),
        ("rerank_1q_1000_ld1024", [1, 1000, 32, 1024, 128]),
    ];
    for (name, [nq, nd, lq, ld, dim]) in cases {
        for dt in [DType::F32, DType::BF16] {
            // Unit vectors, as ColBERT embeddings are.
            let q = candle_maxsim::l2_normalize(&Tensor::randn(0f32, 1., (nq, lq, dim), &dev)?)?.to_dtype(dt)?;
            let d = candle_maxsim::l2_normalize(&Tensor::randn(0f32, 1., (nd, ld, dim), &dev)?)?.to_dtype(dt)?;
            let flop = 2.0 * (nq * nd * lq * ld * dim) as f64;
            let fused = || candle_maxsim::maxsim(&q, &d, None, None).unwrap();
            let naive = || candle_maxsim::reference::maxsim(&q, &d, None, None).unwrap();
            // The training forward: scores and the argmax the backward reads.
            let argmax = || candle_maxsim::maxsim_with_argmax(&q, &d, None, None).unwrap().0;
            let imps: &[(&str, &dyn Fn() -> Tensor)] = if dt == DType::F32 {
                &[("fused", &fused), ("fused_argmax", &argmax), ("reference", &naive)]
            } else {
                &[("fused", &fused)]
            };
            for &(imp, f) in imps {
                let (ms, peak) = measure(15, f);
                println!(
                    "{{\"case\":\"{name}\",\"impl\":\"{imp}\",\"device\":\"cpu\",\"threads\":{},\"shape\":[{nq},{nd},{lq},{ld},{dim}],\"dtype\":\"{dt:?}\",\"median_ms\":{ms:.3},\"gflops\":{:.1},\"peak_mem_mb\":{peak:.2}}}",
                    rayon::current_num_threads(),
                    flop / (ms * 1e-3) / 1e9
                );
            }
            if dt == DType::F32 {
                // The same unit vectors quantized (symmetric, per token; not timed), scored by
                // `maxsim_quantized`; against the F32 scores: the largest score error and, per
                // query, the overlap of the two top-10 lists.
                let (q8, d8) = (candle_maxsim::quantized::quantize(&q)?, candle_maxsim::quantized::quantize(&d)?);
                let int8 = || candle_maxsim::quantized::maxsim_quantized(&q8, &d8, None, None).unwrap();
                let (ms, peak) = measure(15, &int8);
                let (exact, approx) = (fused().to_vec2::<f32>()?, int8().to_vec2::<f32>()?);
                let top = |r: &[f32]| {
                    let mut i: Vec<usize> = (0..r.len()).collect();
                    i.sort_by(|&a, &b| r[b].total_cmp(&r[a]));
                    i.truncate(10);
                    i
                };
                let mut err = 0f32;
                let mut overlap = 0usize;
                for (e, a) in exact.iter().zip(&approx) {
                    err = e.iter().zip(a).map(|(x, y)| (x - y).abs()).fold(err, f32::max);
                    let te = top(e);
                    overlap += top(a).iter().filter(|i| te.contains(i)).count();
                }
                println!(
                    "{{\"case\":\"{name}\",\"impl\":\"fused\",\"device\":\"cpu\",\"threads\":{},\"shape\":[{nq},{nd},{lq},{ld},{dim}],\"dtype\":\"I8\",\"median_ms\":{ms:.3},\"gflops\":{:.1},\"peak_mem_mb\":{peak:.2},\"max_abs_err_vs_f32\":{err:.5},\"top10_overlap_vs_f32\":{:.4}}}",
                    rayon::current_num_threads(),
                    flop / (ms * 1e-3) / 1e9,
                    overlap as f64 / (10 * exact.len()).max(1) as f64
                );
            }
        }
    }
    Ok(())
}
