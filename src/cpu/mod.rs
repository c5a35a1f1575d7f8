//! The CPU MaxSim engine: tiled GEMM (the `gemm` crate candle uses) with a
//! running max/argmax per (query row, document), on all cores through rayon.
//! The `[Nq, Nd, Lq, Ld]` similarity tensor is never materialized: a work item
//! holds one `[≤128, ≤512]` score tile at a time. On CPUs with AVX-512 the
//! F32 and BF16 forward runs the lane kernels of avx512.rs instead (no tile at
//! all), as does the symmetric 8-bit forward with AVX512_VNNI; the backward
//! is the same for both.

use crate::layout::{Pairing, Problem, Seqs};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod linear;
pub(crate) mod math;
pub(crate) mod storage;

/// Query rows per GEMM tile. Also the chunk in which long queries are
/// processed: scores of successive 128-token chunks are summed (exact).
pub(crate) const Q_TILE: usize = 128;
/// Document rows per GEMM tile (and per work item, unless one document is longer).
const D_TILE: usize = 512;

/// Compute types of the CPU engine: F32 (for F16/BF16/F32 inputs) and F64.
pub(crate) trait Float:
    Copy + Send + Sync + PartialOrd + std::ops::AddAssign + std::ops::Mul<Output = Self> + 'static
{
    const ZERO: Self;
    const NEG_INF: Self;
    const ONE: Self;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// The slice as F32, when `Self` is F32 (the SIMD forward's type).
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        let _ = s;
        None
    }
}
impl Float for f32 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    const ONE: Self = 1.0;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}
impl Float for f64 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    const ONE: Self = 1.0;
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as f64
    }
}

/// Host view of a problem: offsets, flags and pairs as slices.
pub(crate) struct HostProblem<'a> {
    pub dim: usize,
    pub q: &'a Seqs,
    pub d: &'a Seqs,
    pub q_valid: Option<&'a [u8]>,
    pub d_valid: Option<&'a [u8]>,
    pub pairs: &'a Pairing,
}

impl<'a> HostProblem<'a> {
    pub fn new(p: &'a Problem, q_valid: Option<&'a [u8]>, d_valid: Option<&'a [u8]>) -> Self {
        Self { dim: p.dim, q: &p.q, d: &p.d, q_valid, d_valid, pairs: &p.pairs }
    }
    #[inline]
    fn q_ok(&self, row: usize) -> bool {
        self.q_valid.is_none_or(|v| v[row] != 0)
    }
    #[inline]
    fn d_ok(&self, row: usize) -> bool {
        self.d_valid.is_none_or(|v| v[row] != 0)
    }
}

/// One unit of parallel work: queries `q0..q1` against documents `j0..j1`
/// (consecutive, so both are contiguous row ranges). The item owns the output
/// scores of its pairs, so items never write the same element.
#[derive(Clone, Copy, Debug)]
struct Item {
    q0: usize,
    q1: usize,
    j0: usize,
    j1: usize,
    /// Pair index of (q0, j0); pair (i, j) is `base + (i - q0) * stride + (j - j0)`.
    base: usize,
    stride: usize,
}

fn items(p: &HostProblem) -> Vec<Item> {
    let mut out = Vec::new();
    match p.pairs {
        Pairing::Cross { nq, nd } => {
            let qg = groups(p.q, *nq, Q_TILE);
            let dg = groups(p.d, *nd, D_TILE);
            for &(q0, q1) in &qg {
                for &(j0, j1) in &dg {
                    out.push(Item { q0, q1, j0, j1, base: q0 * nd + j0, stride: *nd });
                }
            }
        }
        Pairing::List { pq, pd, .. } => {
            // Runs of pairs with one query and consecutive documents share a GEMM
            // (the KD layout is one run per query).
            let mut p0 = 0;
            while p0 < pq.len() {
                let (i, j0) = (pq[p0] as usize, pd[p0] as usize);
                let mut rows = p.d.end(j0) - p.d.start(j0);
                let mut p1 = p0 + 1;
                while p1 < pq.len() && pq[p1] as usize == i && pd[p1] as usize == j0 + (p1 - p0) {
                    let j = pd[p1] as usize;
                    let r = p.d.end(j) - p.d.start(j);
                    if rows + r > D_TILE {
                        break;
                    }
                    rows += r;
                    p1 += 1;
                }
                out.push(Item { q0: i, q1: i + 1, j0, j1: j0 + (p1 - p0), base: p0, stride: 0 });
                p0 = p1;
            }
        }
    }
    out
}

