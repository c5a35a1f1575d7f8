//! What the kernels need to know about a device, read once per device.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

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
