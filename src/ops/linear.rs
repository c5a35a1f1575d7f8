//! `x · wᵀ + b` (and `GELU(x · wᵀ + b)`), the projections of an encoder
//! layer. On CUDA and for 16-bit types this is candle's matmul (cuBLAS, or
//! gemm on the CPU) with the bias of [`crate::nn::add_bias`], one graph node
//! together. On the CPU in F32 the product is split into
//! tiles of `ROW_TILE` rows × half the outputs, each one single-threaded
//! `gemm` call, the tiles on all cores: candle's matmul parallelizes inside
//! one `gemm` call, which on 16 Xeon cores reached 594-890 GFLOP/s at
//! MiniLM's shapes (5 120 × 384 × 384 … 1 536) where the tiles reach
//! 809-1 205 (H200 host, 2026-12-03); on 2 cores (AMD EPYC) candle's
//! was 8 % faster over the whole encoder, so up to `MIN_TILED_THREADS`
//! threads it stays. Every element is the same `gemm` dot product either
//! way (bitwise equal in those measurements), whatever the thread count.

use crate::cpu::storage::{filled, slice};
use crate::cpu::{gemm_into, Mat, OutPtr};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Rows of `x` per CPU tile: 512 was the fastest of 256 / 512 / 1 024 at
/// MiniLM's shapes on 16 cores (256 packs the weights twice as often).
const ROW_TILE: usize = 512;
/// Output columns are split in this many tiles (2 beat 1 and 4 on 16 cores).
const COL_TILES: usize = 2;
/// Threads from which the tiles run (see the module docs).
const MIN_TILED_THREADS: usize = 5;

/// `x · wᵀ (+ b)` for `x [.., K]`, `w [N, K]` (a linear layer's weight, as
/// stored) and `b [N]`, in `x`'s dtype → `[.., N]`. Differentiable in all
/// three; on the CPU a tiled parallel product in F32 (16-bit inputs widened
/// and the result rounded once; see the module docs), elsewhere candle's
/// matmul. Outside the tiled CPU path, product and bias are one graph node
/// (on CUDA the bias added in place to the product's buffer): the backward
/// pays no zero-filled gradient and add for the product, and the product is
/// not kept besides the output.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    linear_act(x, w, b, false)
}

/// `GELU(x · wᵀ + b)` with the exact erf (BERT's intermediate layer),
/// operands as [`linear`]: the bias added and GELU taken in F32 (F64 for
/// F64), rounded once. Outside the tiled CPU path one graph node whose
/// backward recomputes the product (one GEMM) instead of keeping the
/// pre-activation `[.., N]` alive; on the tiled CPU path (F32, five or more
/// threads) the product and `add_bias_gelu`, two nodes.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    linear_act(x, w, Some(b), true)
}

/// The product `x [T, K] · w [N, K]ᵀ` (x of rank 2) that [`linear`] and [`linear_gelu`]
/// add their bias to (and take GELU of), in the dtype they do it in: F32
/// for 16-bit `x` on the CPU (the BF16 engine's, or the widened operands'),
/// else `x`'s. A fused backward that recomputes a pre-activation calls
/// this, so that it sees the forward's bits. No gradient.
pub(crate) fn pre_activation(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() && matches!(x.dtype(), DType::F16 | DType::BF16) {
        #[cfg(target_arch = "x86_64")]
        if let Some(engine) = crate::cpu::linear::engine().filter(|_| x.dtype() == DType::BF16 && x.elem_count() > 0) {
            if w.elem_count() > 0 {
                return x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &MatmulBf16 { engine });
            }
        }
        return linear(&x.to_dtype(DType::F32)?, &w.to_dtype(DType::F32)?, None);
    }
    linear(x, w, None)
}

