//! BF16 linear layers on the CPU: `x [M, K] · w [N, K]ᵀ` with F32
//! accumulation, on one of two engines, where widening to F32 ran the
//! products on FMA units at a fraction of the BF16 rate:
//! - Intel AMX tiles (Sapphire Rapids and newer): A tiles of 16 rows × 32
//!   BF16, B tiles of 16 K pairs × 16 columns, four 16 × 16 F32
//!   accumulator tiles per 32 × 32 block, every A and B tile used twice;
//! - AVX512-BF16 (AMD Zen 4 and newer, Intel Cooper Lake, or Intel CPUs
//!   without the tile permission): VDPBF16PS adds two K elements' products
//!   per F32 lane, 8 rows × 32 columns of accumulators at a time, each
//!   packed B vector used by 8 rows.
//!
//! Both read the same operands: 32 rows of x copied with K padded to a
//! multiple of 32 with zeros, and w packed once per call in pair-interleaved
//! ("VNNI") blocks, which are both AMX's B tiles and VDPBF16PS's B vectors.
//! Each rayon task computes a block of 32 rows × a range of 32-column pairs.
//! An engine's results do not depend on the blocking or the thread count
//! (each output sums its K pairs in order), so a layer's inference and its
//! tracked forward give the same values; the two engines round their inner
//! sums differently and may differ in the last bit.
//!
//! The AMX instructions are written by mnemonic in `asm!` (Rust has no
//! stable AMX intrinsics); the kernel asks Linux for the tile state once per
//! process (`arch_prctl(ARCH_REQ_XCOMP_PERM)`). Without either engine
//! ([`engine`] is `None`) callers keep their F32 path.

use half::bf16;
use rayon::prelude::*;
use std::arch::asm;
use std::arch::x86_64::*;

/// Rows of a task: two A tiles of 16.
const BM: usize = 32;
/// BF16 elements of K per tile row (64 bytes).
const TK: usize = 32;
/// Elements of one packed B tile: 16 K pairs × 16 columns × 2.
const B_TILE: usize = 16 * 32;
/// Rows of the AVX512-BF16 engine's accumulators at a time: 8 × 2 vectors
/// of 16 columns, 16 independent VDPBF16PS chains (latency 6 on Zen 4).
const DOT_ROWS: usize = 8;

/// The engine of BF16 products on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Engine {
    /// AMX tiles.
    Amx,
    /// VDPBF16PS on AVX-512 vectors.
    Dot,
}

/// The engine BF16 linear layers run on here (checked once): AMX where the
/// CPU has it and Linux grants the tile state, else AVX512-BF16, else
/// none. `CANDLE_MAXSIM_CPU=noamx` or `bf16dot` skip the tiles,
/// `bf16widen` both engines.
pub(crate) fn engine() -> Option<Engine> {
    static ENGINE: std::sync::OnceLock<Option<Engine>> = std::sync::OnceLock::new();
    *ENGINE.get_or_init(|| {
        let k = crate::knobs::knobs();
        if k.cpu_bf16_dot == Some(false) {
            None
        } else if !k.cpu_no_amx && k.cpu_bf16_dot.is_none() && cpu_has_amx_bf16() && request_tile_state() {
            Some(Engine::Amx)
        } else if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16") {
            Some(Engine::Dot)
        } else {
            None
        }
    })
}

/// CPUID leaf 7: AMX-BF16 (EDX bit 22) and AMX-TILE (EDX bit 24).
fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::__cpuid_count;
    __cpuid_count(0, 0).eax >= 7 && {
        let edx = __cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0
    }
}

/// Linux's permission for the tile data state (XTILEDATA, feature 18), for
/// every thread of the process; false where the kernel refuses it.
fn request_tile_state() -> bool {
    if !cfg!(target_os = "linux") {
        return false;
    }
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain system call; it changes no memory of this process.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

/// The tile configuration (palette 1): all eight tiles 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    _reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut c = TileConfig { palette: 1, start_row: 0, _reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    let mut t = 0;
    while t < 8 {
        c.colsb[t] = 64;
        c.rows[t] = 16;
        t += 1;
    }
    c
};