/// Consecutive sequences grouped while their rows fit in `cap` and there are
/// at most `cap` of them (a longer sequence is a group of its own and is
/// tiled inside the item).
fn groups(s: &Seqs, n: usize, cap: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut a = 0;
    while a < n {
        let mut b = a + 1;
        while b < n && b - a < cap && s.end(b) - s.start(a) <= cap {
            b += 1;
        }
        out.push((a, b));
        a = b;
    }
    out
}

/// Raw output pointer shared by items that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedMut<T>(*mut T);
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}
impl<T> SharedMut<T> {
    /// Through a method, so closures capture the Send/Sync wrapper, not the raw field.
    fn ptr(&self) -> *mut T {
        self.0
    }
}

/// An output buffer shared by parallel tasks, each of which writes its own
/// block of it (through [`gemm_into`] or by hand).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: the tasks write disjoint blocks of one live buffer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The element `off` past the start (within the buffer).
    pub(crate) fn at(self, off: usize) -> *mut f32 {
        // SAFETY: callers stay within the output buffer.
        unsafe { self.0.add(off) }
    }
}

/// A strided matrix operand of [`gemm_into`]: its first element and the
/// distances between rows and between columns.
#[derive(Clone, Copy)]
pub(crate) struct Mat<T> {
    ptr: *const T,
    row: isize,
    col: isize,
}

impl<T> Mat<T> {
    /// A row-major matrix whose rows start `ld` elements apart.
    pub(crate) fn rows(ptr: *const T, ld: usize) -> Self {
        Mat { ptr, row: ld as isize, col: 1 }
    }

    /// The transpose of a row-major matrix whose rows start `ld` elements apart.
    pub(crate) fn t(ptr: *const T, ld: usize) -> Self {
        Mat { ptr, row: 1, col: ld as isize }
    }
}

