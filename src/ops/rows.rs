//! Row helpers as custom ops: a row gather with zero rows (the projection
//! head's backward, and the embedding lookup), a bias added to every row,
//! alone or followed by GELU (the encoder's linear layers), and a
//! scatter-add of rows (k-means, the embedding's gradient).
//! kernels/rows.cu on CUDA, the same loops on the CPU.

use crate::cpu::math::{erf_f32, exp_f32, simd};
use crate::cpu::storage::{f32s, filled, range, slice, store};
use candle_core::{backend::BackendStorage, bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// `[N, C]` rows of `src` `[R, C]` picked by `idx` `[N]` U32, zero rows
/// where `idx ≥ R` (each output row written once).
pub(crate) fn gather_rows(src: &Tensor, idx: &Tensor) -> Result<Tensor> {
    src.contiguous()?.apply_op2_no_bwd(&idx.contiguous()?, &GatherRows)
}

/// The rows of an embedding table `[R, C]` (F16, BF16 or F32) picked by
/// `ids` (U32, any shape), as `[ids…, C]`: a row gather whose backward is a
/// row scatter-add (candle's `index_select` backward is an `index_add`
/// that loops over every id in each of C threads, milliseconds for a
/// training batch's 40 000 tokens). An out-of-range id gives a zero row,
/// which depends on no row of the table: its gradient goes nowhere (and the
/// backward never waits for the device to check the ids).
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    crate::layout::check_rank("table", table, &[2], "rank 2 [R, C]")?;
    if !matches!(table.dtype(), DType::F16 | DType::BF16 | DType::F32) {
        bail!("table: expected F16, BF16 or F32 rows, got {:?}", table.dtype())
    }
    if ids.dtype() != DType::U32 {
        bail!("ids: expected U32 token ids, got {:?}", ids.dtype())
    }
    crate::layout::check_device("ids", ids, table.device())?;
    let mut shape = ids.dims().to_vec();
    shape.push(table.dim(1)?);
    let y = table.contiguous()?.apply_op2(&ids.flatten_all()?.contiguous()?, GatherRows)?;
    // No reshape node for 1-D ids (a node costs the backward a pass).
    if y.dims() == shape.as_slice() {
        Ok(y)
    } else {
        y.reshape(shape)
    }
}

/// `x + b` for `x` `[R, C]` (a float dtype), `b` `[C]`: added in F32 (F64
/// for F64) and rounded once, in `x`'s dtype. Differentiable: `b`'s gradient
/// is the column sums of the output's, one kernel (candle's broadcast add
/// indexes every element through the broadcast strides, and its backward
/// sums over the leading axis one strided element per thread).
pub fn add_bias(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    bias_op(x, b, AddBias { gelu: false })
}

/// `gelu_erf(x + b)` (GELU with the exact erf, BERT's "gelu"), for `x`
/// `[R, C]` and `b` `[C]` as [`add_bias`]: one op computed in F32 (F64 for
/// F64) and rounded once, with a two-kernel backward (`dz = g · GELU'(x +
/// b)` recomputed from the inputs, then its column sums). candle's
/// `gelu_erf` backward is six element-wise ops, each a graph node whose
/// gradient costs another pass.
pub fn add_bias_gelu(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    bias_op(x, b, AddBias { gelu: true })
}

fn bias_op(x: &Tensor, b: &Tensor, op: AddBias) -> Result<Tensor> {
    crate::layout::check_rank("x", x, &[2], "rank 2 [R, C]")?;
    crate::layout::check_float("x", x)?;
    if b.dims() != [x.dim(1)?] || !b.dtype().is_float() {
        bail!("b: expected a float [{}], got {:?} {:?}", x.dim(1)?, b.dtype(), b.dims())
    }
    crate::layout::check_device("b", b, x.device())?;
    let acc = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    x.contiguous()?.apply_op2(&b.to_dtype(acc)?.contiguous()?, op)
}