/// w [N, K] in B tiles: column block j (16 columns, padded with zero columns
/// to an even count of blocks) and K block q (32 elements, zero past K) at
/// element `(j · kb + q) · B_TILE`; inside, K pair p of column c at `p · 32 + 2c`.
fn pack_w(w: &[bf16], n: usize, k: usize, kb: usize) -> (Vec<u16>, usize) {
    let nb = n.div_ceil(16).next_multiple_of(2);
    let mut packed = vec![0u16; nb * kb * B_TILE];
    packed.par_chunks_mut(kb * B_TILE).enumerate().for_each(|(j, block)| {
        for c in 0..16 {
            let col = j * 16 + c;
            if col >= n {
                break;
            }
            let row = &w[col * k..(col + 1) * k];
            for (kk, v) in row.iter().enumerate() {
                let (q, r) = (kk / TK, kk % TK);
                block[q * B_TILE + (r / 2) * 32 + 2 * c + r % 2] = v.to_bits();
            }
        }
    });
    (packed, nb)
}

/// The operands of a product: `x [m, k]` and `w [n, k]`, row-major BF16.
#[derive(Clone, Copy)]
pub(crate) struct Operands<'a> {
    pub(crate) x: &'a [bf16],
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) w: &'a [bf16],
    pub(crate) n: usize,
}

/// `x · wᵀ` as F32 `[m, n]`, row-major; `e` from [`engine`].
pub(crate) fn matmul_nt(e: Engine, ops: Operands) -> Vec<f32> {
    run(e, ops, |acc: &[f32], out: &mut [f32], _| out.copy_from_slice(acc))
}

/// `act(x · wᵀ + b)` rounded to BF16, each output written once (a linear
/// layer's inference: no F32 product in memory): the same values as
/// [`matmul_nt`] followed by the bias, GELU and rounding of
/// `nn::add_bias` / `add_bias_gelu` and `to_dtype`.
pub(crate) fn linear(e: Engine, ops: Operands, b: Option<&[f32]>, gelu: bool) -> Vec<bf16> {
    use crate::ops::rows::gelu_f32;
    run(e, ops, |acc: &[f32], out: &mut [bf16], c0| {
        crate::cpu::math::simd(
            #[inline(always)]
            || match (b, gelu) {
                (Some(b), true) => {
                    out.iter_mut().zip(acc).zip(&b[c0..]).for_each(|((o, &a), &b)| *o = bf16::from_f32(gelu_f32(a + b)))
                }
                (Some(b), false) => {
                    out.iter_mut().zip(acc).zip(&b[c0..]).for_each(|((o, &a), &b)| *o = bf16::from_f32(a + b))
                }
                (None, true) => out.iter_mut().zip(acc).for_each(|(o, &a)| *o = bf16::from_f32(gelu_f32(a))),
                (None, false) => out.iter_mut().zip(acc).for_each(|(o, &a)| *o = bf16::from_f32(a)),
            },
        )
    })
}

/// The product in 32 × 32 blocks, each row piece of a block handed to
/// `write(acc, out, c0)`: its F32 values, the output elements they become
/// (row-major `[m, n]`) and the first column.
fn run<T: Copy + Default + Send + Sync>(
    e: Engine,
    Operands { x, m, k, w, n }: Operands,
    write: impl Fn(&[f32], &mut [T], usize) + Sync,
) -> Vec<T> {
    let mut out = vec![T::default(); m * n];
    if m == 0 || n == 0 {
        return out;
    }
    let kb = k.div_ceil(TK).max(1);
    let (packed, nb) = pack_w(w, n, k, kb);
    let pairs = nb / 2;
    // Tasks: row blocks × ranges of column pairs, about 4 per thread when
    // the rows alone are too few (a short batch).
    let row_blocks = m.div_ceil(BM);
    let want = 4 * rayon::current_num_threads();
    let chunks = want.div_ceil(row_blocks).clamp(1, pairs);
    let per = pairs.div_ceil(chunks);
    let dst = Out(out.as_mut_ptr());
    (0..row_blocks * chunks).into_par_iter().for_each(|task| {
        let (r0, p0) = ((task / chunks) * BM, (task % chunks) * per);
        let p1 = (p0 + per).min(pairs);
        if p0 >= p1 {
            return;
        }
        // This block's rows, K padded: the A tiles read 64-byte rows.
        let mut xa = vec![0u16; BM * kb * TK];
        for r in 0..BM.min(m - r0) {
            let src = &x[(r0 + r) * k..(r0 + r + 1) * k];
            for (d, s) in xa[r * kb * TK..][..k].iter_mut().zip(src) {
                *d = s.to_bits();
            }
        }
        let mut acc = [0f32; BM * 32];
        let o = &dst;
        // SAFETY: the engine is this CPU's (`engine`): for AMX the tile
        // state was granted. Every load reads inside xa (BM rows of kb·32)
        // or inside the pair's two packed column blocks; the stores write
        // the 32 × 32 acc. Tasks write disjoint (rows, columns) blocks of `out`.
        unsafe {
            if e == Engine::Amx {
                asm!("ldtilecfg [{0}]", in(reg) &CONFIG, options(nostack, readonly));
            }
            for pair in p0..p1 {
                let b = &packed[2 * pair * kb * B_TILE..];
                match e {
                    Engine::Amx => block_product(&xa, kb, b, kb * B_TILE, &mut acc),
                    Engine::Dot => block_product_dot(&xa, kb, b, kb * B_TILE, &mut acc),
                }
                let c0 = pair * 32;
                let cols = 32.min(n.saturating_sub(c0));
                for r in 0..BM.min(m - r0) {
                    let row = std::slice::from_raw_parts_mut(o.0.add((r0 + r) * n + c0), cols);
                    write(&acc[r * 32..r * 32 + cols], row, c0);
                }
            }
            if e == Engine::Amx {
                asm!("tilerelease", options(nostack, nomem));
            }
        }
    });
    out
}

