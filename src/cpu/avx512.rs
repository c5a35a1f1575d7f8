//! The forward on AVX-512, F32 and BF16, with or without the argmax: query
//! rows in vector lanes. A query's rows (up to 32 at a time) are packed transposed,
//! `[dim][32]`, so that one FMA multiplies 16 query rows by one broadcast
//! feature of a document token; six tokens at a time (BF16: eight) keep 12 (16) accumulators in
//! registers, the max over tokens is a vertical `max` per lane, and the rows
//! two token groups ahead are prefetched. No score tile, no document packing,
//! no horizontal reduction: every FMA is useful work (the GEMM path computes
//! a `[128, 512]` tile into memory and scans it with a scalar loop that also
//! tracks the argmax). Chosen at run time when the CPU has AVX-512F. BF16
//! takes one of two kernels (`bf16_by_dot`): VDPBF16PS on the packed pairs,
//! or each group's rows widened to F32 in L1 (a shift per 16 features) and
//! the F32 FMA loop.

use std::arch::x86_64::*;
use std::ops::Range;

/// Tokens per register block: 6 × 2 accumulators, 2 query vectors and a broadcast fit the 32 zmm registers with room.
const U: usize = 6;
/// BF16's: 8 × 2 accumulators. VDPBF16PS has a longer latency than the FMA, and 12 chains
/// left it short of its rate (2-core EPYC: in-batch 32 × 32 × 256 2.9-3.6 -> 2.5-2.8 ms, 10 no better).
const U_BF16: usize = 8;

/// Whether this CPU runs the kernel.
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && !crate::knobs::knobs().cpu_gemm
}

/// Query rows `rows` (of `dim` features, row-major in `q`) transposed into
/// `qt`: element `(k, v, l)` at `(k·QV + v)·16 + l` is row `16v + l`'s
/// feature k, zero past the last row. Returns QV (1 for ≤ 16 rows, else 2).
pub(crate) fn pack_queries(q: &[f32], dim: usize, rows: Range<usize>, qt: &mut Vec<f32>) -> usize {
    pack_rows(q, dim, rows, qt, |&[x]: &[f32; 1]| x)
}

/// [`pack_queries`] of BF16 rows, widened to F32 (exactly).
pub(crate) fn pack_queries_widened(q: &[half::bf16], dim: usize, rows: Range<usize>, qt: &mut Vec<f32>) -> usize {
    pack_rows(q, dim, rows, qt, |&[x]: &[half::bf16; 1]| x.to_f32())
}

/// The packing of the lane kernels: each row's features in groups of `N`
/// (`dim` a multiple of N), group k of row `16v + l` at `(k·QV + v)·16 + l`
/// as `word(group)`, zero past the last row. Returns QV.
fn pack_rows<E: Copy, P: Copy + Default, const N: usize>(
    q: &[E],
    dim: usize,
    rows: Range<usize>,
    qt: &mut Vec<P>,
    word: impl Fn(&[E; N]) -> P,
) -> usize {
    let n = rows.len();
    debug_assert!(n <= 32 && dim.is_multiple_of(N));
    let qv = if n > 16 { 2 } else { 1 };
    qt.clear();
    qt.resize(dim / N * qv * 16, P::default());
    for (r, row) in rows.enumerate() {
        let (v, l) = (r / 16, r % 16);
        for (k, group) in q[row * dim..(row + 1) * dim].as_chunks::<N>().0.iter().enumerate() {
            qt[(k * qv + v) * 16 + l] = word(group);
        }
    }
    qv
}

/// A lane kernel's instance for the run-time query vectors (1 or 2) and argmax.
macro_rules! by_qv {
    ($kernel:ident, $qv:expr, $argmax:expr, $out:expr, $($arg:expr),*) => {{
        let mut unused = [0i32; 32];
        match ($qv, $argmax) {
            (1, None) => $kernel::<1, false>($($arg),*, $out, &mut unused),
            (_, None) => $kernel::<2, false>($($arg),*, $out, &mut unused),
            (1, Some(a)) => $kernel::<1, true>($($arg),*, $out, a),
            (_, Some(a)) => $kernel::<2, true>($($arg),*, $out, a),
        }
    }};
}