/// `dst[m×n] = a[m×k] · b[k×n]` on the calling thread, `dst` row-major
/// with rows `ld` apart, never read (every element of the block written).
///
/// # Safety
/// Every element the shapes and strides address lies in a live buffer, and
/// no one else touches `dst`'s block meanwhile.
pub(crate) unsafe fn gemm_into<T: Float>(m: usize, n: usize, k: usize, dst: *mut T, ld: usize, a: Mat<T>, b: Mat<T>) {
    // SAFETY: the caller's promise.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            ld as isize,
            false,
            a.ptr,
            a.col,
            a.row,
            b.ptr,
            b.col,
            b.row,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// `out[m×n] = a[m×k] · b[n×k]ᵀ`, both row-major with row stride k.
fn gemm_abt<T: Float>(m: usize, n: usize, k: usize, a: &[T], b: &[T], out: &mut [T]) {
    debug_assert!(a.len() >= m * k && b.len() >= n * k && out.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the asserted lengths cover every element addressed by these strides.
    unsafe { gemm_into(m, n, k, out.as_mut_ptr(), n, Mat::rows(a.as_ptr(), k), Mat::t(b.as_ptr(), k)) }
}

/// Scores (and, if `argmax` is requested, the winning document-local token
/// per (pair, query position); -1 where the query token is masked or the
/// document is empty). Layout of the argmax: `[n_pairs, q.max_len()]`.
pub(crate) fn forward<T: Float>(p: &HostProblem, q: &[T], d: &[T], want_argmax: bool) -> (Vec<f32>, Option<Vec<i32>>) {
    #[cfg(target_arch = "x86_64")]
    if let (Some(q), Some(d), true) = (T::as_f32(q), T::as_f32(d), avx512::available()) {
        return forward_lanes::<F32Fma>(p, q, d, None, want_argmax);
    }
    with_outputs(p, want_argmax, |out, am, mlq| {
        items(p).par_iter().for_each_init(Vec::new, |buf, it| {
            // SAFETY: items own disjoint pair indices (see `Item`).
            unsafe { run_item(p, q, d, it, buf, out, am, mlq) }
        })
    })
}

/// The scores `[n_pairs]` and, if wanted, the argmax `[n_pairs, max_lq]`
/// (-1 where never written), filled by `fill(scores, argmax or null, max_lq)`.
fn with_outputs(
    p: &HostProblem,
    want_argmax: bool,
    fill: impl FnOnce(SharedMut<f32>, SharedMut<i32>, usize),
) -> (Vec<f32>, Option<Vec<i32>>) {
    let mlq = p.q.max_len();
    let mut scores = vec![0f32; p.pairs.len()];
    let mut argmax = want_argmax.then(|| vec![-1i32; p.pairs.len() * mlq]);
    let am = SharedMut(argmax.as_mut().map_or(std::ptr::null_mut(), |a| a.as_mut_ptr()));
    fill(SharedMut(scores.as_mut_ptr()), am, mlq);
    (scores, argmax)
}

/// The lane kernels (cpu/avx512.rs), one per element type and method:
/// F32 by FMA, BF16 by VDPBF16PS or widened to F32, I8 by VPDPBUSD.
#[cfg(target_arch = "x86_64")]
trait Lanes {
    /// The rows' element.
    type Elem: Sync;
    /// The packed query rows' element.
    type Packed: Copy + Default + Send;
    fn pack(q: &[Self::Elem], dim: usize, rows: std::ops::Range<usize>, qt: &mut Vec<Self::Packed>) -> usize;
    /// The rows' maxima over `toks` (see avx512::doc_max); `d_scale`, the
    /// per-token scales of 8-bit documents, is applied before the max.
    #[allow(clippy::too_many_arguments)]
    fn doc_max(
        qt: &[Self::Packed],
        qv: usize,
        dim: usize,
        d: &[Self::Elem],
        d_scale: Option<&[f32]>,
        toks: (&[u32], u32),
        out: &mut [f32; 32],
        argmax: Option<&mut [i32; 32]>,
    );
}

/// A lane kernel without document scales: `pack`, then `doc_max`.
macro_rules! lanes {
    ($name:ident, $elem:ty, $packed:ty, $pack:path, $doc_max:path) => {
        #[cfg(target_arch = "x86_64")]
        struct $name;
        #[cfg(target_arch = "x86_64")]
        impl Lanes for $name {
            type Elem = $elem;
            type Packed = $packed;
            fn pack(q: &[$elem], dim: usize, rows: std::ops::Range<usize>, qt: &mut Vec<$packed>) -> usize {
                $pack(q, dim, rows, qt)
            }
            fn doc_max(
                qt: &[$packed],
                qv: usize,
                dim: usize,
                d: &[$elem],
                _: Option<&[f32]>,
                toks: (&[u32], u32),
                out: &mut [f32; 32],
                argmax: Option<&mut [i32; 32]>,
            ) {
                $doc_max(qt, qv, dim, d, toks, out, argmax)
            }
        }
    };
}
lanes!(F32Fma, f32, f32, avx512::pack_queries, avx512::doc_max);
lanes!(Bf16Dot, half::bf16, u32, avx512::pack_queries_bf16, avx512::doc_max_bf16);
lanes!(Bf16Widen, half::bf16, f32, avx512::pack_queries_widened, avx512::doc_max_widened);

/// [`forward`] of a BF16 problem on a BF16 lane kernel (F32 accumulation):
/// VDPBF16PS or widened rows, as `avx512::bf16_by_dot` picks; `None` where
/// neither applies (no AVX-512F; VDPBF16PS: no AVX512_BF16 or an odd dim;
/// widening: a dim over `avx512::WIDEN_MAX_DIM`), and the inputs then go
/// through F32.
pub(crate) fn forward_bf16(
    p: &HostProblem,
    q: &[half::bf16],
    d: &[half::bf16],
    want_argmax: bool,
) -> Option<(Vec<f32>, Option<Vec<i32>>)> {
    #[cfg(target_arch = "x86_64")]
    {
        if p.dim.is_multiple_of(2) && avx512::bf16_by_dot() {
            return Some(forward_lanes::<Bf16Dot>(p, q, d, None, want_argmax));
        }
        if p.dim <= avx512::WIDEN_MAX_DIM && avx512::available() {
            return Some(forward_lanes::<Bf16Widen>(p, q, d, None, want_argmax));
        }
    }
    let _ = (p, q, d, want_argmax);
    None
}

/// Scores (and the argmax if wanted) on lane kernel `K`; `scales`, the
/// query and document tokens' scales of 8-bit rows.
#[cfg(target_arch = "x86_64")]
fn forward_lanes<K: Lanes>(
    p: &HostProblem,
    q: &[K::Elem],
    d: &[K::Elem],
    scales: Option<(&[f32], &[f32])>,
    want_argmax: bool,
) -> (Vec<f32>, Option<Vec<i32>>) {
    with_outputs(p, want_argmax, |out, am, mlq| {
        items(p).par_iter().for_each_init(<(Vec<K::Packed>, Vec<u32>)>::default, |(qt, toks), it| {
            // SAFETY: items own disjoint pair indices (see `Item`).
            unsafe { run_item_lanes::<K>(p, q, d, scales, it, qt, toks, out, am, mlq) }
        })
    })
}

#[cfg(target_arch = "x86_64")]
struct I8Vnni;
#[cfg(target_arch = "x86_64")]
impl Lanes for I8Vnni {
    type Elem = i8;
    type Packed = u32;
    fn pack(q: &[i8], dim: usize, rows: std::ops::Range<usize>, qt: &mut Vec<u32>) -> usize {
        avx512::pack_queries_i8(q, dim, rows, qt)
    }
    fn doc_max(
        qt: &[u32],
        qv: usize,
        dim: usize,
        d: &[i8],
        d_scale: Option<&[f32]>,
        (toks, _): (&[u32], u32),
        out: &mut [f32; 32],
        _: Option<&mut [i32; 32]>,
    ) {
        avx512::doc_max_i8(qt, qv, dim, d, d_scale.expect("8-bit documents have scales"), toks, out)
    }
}

/// Scores of a symmetric 8-bit problem, `Σ_r q_scale[r] · max_t d_scale[t]
/// · ⟨q_r, d_t⟩` with exact I32 dot products (VPDPBUSD), or `None` where
/// the CPU lacks AVX512_VNNI or `dim` is not a multiple of 4 (the caller
/// then scores the dequantized rows).
pub(crate) fn forward_i8(
    p: &HostProblem,
    (q, q_scale): (&[i8], &[f32]),
    (d, d_scale): (&[i8], &[f32]),
) -> Option<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    if p.dim.is_multiple_of(4) && avx512::available_i8() {
        return Some(forward_lanes::<I8Vnni>(p, q, d, Some((q_scale, d_scale)), false).0);
    }
    let _ = (p, q, q_scale, d, d_scale);
    None
}

/// [`run_item`] on AVX-512 (cpu/avx512.rs): each query in chunks of 32
/// rows against each document's valid tokens, the argmax where `am` is set.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_item_lanes<E: Lanes>(
    p: &HostProblem,
    q: &[E::Elem],
    d: &[E::Elem],
    scales: Option<(&[f32], &[f32])>,
    it: &Item,
    qt: &mut Vec<E::Packed>,
    toks: &mut Vec<u32>,
    out: SharedMut<f32>,
    am: SharedMut<i32>,
    mlq: usize,
) {
    let nb = it.j1 - it.j0;
    let mut best = [0f32; 32];
    let mut win = [-1i32; 32];
    for i in it.q0..it.q1 {
        let mut sums = vec![0f32; nb];
        let (qs, qe) = (p.q.start(i), p.q.end(i));
        let mut c = qs;
        while c < qe {
            let c1 = (c + 32).min(qe);
            let qv = E::pack(q, p.dim, c..c1, qt);
            for (jj, j) in (it.j0..it.j1).enumerate() {
                let ds = p.d.start(j);
                toks.clear();
                toks.extend((ds..p.d.end(j)).filter(|&t| p.d_ok(t)).map(|t| t as u32));
                if toks.is_empty() {
                    continue;
                }
                let pair = it.base + (i - it.q0) * it.stride + jj;
                let d_scale = scales.map(|s| s.1);
                E::doc_max(
                    qt,
                    qv,
                    p.dim,
                    d,
                    d_scale,
                    (toks, ds as u32),
                    &mut best,
                    (!am.0.is_null()).then_some(&mut win),
                );
                for (r, row) in (c..c1).enumerate() {
                    if p.q_ok(row) {
                        // A query row's scale is positive: applied after the max.
                        sums[jj] += scales.map_or(best[r], |s| s.0[row] * best[r]);
                        if !am.0.is_null() {
                            *am.0.add(pair * mlq + row - qs) = win[r];
                        }
                    }
                }
            }
            c = c1;
        }
        for (jj, s) in sums.into_iter().enumerate() {
            *out.0.add(it.base + (i - it.q0) * it.stride + jj) = s;
        }
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn run_item<T: Float>(
    p: &HostProblem,
    q: &[T],
    d: &[T],
    it: &Item,
    buf: &mut Vec<T>,
    out: SharedMut<f32>,
    am: SharedMut<i32>,
    mlq: usize,
) {
    let dim = p.dim;
    let nb = it.j1 - it.j0;
    let (dr0, dr1) = (p.d.start(it.j0), p.d.end(it.j1 - 1));
    let (qr0, qr1) = (p.q.start(it.q0), p.q.end(it.q1 - 1));
    let mut best = vec![(T::NEG_INF, -1i32); Q_TILE.min(qr1 - qr0) * nb];
    let mut sums = vec![T::ZERO; (it.q1 - it.q0) * nb];
    let mut r0 = qr0;
    while r0 < qr1 {
        let r1 = (r0 + Q_TILE).min(qr1);
        let m = r1 - r0;
        best[..m * nb].fill((T::NEG_INF, -1));
        let mut c0 = dr0;
        while c0 < dr1 {
            let c1 = (c0 + D_TILE).min(dr1);
            let n = c1 - c0;
            buf.resize(m * n, T::ZERO);
            gemm_abt(m, n, dim, &q[r0 * dim..r1 * dim], &d[c0 * dim..c1 * dim], buf);
            for (jj, j) in (it.j0..it.j1).enumerate() {
                let (ds, de) = (p.d.start(j), p.d.end(j));
                let (t0, t1) = (ds.max(c0), de.min(c1));
                if t0 >= t1 {
                    continue;
                }
                for r in 0..m {
                    let row = &buf[r * n..(r + 1) * n];
                    let slot = &mut best[r * nb + jj];
                    for t in t0..t1 {
                        // Strictly greater: ties keep the lowest token index.
                        if row[t - c0] > slot.0 && p.d_ok(t) {
                            *slot = (row[t - c0], (t - ds) as i32);
                        }
                    }
                }
            }
            c0 = c1;
        }
        // Fold this tile's maxima into the sums of the queries it covers.
        for i in it.q0..it.q1 {
            let (qs, qe) = (p.q.start(i).max(r0), p.q.end(i).min(r1));
            for row in qs..qe {
                if !p.q_ok(row) {
                    continue;
                }
                let s = row - p.q.start(i);
                for jj in 0..nb {
                    let (v, t) = best[(row - r0) * nb + jj];
                    if t >= 0 {
                        sums[(i - it.q0) * nb + jj] += v;
                        if !am.0.is_null() {
                            let pair = it.base + (i - it.q0) * it.stride + jj;
                            *am.0.add(pair * mlq + s) = t;
                        }
                    }
                }
            }
        }
        r0 = r1;
    }
    for i in it.q0..it.q1 {
        for jj in 0..nb {
            *out.0.add(it.base + (i - it.q0) * it.stride + jj) = sums[(i - it.q0) * nb + jj].to_f32();
        }
    }
}

/// Closed-form backward from the argmax: only the winning document token of
/// each (pair, query token) gets gradient. Destination-owned and summed in
/// ascending pair order, so it is deterministic (Unified and LowMem are the
/// same computation on the CPU).
pub(crate) fn backward<T: Float>(p: &HostProblem, q: &[T], d: &[T], argmax: &[i32], g: &[f32]) -> (Vec<T>, Vec<T>) {
    let dim = p.dim;
    let mlq = p.q.max_len();
    let (by_q, by_d) = pairs_by_side(p);
    let mut gq = vec![T::ZERO; q.len()];
    let mut gd = vec![T::ZERO; d.len()];
    let gq_ptr = SharedMut(gq.as_mut_ptr());
    let gd_ptr = SharedMut(gd.as_mut_ptr());
    // grad_Q[i, s] = Σ_j g[i,j] · D[j, argmax]: each query owns its rows.
    (0..p.q.n()).into_par_iter().for_each(|i| {
        let qs = p.q.start(i);
        for &pair in by_q.of(i) {
            let pair = pair as usize;
            let (_, j) = p.pairs.get(pair);
            let gv = T::from_f32(g[pair]);
            for s in 0..p.q.end(i) - qs {
                let t = argmax[pair * mlq + s];
                if t < 0 {
                    continue;
                }
                let src = &d[(p.d.start(j) + t as usize) * dim..][..dim];
                // SAFETY: rows of query i belong to this task only.
                let dst = unsafe { std::slice::from_raw_parts_mut(gq_ptr.ptr().add((qs + s) * dim), dim) };
                for (o, &x) in dst.iter_mut().zip(src) {
                    *o += gv * x;
                }
            }
        }
    });
    // grad_D[j, t] = Σ over (i, s) that chose t of g[i,j] · Q[i, s]: each doc owns its rows.
    (0..p.d.n()).into_par_iter().for_each(|j| {
        let ds = p.d.start(j);
        for &pair in by_d.of(j) {
            let pair = pair as usize;
            let (i, _) = p.pairs.get(pair);
            let gv = T::from_f32(g[pair]);
            let qs = p.q.start(i);
            for s in 0..p.q.end(i) - qs {
                let t = argmax[pair * mlq + s];
                if t < 0 {
                    continue;
                }
                let src = &q[(qs + s) * dim..][..dim];
                // SAFETY: rows of document j belong to this task only.
                let dst = unsafe { std::slice::from_raw_parts_mut(gd_ptr.ptr().add((ds + t as usize) * dim), dim) };
                for (o, &x) in dst.iter_mut().zip(src) {
                    *o += gv * x;
                }
            }
        }
    });
    (gq, gd)
}

/// Pairs grouped by query and by document, each group in ascending pair order (CSR).
struct Csr {
    offsets: Vec<usize>,
    items: Vec<u32>,
}
impl Csr {
    fn build(n: usize, keys: impl Iterator<Item = usize> + Clone) -> Self {
        let mut offsets = vec![0usize; n + 1];
        for k in keys.clone() {
            offsets[k + 1] += 1;
        }
        for i in 0..n {
            offsets[i + 1] += offsets[i];
        }
        let mut fill = offsets.clone();
        let mut items = vec![0u32; offsets[n]];
        for (pair, k) in keys.enumerate() {
            items[fill[k]] = pair as u32;
            fill[k] += 1;
        }
        Self { offsets, items }
    }
    fn of(&self, k: usize) -> &[u32] {
        &self.items[self.offsets[k]..self.offsets[k + 1]]
    }
}

fn pairs_by_side(p: &HostProblem) -> (Csr, Csr) {
    let n = p.pairs.len();
    let by_q = Csr::build(p.q.n(), (0..n).map(|k| p.pairs.get(k).0));
    let by_d = Csr::build(p.d.n(), (0..n).map(|k| p.pairs.get(k).1));
    (by_q, by_d)
}
