//! Device memory as the launches need it: outputs, raw addresses of
//! operands, aligned copies, fills, and the host-mapped error flags kernels
//! set.

use super::launch::{grid_stride, kernel, kernel_params, launch, Module};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{sys, CudaSlice, DevicePtr, PinnedHostSlice};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};
use std::cell::RefCell;
use std::sync::Mutex;

/// An uninitialized buffer of `n` elements of `dtype` (the kernels write every element).
pub(crate) fn alloc_out(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    let n = n.max(1);
    // SAFETY: the kernels write every element before anyone reads it.
    Ok(unsafe {
        match dtype {
            DType::F16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::f16>(n)?, dev.clone()),
            DType::BF16 => CudaStorage::wrap_cuda_slice(dev.alloc::<half::bf16>(n)?, dev.clone()),
            DType::F32 => CudaStorage::wrap_cuda_slice(dev.alloc::<f32>(n)?, dev.clone()),
            DType::F64 => CudaStorage::wrap_cuda_slice(dev.alloc::<f64>(n)?, dev.clone()),
            dt => bail!("maxsim: unsupported dtype {dt:?} for a float output"),
        }
    })
}

/// Raw device address of a contiguous CUDA tensor (its layout offset applied)
/// and the dtype it holds. The tensor must outlive the launch that uses it.
pub(crate) fn tensor_ptr(t: &Tensor) -> Result<u64> {
    let (st, layout) = t.storage_and_layout();
    match &*st {
        Storage::Cuda(cs) => storage_ptr(cs, layout),
        _ => bail!("maxsim: internal error, expected a CUDA tensor"),
    }
}

pub(crate) fn storage_ptr(cs: &CudaStorage, layout: &Layout) -> Result<u64> {
    if !layout.is_contiguous() {
        bail!("maxsim: internal error, CUDA operand is not contiguous")
    }
    let stream = cs.device.cuda_stream();
    macro_rules! ptr {
        ($t:ty) => {{
            let s = cs.as_cuda_slice::<$t>()?;
            let (p, _sync) = s.device_ptr(&stream);
            p + (layout.start_offset() * std::mem::size_of::<$t>()) as u64
        }};
    }
    Ok(match cs.dtype() {
        DType::U8 => ptr!(u8),
        DType::U32 => ptr!(u32),
        DType::I64 => ptr!(i64),
        DType::I32 => ptr!(i32),
        DType::I16 => ptr!(i16),
        DType::F16 => ptr!(half::f16),
        DType::BF16 => ptr!(half::bf16),
        DType::F32 => ptr!(f32),
        DType::F64 => ptr!(f64),
        dt => bail!("maxsim: unsupported dtype {dt:?} on CUDA"),
    })
}

/// The device address of a contiguous operand, `align`-byte aligned: its
/// own, or that of an aligned copy (a narrowed view can start anywhere),
/// which the caller keeps alive until the launch is queued.
pub(crate) fn aligned_ptr(op: (&CudaStorage, &Layout), align: u64) -> Result<(u64, Option<CudaStorage>)> {
    let (s, l) = op;
    if l.is_contiguous() {
        let p = storage_ptr(s, l)?;
        if p.is_multiple_of(align) {
            return Ok((p, None));
        }
    }
    use candle_core::backend::BackendDevice;
    let mut copy = s.device.zeros_impl(l.shape(), s.dtype())?;
    s.copy_strided_src(&mut copy, 0, l)?;
    let p = storage_ptr(&copy, &Layout::contiguous(l.shape()))?;
    Ok((p, Some(copy)))
}

pub(crate) fn slice_ptr<T>(dev: &CudaDevice, s: &CudaSlice<T>) -> u64 {
    let stream = dev.cuda_stream();
    let (p, _sync) = s.device_ptr(&stream);
    p
}

/// A copy of a CUDA I32 tensor of non-negative values as U32 (the same
/// bits; candle has no I32 casts on CUDA).
pub(crate) fn i32_bits_as_u32(t: &Tensor) -> Result<Tensor> {
    let t = t.contiguous()?;
    let n = t.elem_count();
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else { bail!("maxsim: internal error, expected a CUDA tensor") };
    let dev = cs.device.clone();
    let src = cs.as_cuda_slice::<i32>()?.slice(l.start_offset()..l.start_offset() + n);
    // SAFETY: i32 and u32 have the same size and every bit pattern is a valid u32.
    let src = unsafe { src.transmute::<u32>(n) }
        .ok_or_else(|| candle_core::Error::Msg("maxsim: internal error, transmute".into()))?;
    // SAFETY: fully written by the copy below.
    let mut dst = unsafe { dev.alloc::<u32>(n.max(1)) }?;
    dev.cuda_stream().memcpy_dtod(&src, &mut dst).w()?;
    drop(st);
    Ok(Tensor::from((Storage::Cuda(CudaStorage::wrap_cuda_slice(dst, dev)), n)))
}

/// Mirror of `FillParams` in kernels/maxsim_fwd.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FillParams {
    x: u64,
    n: i64,
    v: i32,
}
kernel_params!(FillParams);