/// GeGLU, the gated MLP activation of ModernBERT: `GELU(a) · b` for `x =
/// [a, b]` `[R, 2C]` (F16, BF16 or F32; GELU with the exact erf) →
/// `[R, C]`, computed in F32 and rounded once. One op each way: composed
/// of candle ops it is two column slices (each a zero-padded copy of the
/// whole `[R, 2C]` gradient backward), GELU (six passes backward) and a
/// product, each a graph node whose gradient costs another pass.
pub fn geglu(x: &Tensor) -> Result<Tensor> {
    crate::layout::check_rank("x", x, &[2], "rank 2 [R, 2C]")?;
    if !matches!(x.dtype(), DType::F16 | DType::BF16 | DType::F32) {
        bail!("x: expected F16, BF16 or F32, got {:?}", x.dtype())
    }
    if x.dim(1)? % 2 != 0 {
        bail!("x: expected an even number of columns [R, 2C] (gate, then value), got {:?}", x.dims())
    }
    x.contiguous()?.apply_op1(GeGlu)
}

/// [`geglu`]'s backward from `x` and the output's gradient `g [R, C]`: `[R, 2C]`.
pub(crate) fn geglu_bwd(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(&g.to_dtype(x.dtype())?.contiguous()?, &GeGluBwd)
}

/// The CPU loops of [`geglu`] (no `g`) and of its backward (with `g`).
fn geglu_cpu(x: &[f32], g: Option<&[f32]>, c: usize) -> Vec<f32> {
    let rows = x.len() / (2 * c).max(1);
    let mut out = vec![0f32; rows * if g.is_some() { 2 * c } else { c }];
    let w = out.len() / rows.max(1);
    out.par_chunks_mut(w.max(1)).enumerate().with_min_len(64).for_each(|(r, o)| {
        let xr = &x[r * 2 * c..(r + 1) * 2 * c];
        for j in 0..c {
            let (a, b) = (xr[j], xr[c + j]);
            match g {
                None => o[j] = gelu_f32(a) * b,
                Some(g) => {
                    let gr = g[r * c + j];
                    o[j] = gr * b * gelu_grad_f32(a);
                    o[c + j] = gr * gelu_f32(a);
                }
            }
        }
    });
    out
}

struct GeGlu;
struct GeGluBwd;