/// `out[r] = max over toks of q_r · d[tok]` for the ≤ 32 packed query rows
/// (lanes past them are garbage) and, with `argmax`, the first winning
/// token's index within its document (`tok − ds`); `toks` non-empty and
/// ascending, rows of `d` (`dim` wide).
pub(crate) fn doc_max(
    qt: &[f32],
    qv: usize,
    dim: usize,
    d: &[f32],
    (toks, ds): (&[u32], u32),
    out: &mut [f32; 32],
    argmax: Option<&mut [i32; 32]>,
) {
    debug_assert!(qt.len() >= dim * qv * 16 && toks.iter().all(|&t| (t as usize + 1) * dim <= d.len()));
    // SAFETY: `available()` was checked by the caller (the only one is gated on it); the asserted
    // lengths cover every load: qt holds dim·qv·16 floats, each token row dim floats of d.
    unsafe {
        let (qt, d) = (qt.as_ptr(), d.as_ptr());
        by_qv!(doc_max_qv, qv, argmax, out, qt, dim, d, toks, ds)
    }
}

/// Folds `N` tokens' accumulators into each lane's running max and, with
/// `ARGMAX`, its first winner (strictly greater replaces: ties keep the lower index).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fold<const QV: usize, const N: usize, const ARGMAX: bool>(
    acc: &[[__m512; QV]; N],
    toks: &[u32],
    ds: u32,
    best: &mut [__m512; QV],
    idx: &mut [__m512i; QV],
) {
    for (u, a) in acc.iter().enumerate() {
        for v in 0..QV {
            if ARGMAX {
                let m = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a[v], best[v]);
                best[v] = _mm512_mask_mov_ps(best[v], m, a[v]);
                idx[v] = _mm512_mask_mov_epi32(idx[v], m, _mm512_set1_epi32((toks[u] - ds) as i32));
            } else {
                best[v] = _mm512_max_ps(best[v], a[v]);
            }
        }
    }
}

/// The driver of a lane kernel: the tokens in groups of `u` (then a tail of
/// fewer), each group's `block` folding its maxima into `best`, then stored.
macro_rules! token_groups {
    ($name:ident, $block:ident, $packed:ty, $elem:ty, $features:literal, $u:expr, [$($tail:literal),*; $last:literal]) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<const QV: usize, const ARGMAX: bool>(
            qt: *const $packed,
            dim: usize,
            d: *const $elem,
            toks: &[u32],
            ds: u32,
            out: &mut [f32; 32],
            out_idx: &mut [i32; 32],
        ) {
            let mut best = [_mm512_set1_ps(f32::NEG_INFINITY); QV];
            let mut idx = [_mm512_set1_epi32(-1); QV];
            let mut g = 0;
            while g + $u <= toks.len() {
                // The rows two groups ahead into L1 while this one computes: the documents stream
                // from memory, and without it the F32 rerank ran at 50 % of the FMA peak (75 % with).
                for &t in &toks[(g + 2 * $u).min(toks.len())..(g + 3 * $u).min(toks.len())] {
                    let row = d.add(t as usize * dim) as *const i8;
                    for line in (0..dim * std::mem::size_of::<$elem>()).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(row.add(line));
                    }
                }
                $block::<QV, $u, ARGMAX>(qt, dim, d, &toks[g..g + $u], ds, &mut best, &mut idx);
                g += $u;
            }
            match toks.len() - g {
                0 => {}
                $($tail => $block::<QV, $tail, ARGMAX>(qt, dim, d, &toks[g..], ds, &mut best, &mut idx),)*
                _ => $block::<QV, $last, ARGMAX>(qt, dim, d, &toks[g..], ds, &mut best, &mut idx),
            }
            for v in 0..QV {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * v), best[v]);
                if ARGMAX {
                    _mm512_storeu_epi32(out_idx.as_mut_ptr().add(16 * v), idx[v]);
                }
            }
        }
    };
}

token_groups!(doc_max_qv, block, f32, f32, "avx512f", U, [1, 2, 3, 4; 5]);
token_groups!(bf16_qv, bf16_block, u32, u16, "avx512f,avx512bf16", U_BF16, [1, 2, 3, 4, 5, 6; 7]);

/// `N` tokens against the packed rows: `N·QV` accumulators over the features, then folded into `best`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block<const QV: usize, const N: usize, const ARGMAX: bool>(
    qt: *const f32,
    dim: usize,
    d: *const f32,
    toks: &[u32],
    ds: u32,
    best: &mut [__m512; QV],
    idx: &mut [__m512i; QV],
) {
    let rows: [*const f32; N] = std::array::from_fn(|u| d.add(toks[u] as usize * dim));
    fold::<QV, N, ARGMAX>(&fma_rows::<QV, N>(qt, dim, rows), toks, ds, best, idx);
}