/// Fills `n` 32-bit words at device address `ptr` with `value` on the device's stream.
pub(crate) fn fill_words(dev: &CudaDevice, ptr: u64, n: usize, value: i32) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = kernel(dev, Module::MaxsimFwd, "maxsim_fill_i32", 0)?;
    launch(dev, &func, grid_stride(dev, n, 256, 256, 32)?, &FillParams { x: ptr, n: n as i64, v: value })
}

/// A 4-byte error flag in page-locked host memory that kernels set through its
/// device mapping. Reading it after the stream sync needs no memset before the
/// launch and no copy after it, which would each add a few µs to every call.
/// Flags are pooled per context; a call holds one until it drops it, so
/// concurrent calls never share one.
pub(crate) struct HostFlag {
    slice: Option<PinnedHostSlice<u32>>,
    host: *mut u32,
    dev_ptr: u64,
}

static HOST_FLAGS: Mutex<Vec<PinnedHostSlice<u32>>> = Mutex::new(Vec::new());

impl HostFlag {
    /// A cleared flag for `dev`'s context.
    pub(crate) fn new(dev: &CudaDevice) -> Result<Self> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        let pooled = {
            let mut pool = HOST_FLAGS.lock().unwrap_or_else(|e| e.into_inner());
            pool.iter().position(|s| std::sync::Arc::ptr_eq(s.context(), ctx)).map(|i| pool.swap_remove(i))
        };
        let mut slice = match pooled {
            Some(s) => s,
            // SAFETY: u32 has no invalid bit patterns; the flag is written below before any use.
            None => unsafe {
                ctx.alloc_pinned_with_flags::<u32>(1, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE)
            }
            .w()?,
        };
        let host = slice.as_mut_ptr().w()?;
        let mut dev_ptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` is a live page-locked allocation made with DEVICEMAP in this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_ptr, host.cast(), 0) }.result().w()?;
        // SAFETY: no kernel uses this flag now (it was in the pool or is new).
        unsafe { host.write_volatile(0) };
        Ok(Self { slice: Some(slice), host, dev_ptr })
    }

    /// The address kernels write through.
    pub(crate) fn dev_ptr(&self) -> u64 {
        self.dev_ptr
    }

    /// Waits for `dev`'s stream, then says whether a kernel set the flag.
    pub(crate) fn is_set(&self, dev: &CudaDevice) -> Result<bool> {
        Ok(self.value(dev)? != 0)
    }

    /// Waits for `dev`'s stream, then reads the flag (0: not set).
    pub(crate) fn value(&self, dev: &CudaDevice) -> Result<u32> {
        dev.cuda_stream().synchronize().w()?;
        // SAFETY: the kernels that write it have finished (stream synchronized).
        Ok(unsafe { self.host.read_volatile() })
    }
}

/// A set flag's error message, from the flag's value.
type Describe = Box<dyn FnOnce(u32) -> String>;

thread_local! {
    /// The flags of this thread's [`deferred_checks`] scope, in launch order.
    static DEFERRED: RefCell<Option<Vec<(HostFlag, CudaDevice, Describe)>>> = const { RefCell::new(None) };
}

impl HostFlag {
    /// `Err(describe(value))` if a kernel set the flag (after waiting for
    /// the stream); inside a [`deferred_checks`] scope on this thread the
    /// flag is kept for the scope's end instead, and this returns `Ok`.
    pub(crate) fn check(self, dev: &CudaDevice, describe: impl FnOnce(u32) -> String + 'static) -> Result<()> {
        let flag = DEFERRED.with_borrow_mut(|d| match d {
            Some(list) => {
                list.push((self, dev.clone(), Box::new(describe)));
                None
            }
            None => Some((self, describe)),
        });
        match flag {
            Some((flag, describe)) => match flag.value(dev)? {
                0 => Ok(()),
                v => bail!("{}", describe(v)),
            },
            None => Ok(()),
        }
    }
}

/// `f()` with the input checks that kernels report through host flags
/// waiting until `f` returns: one stream sync at the end instead of one per
/// op. The first flag set, in launch order, is the error (`f`'s own error
/// first). The kernels clamp or skip what they flag, so no access goes out
/// of bounds meanwhile; `f`'s results are dropped when a check fails.
pub(crate) fn deferred_checks<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    let outer = DEFERRED.with_borrow_mut(|d| d.replace(Vec::new()));
    let res = f();
    let flags = DEFERRED.with_borrow_mut(|d| std::mem::replace(d, outer)).unwrap_or_default();
    let res = res?;
    let mut synced: Vec<CudaDevice> = Vec::new();
    for (flag, dev, describe) in flags {
        if !synced.iter().any(|d| d.same_device(&dev)) {
            dev.cuda_stream().synchronize().w()?;
            synced.push(dev.clone());
        }
        // SAFETY: the stream that runs the flag's kernel is synchronized.
        match unsafe { flag.host.read_volatile() } {
            0 => {}
            v => bail!("{}", describe(v)),
        }
    }
    Ok(res)
}

impl Drop for HostFlag {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            HOST_FLAGS.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
    }
}