impl candle_core::CustomOp1 for GeGlu {
    fn name(&self) -> &'static str {
        "geglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (r, c2) = l.shape().dims2()?;
        let y = geglu_cpu(&f32s("x", s, l)?, None, c2 / 2);
        Ok((store(y, s.dtype())?, Shape::from((r, c2 / 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (r, c2) = l.shape().dims2()?;
        Ok((crate::cuda::geglu((s, l), None)?, Shape::from((r, c2 / 2))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(geglu_bwd(x, g)?))
    }
}

impl CustomOp2 for GeGluBwd {
    fn name(&self) -> &'static str {
        "geglu_bwd"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, g: &CpuStorage, lg: &Layout) -> Result<(CpuStorage, Shape)> {
        let c = lx.shape().dims2()?.1 / 2;
        let dx = geglu_cpu(&f32s("x", x, lx)?, Some(&f32s("g", g, lg)?), c);
        Ok((store(dx, x.dtype())?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::geglu((x, lx), Some((g, lg)))?, lx.shape().clone()))
    }
}

/// `dz = g · GELU'(x + b)` in `x`'s dtype (the gradient of `add_bias_gelu`
/// at its pre-activation); `b` is in the accumulation type.
pub(crate) fn gelu_bwd(x: &Tensor, b: &Tensor, g: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3_no_bwd(b, &g.to_dtype(x.dtype())?.contiguous()?, &GeluBwd)
}

/// GELU(z) = z·Φ(z) in F32.
#[inline(always)]
pub(crate) fn gelu_f32(z: f32) -> f32 {
    0.5 * z * (1.0 + erf_f32(z * std::f32::consts::FRAC_1_SQRT_2))
}

/// GELU'(z) = Φ(z) + z·φ(z) in F32.
#[inline(always)]
fn gelu_grad_f32(z: f32) -> f32 {
    let cdf = 0.5 * (1.0 + erf_f32(z * std::f32::consts::FRAC_1_SQRT_2));
    cdf + z * exp_f32(-0.5 * z * z) * (0.5 * std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2)
}

/// GELU(z) = z·Φ(z) and its derivative Φ(z) + z·φ(z), in f64.
fn gelu_f64(z: f64) -> (f64, f64) {
    let cdf = 0.5 * (1.0 + candle_core::cpu::erf::erf_f64(z * std::f64::consts::FRAC_1_SQRT_2));
    let pdf = (-0.5 * z * z).exp() * 0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2;
    (z * cdf, cdf + z * pdf)
}

/// The column sums `[C]` F32 of `g` `[R, C]` (F16, BF16 or F32; F64 for F64).
pub(crate) fn sum_rows(g: &Tensor) -> Result<Tensor> {
    g.contiguous()?.apply_op1_no_bwd(&SumRows)
}

struct SumRows;

impl candle_core::CustomOp1 for SumRows {
    fn name(&self) -> &'static str {
        "sum_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = l.shape().dims2()?;
        let (a, b) = range("g", l)?;
        fn cols<T: Copy>(v: &[T], c: usize, get: impl Fn(T) -> f64) -> Vec<f64> {
            let mut out = vec![0f64; c];
            for row in v.chunks(c.max(1)) {
                for (o, &x) in out.iter_mut().zip(row) {
                    *o += get(x);
                }
            }
            out
        }
        let out = match s {
            CpuStorage::F16(v) => cols(&v[a..b], c, |x| x.to_f64()),
            CpuStorage::BF16(v) => cols(&v[a..b], c, |x| x.to_f64()),
            CpuStorage::F32(v) => cols(&v[a..b], c, |x| x as f64),
            CpuStorage::F64(v) => return Ok((CpuStorage::F64(cols(&v[a..b], c, |x| x)), Shape::from(c))),
            s => bail!("sum_rows: expected a float dtype, got {:?}", s.dtype()),
        };
        Ok((CpuStorage::F32(out.into_iter().map(|x| x as f32).collect()), Shape::from(c)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        if s.dtype() == DType::F64 {
            bail!("sum_rows: F64 gradients are summed on the CPU only")
        }
        Ok((crate::cuda::sum_rows((s, l))?, Shape::from(l.shape().dims2()?.1)))
    }
}

/// The sums `[n_out, C]` F32 of the rows of `src [R, C]` (F16, BF16 or F32)
/// by destination row `idx [R]` U32: `out[idx[r]] += src[r]` (e.g. the new
/// centroids of a k-means step, before dividing by the counts). On CUDA one
/// F32 atomic per element, so the rounding of a sum depends on the order its
/// rows land in; on the CPU the rows are added in order. An index ≥ `n_out`
/// is an `Err`.
pub fn scatter_add_rows(src: &Tensor, idx: &Tensor, n_out: usize) -> Result<Tensor> {
    crate::layout::check_rank("src", src, &[2], "rank 2 [R, C]")?;
    if !matches!(src.dtype(), DType::F16 | DType::BF16 | DType::F32) {
        bail!("src: expected F16, BF16 or F32 rows, got {:?}", src.dtype())
    }
    if idx.dtype() != DType::U32 || idx.dims() != [src.dim(0)?] {
        bail!("idx: expected U32 [{}], got {:?} {:?}", src.dim(0)?, idx.dtype(), idx.dims())
    }
    crate::layout::check_device("idx", idx, src.device())?;
    src.contiguous()?.apply_op2_no_bwd(&idx.contiguous()?, &ScatterAddRows { n_out, checked: true })
}

struct GatherRows;
struct AddBias {
    gelu: bool,
}
struct GeluBwd;
/// `out[idx[r]] += src[r]`; a row with `idx[r] ≥ n_out` is an `Err` if
/// `checked`, else skipped.
struct ScatterAddRows {
    n_out: usize,
    checked: bool,
}

impl CustomOp2 for ScatterAddRows {
    fn name(&self) -> &'static str {
        "scatter_add_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, ls: &Layout, i: &CpuStorage, li: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = ls.shape().dims2()?;
        let idx = slice::<u32>("idx", i, li)?;
        let src = f32s("src", s, ls)?;
        let mut out = vec![0f32; self.n_out * c];
        for (r, &d) in idx.iter().enumerate() {
            if d as usize >= self.n_out {
                if self.checked {
                    bail!("idx: idx[{r}] = {d} is out of range for {} output rows", self.n_out)
                }
                continue;
            }
            for (o, &x) in out[d as usize * c..(d as usize + 1) * c].iter_mut().zip(&src[r * c..(r + 1) * c]) {
                *o += x;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((self.n_out, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        ls: &Layout,
        i: &candle_core::CudaStorage,
        li: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = ls.shape().dims2()?.1;
        Ok((crate::cuda::scatter_add_rows((s, ls), (i, li), self.n_out, self.checked)?, Shape::from((self.n_out, c))))
    }
}

fn gather<T: Copy + Default>(src: &[T], idx: &[u32], c: usize) -> Vec<T> {
    let r = src.len() / c.max(1);
    let mut out = Vec::with_capacity(idx.len() * c);
    for &i in idx {
        match src.get(i as usize * c..(i as usize + 1) * c) {
            Some(row) if (i as usize) < r => out.extend_from_slice(row),
            _ => out.extend(std::iter::repeat_n(T::default(), c)),
        }
    }
    out
}

/// An element-wise map of the bias ops in two precisions: F32 for the
/// 16-bit types and F32 (as the kernels compute), F64 for F64.
struct BiasFn<F32, F64> {
    narrow: F32,
    wide: F64,
}

/// `f(z, e)` for every element, `z = x[r, c] + b[c]` summed in F32 (F64
/// for F64) as the kernels do, `e` the same element of `extra` (or 0);
/// the result rounded once to `x`'s dtype. Elements in parallel, each
/// computed alone: the same results whatever the thread count.
fn bias_map(
    x: &CpuStorage,
    lx: &Layout,
    b: &CpuStorage,
    lb: &Layout,
    extra: Option<(&CpuStorage, &Layout)>,
    f: BiasFn<impl Fn(f32, f32) -> f32 + Sync, impl Fn(f64, f64) -> f64 + Sync>,
) -> Result<CpuStorage> {
    fn go<T: Copy + Send + Sync, A: Copy + Send + Sync + Default + std::ops::Add<Output = A>>(
        x: &[T],
        b: &[A],
        e: Option<&[A]>,
        get: impl Fn(T) -> A + Sync,
        put: impl Fn(A) -> T + Sync,
        f: impl Fn(A, A) -> A + Sync,
    ) -> Vec<T> {
        // Row by row, so that the inner loop has no index arithmetic and
        // vectorizes; rows in parallel, in tasks of at least 4096 elements.
        let c = b.len().max(1);
        // Whole rows, each with its bias (bias_op checked the shapes).
        assert!(
            x.len().is_multiple_of(c) && (b.len() == c || x.is_empty()),
            "bias_map: {} elements, bias of {}",
            x.len(),
            b.len()
        );
        let rows = (4096 / c).max(1) * c;
        let row = |o: &mut [MaybeUninit<T>], x: &[T], e: Option<&[A]>| match e {
            Some(e) => o.iter_mut().zip(x).zip(b).zip(e).for_each(|(((o, &v), &b), &e)| {
                o.write(put(f(get(v) + b, e)));
            }),
            None => o.iter_mut().zip(x).zip(b).for_each(|((o, &v), &b)| {
                o.write(put(f(get(v) + b, A::default())));
            }),
        };
        // SAFETY: the tasks cover `out` in rows of c, each written whole (b has c elements).
        unsafe {
            filled(x.len(), |out| {
                out.par_chunks_mut(rows).zip(x.par_chunks(rows)).enumerate().for_each(|(t, (o, x))| {
                    simd(
                        #[inline(always)]
                        || {
                            for (r, (o, x)) in o.chunks_mut(c).zip(x.chunks(c)).enumerate() {
                                row(o, x, e.map(|e| &e[t * rows + r * c..][..c]));
                            }
                        },
                    )
                });
            })
        }
    }
    let (xa, xb) = range("x", lx)?;
    if let CpuStorage::F64(v) = x {
        let b = slice::<f64>("b", b, lb)?;
        let e = extra.map(|(e, le)| slice::<f64>("g", e, le)).transpose()?;
        return Ok(CpuStorage::F64(go(&v[xa..xb], b, e, |v| v, |v| v, f.wide)));
    }
    let b = slice::<f32>("b", b, lb)?;
    let e = extra.map(|(e, le)| f32s("g", e, le)).transpose()?;
    let e = e.as_deref();
    Ok(match x {
        CpuStorage::F16(v) => CpuStorage::F16(go(&v[xa..xb], b, e, |v| v.to_f32(), half::f16::from_f32, f.narrow)),
        CpuStorage::BF16(v) => CpuStorage::BF16(go(&v[xa..xb], b, e, |v| v.to_f32(), half::bf16::from_f32, f.narrow)),
        CpuStorage::F32(v) => CpuStorage::F32(go(&v[xa..xb], b, e, |v| v, |v| v, f.narrow)),
        x => bail!("x: expected a float dtype, got {:?}", x.dtype()),
    })
}

/// `act(x + b)` on the CPU, as [`add_bias`] / [`add_bias_gelu`] compute it.
pub(crate) fn add_bias_cpu(x: &CpuStorage, lx: &Layout, b: &CpuStorage, lb: &Layout, gelu: bool) -> Result<CpuStorage> {
    if gelu {
        bias_map(x, lx, b, lb, None, BiasFn { narrow: |z, _| gelu_f32(z), wide: |z, _| gelu_f64(z).0 })
    } else {
        bias_map(x, lx, b, lb, None, BiasFn { narrow: |z, _| z, wide: |z, _| z })
    }
}

impl CustomOp2 for GatherRows {
    fn name(&self) -> &'static str {
        "gather_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, ls: &Layout, i: &CpuStorage, li: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = ls.shape().dims2()?;
        let (a, b) = range("src", ls)?;
        let idx = slice::<u32>("idx", i, li)?;
        let out = match s {
            CpuStorage::F16(v) => CpuStorage::F16(gather(&v[a..b], idx, c)),
            CpuStorage::BF16(v) => CpuStorage::BF16(gather(&v[a..b], idx, c)),
            CpuStorage::F32(v) => CpuStorage::F32(gather(&v[a..b], idx, c)),
            CpuStorage::F64(v) => CpuStorage::F64(gather(&v[a..b], idx, c)),
            s => bail!("src: expected a float dtype, got {:?}", s.dtype()),
        };
        Ok((out, Shape::from((idx.len(), c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        ls: &Layout,
        i: &candle_core::CudaStorage,
        li: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if i.dtype() != DType::U32 || !s.dtype().is_float() {
            bail!("gather_rows: expected float rows and U32 indices, got {:?} / {:?}", s.dtype(), i.dtype())
        }
        let c = ls.shape().dims2()?.1;
        Ok((crate::cuda::gather_rows((s, ls), (i, li))?, Shape::from((li.shape().elem_count(), c))))
    }

    /// The table's gradient: each output row's gradient added to its source row.
    fn bwd(&self, src: &Tensor, idx: &Tensor, _out: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let op = ScatterAddRows { n_out: src.dim(0)?, checked: false };
        let dsrc = g.contiguous()?.apply_op2_no_bwd(&idx.contiguous()?, &op)?.to_dtype(src.dtype())?;
        Ok((Some(dsrc), None))
    }
}

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        if self.gelu {
            "add_bias_gelu"
        } else {
            "add_bias"
        }
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((add_bias_cpu(x, lx, b, lb, self.gelu)?, lx.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dz = if self.gelu { gelu_bwd(x, b, g)? } else { g.clone() };
        let db = sum_rows(&dz)?.to_dtype(b.dtype())?;
        Ok((Some(dz), Some(db)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::add_bias((x, lx), (b, lb), self.gelu)?, lx.shape().clone()))
    }
}

impl candle_core::CustomOp3 for GeluBwd {
    fn name(&self) -> &'static str {
        "add_bias_gelu_bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        b: &CpuStorage,
        lb: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let f = BiasFn { narrow: |z, g| g * gelu_grad_f32(z), wide: |z, g| g * gelu_f64(z).1 };
        Ok((bias_map(x, lx, b, lb, Some((g, lg)), f)?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::gelu_bwd((x, lx), (b, lb), (g, lg))?, lx.shape().clone()))
    }
}
