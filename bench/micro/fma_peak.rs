//! The CPU engine's ceilings on this machine: the F32 FMA peak (every core
//! runs independent FMA chains in registers, enough to cover the latency;
//! AVX-512 where the CPU has it, AVX2 + FMA), the BF16 and 8-bit
//! dot-product peaks (VDPBF16PS, VPDPBUSD: where the CPU has AVX512_BF16,
//! AVX512_VNNI; 8-bit in integer ops per second) and the read bandwidth
//! from memory (every core sums its share of a 1 GiB array, the way MaxSim
//! streams the documents). Prints one JSON line each.
//!
//!     cargo bench --bench fma_peak

use std::time::Instant;

/// Chains per thread: FMA latency (4 cycles) × 2 pipes, and some.
const CHAINS: usize = 12;
const ITERS: u64 = 50_000_000;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{CHAINS, ITERS};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn zmm(seed: f32) -> f32 {
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        for _ in 0..ITERS {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    /// VDPBF16PS: two BF16 products per F32 lane and instruction (4 FLOP per lane).
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn bf16(seed: f32) -> f32 {
        let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80)); // (1.0, 1.0)
        let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3380_3380)); // (6e-8, 6e-8)
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        for _ in 0..ITERS {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, a, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    /// VPDPBUSD: four 8-bit products per I32 lane and instruction (8 ops per lane).
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn vnni(seed: f32) -> f32 {
        let (a, b) = (_mm512_set1_epi32(0x0101_0101), _mm512_set1_epi32(0x0001_0001));
        let mut acc = [_mm512_set1_epi32(seed as i32); CHAINS];
        for _ in 0..ITERS {
            for x in acc.iter_mut() {
                *x = _mm512_dpbusd_epi32(*x, a, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_epi32(x) as f32).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn ymm(seed: f32) -> f32 {
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(seed); CHAINS];
        for _ in 0..ITERS {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut out = [0f32; 8];
        let mut s = 0.0;
        for x in acc {
            _mm256_storeu_ps(out.as_mut_ptr(), x);
            s += out.iter().sum::<f32>();
        }
        s
    }
}

/// `flops_per_lane`: 2 for an FMA, 4 for VDPBF16PS, 8 for VPDPBUSD.
fn run(width: &str, lanes: usize, flops_per_lane: usize, f: fn(f32) -> f32) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t = Instant::now();
    let sink: f32 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads).map(|i| s.spawn(move || f(i as f32 * 1e-3))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    let secs = t.elapsed().as_secs_f64();
    let flops = threads as f64 * ITERS as f64 * (CHAINS * lanes * flops_per_lane) as f64;
    println!(
        "{{\"case\":\"fma_peak\",\"width\":\"{width}\",\"threads\":{threads},\"gflops\":{:.1},\"seconds\":{secs:.3},\"sink\":{sink}}}",
        flops / secs / 1e9
    );
}

/// Read bandwidth: each thread sums a contiguous share of a 1 GiB F32 array, best of 5.
fn bandwidth() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let v: Vec<f32> = (0..(1usize << 28)).map(|i| (i % 7) as f32).collect();
    let share = v.len().div_ceil(threads);
    let mut best = f64::MAX;
    let mut sink = 0f32;
    for _ in 0..5 {
        let t = Instant::now();
        sink += std::thread::scope(|s| {
            let hs: Vec<_> = v
                .chunks(share)
                .map(|c| s.spawn(move || c.chunks(16).map(|x| x.iter().sum::<f32>()).sum::<f32>()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum::<f32>()
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "{{\"case\":\"read_bandwidth\",\"threads\":{threads},\"gb_per_s\":{:.1},\"sink\":{sink}}}",
        (v.len() * 4) as f64 / best / 1e9
    );
}

fn main() {
    bandwidth();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: each kernel runs only where the CPU reports its features.
        if std::arch::is_x86_feature_detected!("avx512f") {
            run("avx512", 16, 2, |s| unsafe { x86::zmm(s) });
        }
        if std::arch::is_x86_feature_detected!("avx512bf16") {
            run("avx512_bf16", 16, 4, |s| unsafe { x86::bf16(s) });
        }
        if std::arch::is_x86_feature_detected!("avx512vnni") {
            run("avx512_vnni", 16, 8, |s| unsafe { x86::vnni(s) });
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            run("avx2", 8, 2, |s| unsafe { x86::ymm(s) });
        }
    }
}