/// The products of `N` F32 rows (`dim` wide) with the packed query rows.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn fma_rows<const QV: usize, const N: usize>(
    qt: *const f32,
    dim: usize,
    rows: [*const f32; N],
) -> [[__m512; QV]; N] {
    let mut acc = [[_mm512_setzero_ps(); QV]; N];
    for k in 0..dim {
        let q: [__m512; QV] = std::array::from_fn(|v| _mm512_loadu_ps(qt.add((k * QV + v) * 16)));
        for u in 0..N {
            let b = _mm512_set1_ps(*rows[u].add(k));
            for v in 0..QV {
                acc[u][v] = _mm512_fmadd_ps(q[v], b, acc[u][v]);
            }
        }
    }
    acc
}

/// The widest BF16 row the widening kernel takes (its buffer: `U` rows of F32 on the stack).
pub(crate) const WIDEN_MAX_DIM: usize = 1024;

/// Whether BF16 runs on VDPBF16PS ([`doc_max_bf16`]) rather than widened to
/// F32 ([`doc_max_widened`]): by the two rates measured with
/// `bench/micro/fma_peak.rs` (2 threads): AMD EPYC (Zen 4) VDPBF16PS 819
/// GFLOP/s against FMA 490; Intel Xeon (family 6, model 207) 164 against
/// 331. So AMD CPUs take VDPBF16PS and the others widen.
/// `CANDLE_MAXSIM_CPU=bf16dot|bf16widen` pins either.
pub(crate) fn bf16_by_dot() -> bool {
    available_bf16()
        && crate::knobs::knobs().cpu_bf16_dot.unwrap_or_else(|| {
            let id = __cpuid(0); // the vendor string, in EBX, EDX, ECX
            [id.ebx, id.edx, id.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163] // "AuthenticAMD"
        })
}

/// [`doc_max`] for BF16 document rows against [`pack_queries_widened`]'s rows.
pub(crate) fn doc_max_widened(
    qt: &[f32],
    qv: usize,
    dim: usize,
    d: &[half::bf16],
    toks: (&[u32], u32),
    out: &mut [f32; 32],
    argmax: Option<&mut [i32; 32]>,
) {
    assert!(dim <= WIDEN_MAX_DIM);
    debug_assert!(qt.len() >= dim * qv * 16 && toks.0.iter().all(|&t| (t as usize + 1) * dim <= d.len()));
    let (toks, ds) = toks;
    // SAFETY: `available()` was checked by the caller; the asserted lengths cover every load
    // (qt holds dim·qv·16 floats, each token row dim BF16 values of d), and dim fits the buffer.
    unsafe {
        let (qt, d) = (qt.as_ptr(), d.as_ptr() as *const u16);
        by_qv!(widen_qv, qv, argmax, out, qt, dim, d, toks, ds)
    }
}

token_groups!(widen_qv, widen_block, f32, u16, "avx512f", U, [1, 2, 3, 4; 5]);

/// `N` BF16 rows widened into an L1 buffer (16 features per VPMOVZXWD and
/// shift: ~6 % of the FMAs' issue slots at 32 query rows), then [`fma_rows`].
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn widen_block<const QV: usize, const N: usize, const ARGMAX: bool>(
    qt: *const f32,
    dim: usize,
    d: *const u16,
    toks: &[u32],
    ds: u32,
    best: &mut [__m512; QV],
    idx: &mut [__m512i; QV],
) {
    let mut buf = [const { std::mem::MaybeUninit::<f32>::uninit() }; U * WIDEN_MAX_DIM];
    let wide = buf.as_mut_ptr() as *mut f32;
    for (u, &t) in toks.iter().enumerate() {
        let (src, dst) = (d.add(t as usize * dim), wide.add(u * dim));
        let mut k = 0;
        while k + 16 <= dim {
            let x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.add(k) as *const __m256i));
            _mm512_storeu_si512(dst.add(k) as *mut _, _mm512_slli_epi32::<16>(x));
            k += 16;
        }
        for k in k..dim {
            *dst.add(k) = f32::from_bits((*src.add(k) as u32) << 16);
        }
    }
    let rows: [*const f32; N] = std::array::from_fn(|u| wide.add(u * dim) as *const f32);
    fold::<QV, N, ARGMAX>(&fma_rows::<QV, N>(qt, dim, rows), toks, ds, best, idx);
}

