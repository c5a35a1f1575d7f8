//! CUDA path: modules built from kernels/ by build.rs (PTX, and SASS for
//! sm_80 / sm_90a), picked per device at run time, and the launch code of
//! each op.

pub(crate) mod encoder;
mod hidden;
mod maxsim_bwd;
mod maxsim_fwd;
mod normalize;
pub(crate) mod optim;
mod params;
pub(crate) mod plaid_approx;
mod residual;
mod rows;
mod topk;

pub(crate) use hidden::{from_hidden_fwd, FusedHeadPlan};
pub(crate) use maxsim_bwd::maxsim_bwd;
pub(crate) use maxsim_fwd::{maxsim_argmax, maxsim_fwd, Variant};
pub(crate) use maxsim_fwd::{maxsim_fwd_quantized, quantized_supported, residual_supported};
pub(crate) use normalize::{l2norm_bwd, l2norm_fwd};
pub(crate) use residual::{
    codes_u32, compress_residual, decompress as decompress_residual, residual_path, residual_scores_tile,
    residual_scores_warp, warp_applies, CodecDev, ResidualPath, WarpDocs, WarpTasks,
};
pub(crate) use rows::{add_bias, gather_rows, gelu_bwd, scatter_add_rows, sum_rows};
pub(crate) use topk::topk_rows;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

#[allow(dead_code)]
mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// What the kernels need to know about a device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceInfo {
    /// Compute capability as major * 10 + minor.
    pub cc: i32,
    pub sm_count: i32,
    /// Largest dynamic shared memory a block may opt in to, in bytes.
    pub smem_optin: usize,
    /// An older GPU is emulated (`cc` is below the device's): PTX only.
    pub emulated: bool,
}

pub(crate) fn device_info(dev: &CudaDevice) -> Result<DeviceInfo> {
    static CACHE: OnceLock<Mutex<HashMap<usize, DeviceInfo>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let key = ctx.ordinal();
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap();
    if let Some(i) = cache.get(&key) {
        return Ok(*i);
    }
    use sys::CUdevice_attribute::*;
    let major = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).w()?;
    let minor = ctx.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).w()?;
    let sm_count = ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()?;
    let smem_optin = ctx.attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).w()? as usize;
    let info = emulated_arch(DeviceInfo { cc: major * 10 + minor, sm_count, smem_optin, emulated: false });
    keep_pool_memory(key)?;
    cache.insert(key, info);
    Ok(info)
}

/// Raises the release threshold of the device's default memory pool (the
/// one cudarc's stream-ordered allocations come from) so that freed memory
/// stays in the pool. At the default threshold of 0, every stream
/// synchronization (the error flags are read after one) hands the freed
/// memory back to the driver, and the next large allocation maps it again:
/// decompressing 2.25 M tokens took 2.4 ms instead of 0.68 ms on an H200,
/// most of it re-mapping the 576 MB output. A framework's caching allocator
/// keeps memory the same way.
fn keep_pool_memory(ordinal: usize) -> Result<()> {
    let mut dev: sys::CUdevice = 0;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: plain driver calls on a device index the context was made for.
    unsafe {
        sys::cuDeviceGet(&mut dev, ordinal as i32).result().w()?;
        if sys::cuDeviceGetDefaultMemPool(&mut pool, dev).result().is_ok() {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .w()?;
        }
    }
    Ok(())
}

/// The emulated older GPU of [`crate::knobs::Knobs::arch`]: its PTX module
/// (JIT-compiled for this device), its kernel choice, and its shared-memory
/// limit per block (64 KB on Turing, 163 KB on A100).
fn emulated_arch(real: DeviceInfo) -> DeviceInfo {
    let (cc, smem) = match crate::knobs::knobs().arch {
        Some(75) => (75, 64 * 1024),
        Some(80) => (80, 163 * 1024),
        _ => return real,
    };
    DeviceInfo { cc: real.cc.min(cc), smem_optin: real.smem_optin.min(smem), emulated: cc < real.cc, ..real }
}

/// The builds of one kernel file, oldest target first: PTX for each
/// target, and the SASS (cubin) of the sm_80 and sm_90a PTX.
struct Modules {
    sm75: &'static str,
    sm80: &'static str,
    /// Hopper-only (wgmma): runs on compute capability 9.0 exactly.
    sm90a: &'static str,
    sm80_cubin: &'static [u8],
    sm90a_cubin: &'static [u8],
}

/// The newest module of a kernel file that this device runs: its PTX, its
/// SASS where the device runs that (sm_80 SASS on 8.x, sm_90a on 9.0, not
/// while an older GPU is emulated), and its tag.
fn module_for(info: &DeviceInfo, m: &Modules) -> (&'static str, Option<&'static [u8]>, &'static str) {
    let sass = |bin| (!info.emulated).then_some(bin);
    match info.cc {
        90 => (m.sm90a, sass(m.sm90a_cubin), "sm90a"),
        cc if cc >= 80 => (m.sm80, if cc < 90 { sass(m.sm80_cubin) } else { None }, "sm80"),
        _ => (m.sm75, None, "sm75"),
    }
}

macro_rules! modules {
    ($($name:ident: $sm75:ident, $sm80:ident, $sm90a:ident, $sm80c:ident, $sm90ac:ident;)*) => {
        $(const $name: Modules = Modules {
            sm75: ptx::$sm75,
            sm80: ptx::$sm80,
            sm90a: ptx::$sm90a,
            sm80_cubin: ptx::$sm80c,
            sm90a_cubin: ptx::$sm90ac,
        };)*
    };
}