fn linear_act(x: &Tensor, w: &Tensor, b: Option<&Tensor>, gelu: bool) -> Result<Tensor> {
    let k = match x.dims().last() {
        Some(&k) => k,
        None => bail!("x: linear needs at least one axis, got a scalar"),
    };
    let (n, wk) = match w.dims() {
        &[n, wk] => (n, wk),
        d => bail!("w: expected [N, {k}], got {d:?}"),
    };
    if wk != k || w.dtype() != x.dtype() {
        bail!("w: expected {:?} [N, {k}] like x, got {:?} {:?}", x.dtype(), w.dtype(), w.dims())
    }
    crate::layout::check_device("w", w, x.device())?;
    if let Some(b) = b {
        if b.dims() != [n] || !b.dtype().is_float() {
            bail!("b: expected a float [{n}], got {:?} {:?}", b.dtype(), b.dims())
        }
        crate::layout::check_device("b", b, x.device())?;
    }
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("rank ≥ 1") = n;
    let m = x.elem_count() / k.max(1);
    // A reshape is a graph node even to the same shape, and every node costs
    // the backward a zero-filled gradient and an add over the activations.
    let x2 = if x.rank() == 2 { x.clone() } else { x.reshape((m, k))? };
    if x.device().is_cpu() && matches!(x.dtype(), DType::F16 | DType::BF16) {
        #[cfg(target_arch = "x86_64")]
        if let Some(engine) = crate::cpu::linear::engine().filter(|_| x.dtype() == DType::BF16 && m * n * k > 0) {
            // BF16 products on AMX tiles or VDPBF16PS, accumulated in F32;
            // bias, GELU and the rounding as below. Without gradients, all of
            // it as each output is written (the same values).
            let (xc, wc) = (x2.contiguous()?, w.contiguous()?);
            if !(x.track_op() || w.track_op() || b.is_some_and(|b| b.track_op())) {
                let op = Bf16Linear { engine, gelu };
                let y = match b {
                    Some(b) => xc.apply_op3_no_bwd(&wc, &b.to_dtype(DType::F32)?.contiguous()?, &op)?,
                    None => xc.apply_op2_no_bwd(&wc, &op)?,
                };
                return y.reshape(shape);
            }
            let y = xc.apply_op2(&wc, MatmulBf16 { engine })?;
            let y = match b {
                Some(b) if gelu => crate::ops::rows::add_bias_gelu(&y, b)?,
                Some(b) => crate::ops::rows::add_bias(&y, b)?,
                None => y,
            };
            return y.to_dtype(x.dtype())?.reshape(shape);
        }
        // candle's CPU matmul has no fast 16-bit path (BF16 ran at a quarter
        // of F32's speed in the encoder): compute in F32, round once.
        let y = linear_act(&x.to_dtype(DType::F32)?, &w.to_dtype(DType::F32)?, b, gelu)?;
        return y.to_dtype(x.dtype());
    }
    let tiled = x.device().is_cpu() && x.dtype() == DType::F32 && rayon::current_num_threads() >= MIN_TILED_THREADS;
    let y = match b {
        Some(b) if !tiled && m * n * k > 0 => {
            let acc = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
            x2.contiguous()?.apply_op3(&w.contiguous()?, &b.to_dtype(acc)?.contiguous()?, LinearBias { gelu })?
        }
        _ => {
            // On CUDA one node (candle's `w.t()` would be another, with its
            // own zero-filled gradient and add in the backward).
            let y = if (tiled || x.device().is_cuda()) && m * n * k > 0 {
                x2.contiguous()?.apply_op2(&w.contiguous()?, MatmulT)?
            } else {
                x2.matmul(&w.t()?)?
            };
            match b {
                Some(b) if gelu => crate::ops::rows::add_bias_gelu(&y, b)?,
                Some(b) => crate::ops::rows::add_bias(&y, b)?,
                None => y,
            }
        }
    };
    if y.dims() == shape.as_slice() {
        Ok(y)
    } else {
        y.reshape(shape)
    }
}

/// `act(x [M, K] · w [N, K]ᵀ + b)`: candle's product (cuBLAS on CUDA, gemm on
/// the CPU), then the bias (and GELU) of [`crate::nn::add_bias`], on CUDA
/// over the product's own buffer.
struct LinearBias {
    gelu: bool,
}

/// `x [M, K] · w [N, K]ᵀ` by candle's product on either backend, and (M, N).
fn product<S: BackendStorage>(x: &S, lx: &Layout, w: &S, lw: &Layout) -> Result<(S, usize, usize)> {
    let (m, k) = lx.shape().dims2()?;
    let n = lw.shape().dims2()?.0;
    Ok((x.matmul(w, (1, m, n, k), lx, &lw.transpose(0, 1)?)?, m, n))
}

