//! Element functions of the CPU row ops in F32, written without branches or
//! calls so that their loops vectorize (libm's `expf` is a scalar call, and
//! takes a slow path that sets `errno` on every underflow, which masked
//! attention scores hit on every padded key). [`simd`] compiles a loop
//! for AVX-512 where the CPU has it.

/// Runs `f` compiled with AVX-512 where the CPU has it (the library itself
/// is built for baseline x86-64, 4 lanes). `f` is inlined into the
/// target-feature function, so the functions above vectorize 16 wide.
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma")]
        unsafe fn wide<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        // SAFETY: the CPU has the features just detected.
        return unsafe { wide(f) };
    }
    f()
}

/// e^x in F32: x = n·ln2 + r with |r| ≤ ln2/2, e^r by Cephes' `expf`
/// polynomial, 2^n by the exponent bits. Relative error under 2e-7 on
/// [-87.3, 88.7]; 0 below (and for -inf), +inf above, NaN for NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LO: f32 = -87.336_55;
    const HI: f32 = 88.722_83;
    let c = x.clamp(LO, HI);
    // Round to nearest by adding 1.5·2^23 (no `floor`, a libm call below
    // SSE4.1); n's integer value then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let t = c * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let ni = t.to_bits() as i32 - ROUND.to_bits() as i32;
    // ln2 split in two (Cody-Waite) so that r keeps its low bits.
    let r = c - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let mut p = 1.987_569_1e-4_f32;
    for a in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = p * r + a;
    }
    let er = p * r * r + r + 1.0;
    // n ∈ [-126, 128] and 2^128 is not an F32: scale by 2^⌊n/2⌋ · 2^⌈n/2⌉.
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let y = er * pow2(ni >> 1) * pow2(ni - (ni >> 1));
    let y = if x < LO { 0.0 } else { y };
    if x > HI {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// erf(x) in F32 as a rational function of x (odd over even polynomials
/// in x², the inputs clamped to ±4 where erf is ±1 in F32): absolute error
/// under 5e-7. Coefficients of Eigen's / TensorFlow's `erf` for floats.
#[inline(always)]
pub(crate) fn erf_f32(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_3e-10_f32;
    for a in [2.770_681_4e-8, -2.101_024e-6, -5.692_506_4e-5, -7.349_906e-4, -2.954_6e-3, -1.609_603_3e-2] {
        p = p * x2 + a;
    }
    let mut q = -1.456_607_2e-5_f32;
    for b in [-2.133_740_6e-4, -1.682_827e-3, -7.373_329e-3, -1.426_474e-2] {
        q = q * x2 + b;
    }
    x * p / q
}

/// Lanes of the reductions below: independent partial results that the
/// compiler keeps in vector registers (a single running value is a serial
/// dependency chain that no compiler may reorder).
const LANES: usize = 16;

/// The largest element (-inf for an empty slice; NaNs ignored, as `f32::max`).
#[inline(always)]
pub(crate) fn max_f32(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.max(x);
        }
    }
    tail.iter().chain(acc.iter()).fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// The sum of the elements, in a fixed order (the same for any thread count).
#[inline(always)]
pub(crate) fn sum_f32(v: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

/// Σ x² accumulated in F64, in a fixed order (the same for any thread count).
#[inline(always)]
pub(crate) fn sum_sq_f64(v: &[f32]) -> f64 {
    let mut acc = [0f64; LANES / 2];
    let chunks = v.chunks_exact(LANES / 2);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x as f64 * x as f64;
        }
    }
    acc.iter().sum::<f64>() + tail.iter().map(|&x| x as f64 * x as f64).sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_matches_f64_exp() {
        let mut worst = 0f64;
        let mut x = -87.3f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2e-7, "relative error {worst}");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-1e30), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(1e30), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn erf_f32_matches_f64_erf() {
        let mut x = -6f32;
        while x < 6.0 {
            let want = candle_core::cpu::erf::erf_f64(x as f64);
            assert!((erf_f32(x) as f64 - want).abs() < 5e-7, "erf({x})");
            x += 0.0011;
        }
    }

    #[test]
    fn reductions_match_sequential() {
        let v: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1013) as f32 * 0.37 - 150.0).collect();
        for n in [0, 1, 15, 16, 17, 100, 1000] {
            let s = &v[..n];
            assert_eq!(max_f32(s), s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)));
            let want: f64 = s.iter().map(|&x| x as f64).sum();
            assert!((sum_f32(s) as f64 - want).abs() <= 1e-5 * want.abs().max(1.0));
            let want: f64 = s.iter().map(|&x| x as f64 * x as f64).sum();
            assert!((sum_sq_f64(s) - want).abs() <= 1e-12 * want.max(1.0));
        }
    }
}