modules! {
    FWD: MAXSIM_FWD_SM75, MAXSIM_FWD_SM80, MAXSIM_FWD_SM90A, MAXSIM_FWD_SM80_CUBIN, MAXSIM_FWD_SM90A_CUBIN;
    BWD: MAXSIM_BWD_SM75, MAXSIM_BWD_SM80, MAXSIM_BWD_SM90A, MAXSIM_BWD_SM80_CUBIN, MAXSIM_BWD_SM90A_CUBIN;
    HIDDEN: HIDDEN_SM75, HIDDEN_SM80, HIDDEN_SM90A, HIDDEN_SM80_CUBIN, HIDDEN_SM90A_CUBIN;
    ROWS: ROWS_SM75, ROWS_SM80, ROWS_SM90A, ROWS_SM80_CUBIN, ROWS_SM90A_CUBIN;
    RESIDUAL: RESIDUAL_SM75, RESIDUAL_SM80, RESIDUAL_SM90A, RESIDUAL_SM80_CUBIN, RESIDUAL_SM90A_CUBIN;
    PLAID_APPROX: PLAID_APPROX_SM75, PLAID_APPROX_SM80, PLAID_APPROX_SM90A, PLAID_APPROX_SM80_CUBIN, PLAID_APPROX_SM90A_CUBIN;
    NORMALIZE: NORMALIZE_SM75, NORMALIZE_SM80, NORMALIZE_SM90A, NORMALIZE_SM80_CUBIN, NORMALIZE_SM90A_CUBIN;
    ENCODER: ENCODER_SM75, ENCODER_SM80, ENCODER_SM90A, ENCODER_SM80_CUBIN, ENCODER_SM90A_CUBIN;
    OPTIM: OPTIM_SM75, OPTIM_SM80, OPTIM_SM90A, OPTIM_SM80_CUBIN, OPTIM_SM90A_CUBIN;
    TOPK: TOPK_SM75, TOPK_SM80, TOPK_SM90A, TOPK_SM80_CUBIN, TOPK_SM90A_CUBIN;
}

/// Loads `name` from the forward module for this device; raises the dynamic
/// shared-memory limit when a launch needs more than the default 48 KB.
pub(crate) fn fwd_func(dev: &CudaDevice, name: &str, smem: u32) -> Result<CudaFunction> {
    load_func(dev, name, smem, "fwd", &FWD)
}

/// Loads `name` from the backward module for this device.
pub(crate) fn bwd_func(dev: &CudaDevice, name: &str, smem: u32) -> Result<CudaFunction> {
    load_func(dev, name, smem, "bwd", &BWD)
}

/// Loads `name` from the kernels/plaid_approx.cu module for this device.
pub(crate) fn plaid_approx_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    load_func(dev, name, 0, "plaid_approx", &PLAID_APPROX)
}

fn load_func(dev: &CudaDevice, name: &str, smem: u32, kind: &str, modules: &Modules) -> Result<CudaFunction> {
    let info = device_info(dev)?;
    let func = match module_for(&info, modules) {
        (_, Some(cubin), tag) => sass_module(dev, kind, tag, cubin)?.load_function(name).w()?,
        (ptx, None, tag) => {
            dev.get_or_load_custom_func(name, &format!("candle_maxsim_{kind}_{tag}"), ptx)?.into_cuda_function()
        }
    };
    // Static shared memory counts toward the 48 KB a block gets without opting in.
    if smem > 0 && smem as usize + func.shared_size_bytes().w()? as usize > 48 * 1024 {
        func.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .w()?;
    }
    Ok(func)
}

/// The module of a cubin, loaded once per device (candle's module cache
/// takes PTX text only).
fn sass_module(dev: &CudaDevice, kind: &str, tag: &str, cubin: &'static [u8]) -> Result<Arc<CudaModule>> {
    type Cache = HashMap<(candle_core::cuda_backend::DeviceId, String), Arc<CudaModule>>;
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    let key = (dev.id(), format!("{kind}_{tag}"));
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap();
    if let Some(m) = cache.get(&key) {
        return Ok(m.clone());
    }
    let m = dev.cuda_stream().context().load_module(Ptx::from_binary(cubin.to_vec())).w()?;
    cache.insert(key, m.clone());
    Ok(m)
}

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

/// Launches `func` with one by-value parameter struct.
pub(crate) fn launch<P: DeviceRepr>(
    dev: &CudaDevice,
    func: &CudaFunction,
    grid: u32,
    block: u32,
    smem: u32,
    params: &P,
) -> Result<()> {
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: smem };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(func);
    b.arg(params);
    // SAFETY: the parameter struct matches the kernel's signature (kernels/common.cuh).
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Fills `n` 32-bit words at device address `ptr` with `value` on the device's stream.
pub(crate) fn fill_words(dev: &CudaDevice, ptr: u64, n: usize, value: i32) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = fwd_func(dev, "maxsim_fill_i32", 0)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).min(4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    let n = n as i64;
    b.arg(&ptr);
    b.arg(&n);
    b.arg(&value);
    // SAFETY: (int32_t*, long long, int32_t) as declared in maxsim_fwd.cu.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
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

impl Drop for HostFlag {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            HOST_FLAGS.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
    }
}