/// Whether this CPU runs the BF16 kernel (VDPBF16PS).
pub(crate) fn available_bf16() -> bool {
    available() && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// [`pack_queries`] for BF16 rows (`dim` even): element `(k, v, l)` at
/// `(k·QV + v)·16 + l` is row `16v + l`'s features `2k, 2k + 1` as one
/// 32-bit pair, the operand layout of VDPBF16PS.
pub(crate) fn pack_queries_bf16(q: &[half::bf16], dim: usize, rows: Range<usize>, qt: &mut Vec<u32>) -> usize {
    pack_rows(q, dim, rows, qt, |p: &[half::bf16; 2]| p[0].to_bits() as u32 | (p[1].to_bits() as u32) << 16)
}

/// [`doc_max`] for BF16: each VDPBF16PS adds two features' products per lane.
pub(crate) fn doc_max_bf16(
    qt: &[u32],
    qv: usize,
    dim: usize,
    d: &[half::bf16],
    (toks, ds): (&[u32], u32),
    out: &mut [f32; 32],
    argmax: Option<&mut [i32; 32]>,
) {
    debug_assert!(dim.is_multiple_of(2) && qt.len() >= dim / 2 * qv * 16);
    debug_assert!(toks.iter().all(|&t| (t as usize + 1) * dim <= d.len()));
    // SAFETY: `available_bf16()` was checked by the caller; the asserted lengths cover every
    // load (qt holds dim/2·qv·16 pairs, each token row dim BF16 values of d).
    unsafe {
        let (qt, d) = (qt.as_ptr(), d.as_ptr() as *const u16);
        by_qv!(bf16_qv, qv, argmax, out, qt, dim, d, toks, ds)
    }
}

#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn bf16_block<const QV: usize, const N: usize, const ARGMAX: bool>(
    qt: *const u32,
    dim: usize,
    d: *const u16,
    toks: &[u32],
    ds: u32,
    best: &mut [__m512; QV],
    idx: &mut [__m512i; QV],
) {
    let rows: [*const u16; N] = std::array::from_fn(|u| d.add(toks[u] as usize * dim));
    let mut acc = [[_mm512_setzero_ps(); QV]; N];
    for k in 0..dim / 2 {
        let q: [__m512bh; QV] =
            std::array::from_fn(|v| std::mem::transmute(_mm512_loadu_si512(qt.add((k * QV + v) * 16) as *const _)));
        for u in 0..N {
            let pair = (rows[u].add(2 * k) as *const u32).read_unaligned();
            let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair as i32));
            for v in 0..QV {
                acc[u][v] = _mm512_dpbf16_ps(acc[u][v], q[v], b);
            }
        }
    }
    fold::<QV, N, ARGMAX>(&acc, toks, ds, best, idx);
}

