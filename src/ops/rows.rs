//! Row helpers as custom ops without a gradient: a row gather with zero
//! rows and a bias added to every row (the projection head's backward,
//! whose operands are detached), and a scatter-add of rows (k-means).
//! kernels/rows.cu on CUDA, the same loops on the CPU.

use candle_core::{backend::BackendStorage, bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// `[N, C]` rows of `src` `[R, C]` picked by `idx` `[N]` U32, zero rows
/// where `idx ≥ R` (each output row written once).
pub(crate) fn gather_rows(src: &Tensor, idx: &Tensor) -> Result<Tensor> {
    src.contiguous()?.apply_op2_no_bwd(&idx.contiguous()?, &GatherRows)
}

/// The rows of an embedding table `[R, C]` (F16, BF16 or F32) picked by
/// `ids` (U32, any shape), as `[ids…, C]`: a row gather whose backward is a
/// row scatter-add (candle's `index_select` backward is an `index_add`
/// that loops over every id in each of C threads, milliseconds for a
/// training batch's 40 000 tokens). Out-of-range ids give zero rows forward
/// and an `Err` backward.
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
    table.contiguous()?.apply_op2(&ids.flatten_all()?.contiguous()?, GatherRows)?.reshape(shape)
}

/// `x + b` for `x` `[R, C]` (a float dtype), `b` `[C]`: added in F32 (F64
/// for F64) and rounded once, in `x`'s dtype. Differentiable: `b`'s gradient
/// is the column sums of the output's, one kernel (candle's broadcast add
/// indexes every element through the broadcast strides, and its backward
/// sums over the leading axis one strided element per thread).
pub fn add_bias(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    crate::layout::check_rank("x", x, &[2], "rank 2 [R, C]")?;
    crate::layout::check_float("x", x)?;
    if b.dims() != [x.dim(1)?] || !b.dtype().is_float() {
        bail!("b: expected a float [{}], got {:?} {:?}", x.dim(1)?, b.dtype(), b.dims())
    }
    crate::layout::check_device("b", b, x.device())?;
    let acc = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    x.contiguous()?.apply_op2(&b.to_dtype(acc)?.contiguous()?, AddBias)
}

/// The column sums `[C]` F32 of `g` `[R, C]` (F16, BF16 or F32; F64 for F64).
fn sum_rows(g: &Tensor) -> Result<Tensor> {
    g.contiguous()?.apply_op1_no_bwd(&SumRows)
}

struct SumRows;

impl candle_core::CustomOp1 for SumRows {
    fn name(&self) -> &'static str {
        "sum_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = l.shape().dims2()?;
        let (a, b) = range(l)?;
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
    src.contiguous()?.apply_op2_no_bwd(&idx.contiguous()?, &ScatterAddRows { n_out })
}

struct GatherRows;
struct AddBias;
struct ScatterAddRows {
    n_out: usize,
}

impl CustomOp2 for ScatterAddRows {
    fn name(&self) -> &'static str {
        "scatter_add_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, ls: &Layout, i: &CpuStorage, li: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = ls.shape().dims2()?;
        let (a, b) = range(ls)?;
        let (ia, ib) = range(li)?;
        let CpuStorage::U32(idx) = i else { bail!("idx: expected U32 row indices") };
        let src: Vec<f32> = match s {
            CpuStorage::F16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
            CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
            CpuStorage::F32(v) => v[a..b].to_vec(),
            s => bail!("src: expected F16, BF16 or F32 rows, got {:?}", s.dtype()),
        };
        let mut out = vec![0f32; self.n_out * c];
        for (r, &d) in idx[ia..ib].iter().enumerate() {
            if d as usize >= self.n_out {
                bail!("idx: idx[{r}] = {d} is out of range for {} output rows", self.n_out)
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
        Ok((crate::cuda::scatter_add_rows((s, ls), (i, li), self.n_out)?, Shape::from((self.n_out, c))))
    }
}

/// The contiguous element range of an operand.
fn range(l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("rows: internal error, operand is not contiguous"),
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

fn bias_rows<T: Copy, A: Copy + std::ops::Add<Output = A>>(
    x: &[T],
    b: &[A],
    get: impl Fn(T) -> A,
    put: impl Fn(A) -> T,
) -> Vec<T> {
    x.chunks(b.len().max(1)).flat_map(|row| row.iter().zip(b).map(|(&v, &bv)| put(get(v) + bv))).collect()
}

impl CustomOp2 for GatherRows {
    fn name(&self) -> &'static str {
        "gather_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, ls: &Layout, i: &CpuStorage, li: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = ls.shape().dims2()?;
        let ((a, b), (ia, ib)) = (range(ls)?, range(li)?);
        let CpuStorage::U32(idx) = i else { bail!("idx: expected U32 row indices, got {:?}", i.dtype()) };
        let idx = &idx[ia..ib];
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
        let dsrc = scatter_add_rows(&g.contiguous()?, idx, src.dim(0)?)?.to_dtype(src.dtype())?;
        Ok((Some(dsrc), None))
    }
}

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        "add_bias"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let ((xa, xb), (ba, bb)) = (range(lx)?, range(lb)?);
        let out = match (x, b) {
            (CpuStorage::F16(x), CpuStorage::F32(b)) => {
                CpuStorage::F16(bias_rows(&x[xa..xb], &b[ba..bb], |v| v.to_f32(), half::f16::from_f32))
            }
            (CpuStorage::BF16(x), CpuStorage::F32(b)) => {
                CpuStorage::BF16(bias_rows(&x[xa..xb], &b[ba..bb], |v| v.to_f32(), half::bf16::from_f32))
            }
            (CpuStorage::F32(x), CpuStorage::F32(b)) => {
                CpuStorage::F32(bias_rows(&x[xa..xb], &b[ba..bb], |v| v, |v| v))
            }
            (CpuStorage::F64(x), CpuStorage::F64(b)) => {
                CpuStorage::F64(bias_rows(&x[xa..xb], &b[ba..bb], |v| v, |v| v))
            }
            (x, b) => bail!("add_bias: internal error, dtypes {:?} / {:?}", x.dtype(), b.dtype()),
        };
        Ok((out, lx.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(g.clone()), Some(sum_rows(g)?.to_dtype(b.dtype())?)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::cuda::add_bias((x, lx), (b, lb))?, lx.shape().clone()))
    }
}