impl CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        if self.gelu {
            "linear_gelu"
        } else {
            "linear_bias"
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, m, n) = product(x, lx, w, lw)?;
        let out = crate::ops::rows::add_bias_cpu(&y, &Layout::contiguous((m, n)), b, lb, self.gelu)?;
        Ok((out, Shape::from((m, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (y, m, n) = product(x, lx, w, lw)?;
        crate::cuda::add_bias_in_place(&y, m, n, (b, lb), self.gelu)?;
        Ok((y, Shape::from((m, n))))
    }

    /// `dz = g` (with GELU: `g · GELU'(x · wᵀ + b)`, the product recomputed),
    /// `dx = dz · w`, `dw = dzᵀ · x`, `db` the column sums of `dz`.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (x, w) = (x.detach(), w.detach());
        let dz =
            if self.gelu { crate::ops::rows::gelu_bwd(&x.matmul(&w.t()?)?, b, g)? } else { g.to_dtype(x.dtype())? };
        let db = crate::ops::rows::sum_rows(&dz)?.to_dtype(b.dtype())?;
        Ok((Some(dz.matmul(&w)?), Some(dz.t()?.matmul(&x)?), Some(db)))
    }
}

/// `x [M, K] · w [N, K]ᵀ`: in F32 on the CPU, tiled (see the module docs);
/// on CUDA candle's product (cuBLAS).
struct MatmulT;

impl CustomOp2 for MatmulT {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, w: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (slice::<f32>("x", x, lx)?, slice::<f32>("w", w, lw)?);
        let (m, k) = lx.shape().dims2()?;
        let n = lw.dims()[0];
        let cb = n.div_ceil(COL_TILES);
        let tiles = m.div_ceil(ROW_TILE) * COL_TILES;
        let fill = |out: &mut [std::mem::MaybeUninit<f32>]| {
            let dst = OutPtr(out.as_mut_ptr().cast());
            (0..tiles).into_par_iter().for_each(|t| {
                let (r0, c0) = ((t / COL_TILES) * ROW_TILE, (t % COL_TILES) * cb);
                let (rows, cols) = (ROW_TILE.min(m - r0), cb.min(n.saturating_sub(c0)));
                if cols == 0 {
                    return;
                }
                let o = dst;
                // SAFETY: rows r0..r0+rows of x, rows c0..c0+cols of w, and this
                // tile's block of out (row stride n), all within the buffers.
                unsafe {
                    gemm_into(
                        rows,
                        cols,
                        k,
                        o.at(r0 * n + c0),
                        n,
                        Mat::rows(x.as_ptr().add(r0 * k), k),
                        Mat::t(w.as_ptr().add(c0 * k), k),
                    )
                }
            })
        };
        // SAFETY: the tiles cover every (row, column) of the output once, and
        // gemm_into writes every element of its block.
        let out = unsafe { filled(m * n, fill) };
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (y, m, n) = product(x, lx, w, lw)?;
        Ok((y, Shape::from((m, n))))
    }

    /// `dx = g · w`, `dw = gᵀ · x`.
    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (x, w) = (x.detach(), w.detach());
        Ok((Some(g.matmul(&w)?), Some(g.t()?.matmul(&x)?)))
    }
}

/// `x [M, K] · w [N, K]ᵀ` of BF16 rows on the CPU's BF16 engine, in F32
/// (src/cpu/linear.rs); the backward in F32, each gradient rounded to BF16.
#[cfg(target_arch = "x86_64")]
struct MatmulBf16 {
    engine: crate::cpu::linear::Engine,
}

#[cfg(target_arch = "x86_64")]
impl CustomOp2 for MatmulBf16 {
    fn name(&self) -> &'static str {
        "linear_bf16"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, w: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        let ops = bf16_operands(x, lx, w, lw)?;
        Ok((CpuStorage::F32(crate::cpu::linear::matmul_nt(self.engine, ops)), Shape::from((ops.m, ops.n))))
    }

    /// `dx = g · w`, `dw = gᵀ · x` in F32.
    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (xf, wf) = (x.detach().to_dtype(DType::F32)?, w.detach().to_dtype(DType::F32)?);
        let g = g.to_dtype(DType::F32)?;
        Ok((Some(g.matmul(&wf)?.to_dtype(x.dtype())?), Some(g.t()?.matmul(&xf)?.to_dtype(w.dtype())?)))
    }
}

/// The contiguous BF16 `x [m, k]` and `w [n, k]` of the BF16 engine's ops.
#[cfg(target_arch = "x86_64")]
fn bf16_operands<'a>(
    x: &'a CpuStorage,
    lx: &Layout,
    w: &'a CpuStorage,
    lw: &Layout,
) -> Result<crate::cpu::linear::Operands<'a>> {
    let (m, k) = lx.shape().dims2()?;
    let (x, w) = (slice::<half::bf16>("x", x, lx)?, slice::<half::bf16>("w", w, lw)?);
    Ok(crate::cpu::linear::Operands { x, m, k, w, n: lw.dims()[0] })
}

/// A BF16 linear layer's inference on the CPU's BF16 engine: `act(x · wᵀ + b)`
/// rounded to BF16 as each output is written (the values of [`MatmulBf16`]
/// then the bias, GELU and rounding); two operands without a bias.
#[cfg(target_arch = "x86_64")]
struct Bf16Linear {
    engine: crate::cpu::linear::Engine,
    gelu: bool,
}

#[cfg(target_arch = "x86_64")]
impl Bf16Linear {
    fn run(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: Option<&[f32]>,
    ) -> Result<(CpuStorage, Shape)> {
        let ops = bf16_operands(x, lx, w, lw)?;
        Ok((CpuStorage::BF16(crate::cpu::linear::linear(self.engine, ops, b, self.gelu)), Shape::from((ops.m, ops.n))))
    }
}

#[cfg(target_arch = "x86_64")]
impl CustomOp2 for Bf16Linear {
    fn name(&self) -> &'static str {
        "linear_bf16_inference"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, w: &CpuStorage, lw: &Layout) -> Result<(CpuStorage, Shape)> {
        self.run(x, lx, w, lw, None)
    }
}

#[cfg(target_arch = "x86_64")]
impl CustomOp3 for Bf16Linear {
    fn name(&self) -> &'static str {
        "linear_bf16_inference"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.run(x, lx, w, lw, Some(slice::<f32>("b", b, lb)?))
    }
}