/// Whether this CPU runs the INT8 kernel (VPDPBUSD).
pub(crate) fn available_i8() -> bool {
    available() && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// [`pack_queries`] for signed 8-bit rows (`dim` a multiple of 4): element
/// `(k, v, l)` at `(k·QV + v)·16 + l` is row `16v + l`'s features `4k ..
/// 4k + 3` as one 32-bit word, the signed operand of VPDPBUSD. The 32 words
/// after them hold `−128 · Σ row` (I32), which starts each accumulator:
/// the document bytes enter as the unsigned operand offset by 128.
pub(crate) fn pack_queries_i8(q: &[i8], dim: usize, rows: Range<usize>, qt: &mut Vec<u32>) -> usize {
    let qv = pack_rows(q, dim, rows.clone(), qt, |x: &[i8; 4]| u32::from_le_bytes(x.map(|b| b as u8)));
    let body = qt.len();
    qt.resize(body + 32, 0);
    for (r, row) in rows.enumerate() {
        qt[body + r] = (-128 * q[row * dim..(row + 1) * dim].iter().map(|&b| b as i32).sum::<i32>()) as u32;
    }
    qv
}

/// `out[r] = max over toks of scale[tok] · ⟨q_r, d[tok]⟩` for the ≤ 32
/// packed signed 8-bit query rows (lanes past them are garbage): exact I32
/// dot products (VPDPBUSD, 4 features per lane and instruction), scaled in
/// F32 per token before the max. `toks` non-empty, rows of `d` `dim` wide.
pub(crate) fn doc_max_i8(
    qt: &[u32],
    qv: usize,
    dim: usize,
    d: &[i8],
    scale: &[f32],
    toks: &[u32],
    out: &mut [f32; 32],
) {
    debug_assert!(dim.is_multiple_of(4) && qt.len() >= dim / 4 * qv * 16 + 32);
    debug_assert!(toks.iter().all(|&t| (t as usize + 1) * dim <= d.len() && (t as usize) < scale.len()));
    // SAFETY: `available_i8()` was checked by the caller; the asserted lengths cover every load
    // (qt holds dim/4·qv·16 words and the 32 corrections, each token row dim bytes of d, and a scale).
    unsafe {
        let (qt, d, s) = (qt.as_ptr(), d.as_ptr() as *const u8, scale.as_ptr());
        match qv {
            1 => i8_qv::<1>(qt, dim, d, s, toks, out),
            _ => i8_qv::<2>(qt, dim, d, s, toks, out),
        }
    }
}

#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn i8_qv<const QV: usize>(
    qt: *const u32,
    dim: usize,
    d: *const u8,
    s: *const f32,
    toks: &[u32],
    out: &mut [f32; 32],
) {
    let corr: [__m512i; QV] =
        std::array::from_fn(|v| _mm512_loadu_si512(qt.add(dim / 4 * QV * 16 + 16 * v) as *const _));
    let mut best = [_mm512_set1_ps(f32::NEG_INFINITY); QV];
    let mut g = 0;
    while g + U <= toks.len() {
        // Eight groups ahead (a row is dim bytes: one or two lines): a token takes a
        // quarter of the F32 kernel's time, whose two groups lead by too little here
        // (rerank 1 x 1000 x 300: 2.52 -> 2.16 ms; sixteen groups: 2.33).
        for &t in &toks[(g + 8 * U).min(toks.len())..(g + 9 * U).min(toks.len())] {
            let row = d.add(t as usize * dim) as *const i8;
            for line in (0..dim).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(row.add(line));
            }
        }
        i8_block::<QV, U>(qt, dim, d, s, &toks[g..g + U], &corr, &mut best);
        g += U;
    }
    match toks.len() - g {
        0 => {}
        1 => i8_block::<QV, 1>(qt, dim, d, s, &toks[g..], &corr, &mut best),
        2 => i8_block::<QV, 2>(qt, dim, d, s, &toks[g..], &corr, &mut best),
        3 => i8_block::<QV, 3>(qt, dim, d, s, &toks[g..], &corr, &mut best),
        4 => i8_block::<QV, 4>(qt, dim, d, s, &toks[g..], &corr, &mut best),
        _ => i8_block::<QV, 5>(qt, dim, d, s, &toks[g..], &corr, &mut best),
    }
    for (v, b) in best.iter().enumerate() {
        _mm512_storeu_ps(out.as_mut_ptr().add(16 * v), *b);
    }
}

/// `N` tokens: `N·QV` I32 accumulators over the features (each starting at
/// the rows' correction), then converted, scaled by the token's scale and
/// folded into `best`.
#[target_feature(enable = "avx512f,avx512vnni")]
#[inline]
unsafe fn i8_block<const QV: usize, const N: usize>(
    qt: *const u32,
    dim: usize,
    d: *const u8,
    s: *const f32,
    toks: &[u32],
    corr: &[__m512i; QV],
    best: &mut [__m512; QV],
) {
    let rows: [*const u8; N] = std::array::from_fn(|u| d.add(toks[u] as usize * dim));
    let mut acc = [*corr; N];
    let flip = _mm512_set1_epi32(0x8080_8080u32 as i32);
    for k in 0..dim / 4 {
        let q: [__m512i; QV] = std::array::from_fn(|v| _mm512_loadu_si512(qt.add((k * QV + v) * 16) as *const _));
        for u in 0..N {
            let quad = (rows[u].add(4 * k) as *const i32).read_unaligned();
            // d + 128 as unsigned bytes: the flip of each sign bit.
            let b = _mm512_xor_si512(_mm512_set1_epi32(quad), flip);
            for v in 0..QV {
                acc[u][v] = _mm512_dpbusd_epi32(acc[u][v], b, q[v]);
            }
        }
    }
    for u in 0..N {
        let sc = _mm512_set1_ps(*s.add(toks[u] as usize));
        for v in 0..QV {
            best[v] = _mm512_max_ps(best[v], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[u][v]), sc));
        }
    }
}