/// The output buffer, shared by the tasks (each writes its own blocks).
struct Out<T>(*mut T);
// SAFETY: the tasks write disjoint blocks of one live buffer.
unsafe impl<T> Send for Out<T> {}
unsafe impl<T> Sync for Out<T> {}

/// acc[32 × 32] = xa[32 rows, kb·32] · (two column blocks of packed w)ᵀ:
/// tmm0..3 the four 16 × 16 accumulators, tmm4 / tmm5 the A tiles of rows
/// 0-15 / 16-31, tmm6 / tmm7 the B tiles of the two column blocks
/// (`next` elements apart).
///
/// # Safety
/// The tiles are configured (CONFIG) on this thread; xa holds 32 rows of
/// kb·32 elements and b two blocks of kb tiles, `next` elements apart.
#[inline(always)]
unsafe fn block_product(xa: &[u16], kb: usize, b: &[u16], next: usize, acc: &mut [f32; BM * 32]) {
    let a_stride = kb * TK * 2; // bytes between rows of xa
    asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
    for q in 0..kb {
        let a0 = xa.as_ptr().add(q * TK);
        let a1 = a0.add(16 * kb * TK);
        let b0 = b.as_ptr().add(q * B_TILE);
        let b1 = b0.add(next);
        asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm6, [{b0} + {sb}*1]",
            "tileloadd tmm7, [{b1} + {sb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a0, a1 = in(reg) a1, b0 = in(reg) b0, b1 = in(reg) b1,
            sa = in(reg) a_stride, sb = in(reg) 64usize,
            options(nostack, readonly),
        );
    }
    let c = acc.as_mut_ptr();
    asm!(
        "tilestored [{c0} + {s}*1], tmm0",
        "tilestored [{c1} + {s}*1], tmm1",
        "tilestored [{c2} + {s}*1], tmm2",
        "tilestored [{c3} + {s}*1], tmm3",
        c0 = in(reg) c, c1 = in(reg) c.add(16), c2 = in(reg) c.add(16 * 32), c3 = in(reg) c.add(16 * 32 + 16),
        s = in(reg) 128usize,
        options(nostack),
    );
}

/// [`block_product`] on AVX512-BF16: for each group of 8 rows, 16 vectors of
/// 16 F32 columns, each K pair p adding `x[r, 2p..2p+2] · w[c, 2p..2p+2]`
/// (VDPBF16PS: the row's pair broadcast, the packed columns' pairs as they
/// are in the B tiles: pair p of column c at `p·32 + 2c`).
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16; xa holds 32 rows of kb·32
/// elements and b two blocks of kb B tiles, `next` elements apart.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block_product_dot(xa: &[u16], kb: usize, b: &[u16], next: usize, acc: &mut [f32; BM * 32]) {
    debug_assert!(xa.len() >= BM * kb * TK && b.len() >= next + kb * B_TILE);
    let (xa, b) = (xa.as_ptr(), b.as_ptr());
    for g in 0..BM / DOT_ROWS {
        let mut c = [[_mm512_setzero_ps(); 2]; DOT_ROWS];
        let rows: [*const u32; DOT_ROWS] = std::array::from_fn(|r| xa.add((g * DOT_ROWS + r) * kb * TK) as *const u32);
        for p in 0..kb * TK / 2 {
            let at = (p / 16) * B_TILE + (p % 16) * 32;
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(at) as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(next + at) as *const _));
            for r in 0..DOT_ROWS {
                let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(rows[r].add(p).read_unaligned() as i32));
                c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
                c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
            }
        }
        for (r, c) in c.iter().enumerate() {
            let out = acc.as_mut_ptr().add((g * DOT_ROWS + r) * 32);
            _mm512_storeu_ps(out, c[0]);
            _mm512_storeu_ps(out.add(16), c[1]);
        }
    }
}
