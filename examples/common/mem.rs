//! Peak device memory for the examples (CUDA: the stream-ordered pool's
//! used-memory high-water mark; elsewhere: none).
#![allow(dead_code)]

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::cuda_backend::cudarc::driver::sys;
    fn pool() -> sys::CUmemoryPool {
        let mut dev = 0;
        let mut pool = std::ptr::null_mut();
        unsafe {
            sys::cuCtxGetDevice(&mut dev);
            sys::cuDeviceGetDefaultMemPool(&mut pool, dev);
        }
        pool
    }
    fn attr(a: sys::CUmemPool_attribute) -> u64 {
        let mut v: u64 = 0;
        unsafe { sys::cuMemPoolGetAttribute(pool(), a, &mut v as *mut u64 as *mut _) };
        v
    }
    pub fn reset() -> u64 {
        let mut zero: u64 = 0;
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool(),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut zero as *mut u64 as *mut _,
            )
        };
        attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }
    pub fn peak_since(base: u64) -> Option<u64> {
        Some(attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH).saturating_sub(base))
    }
}
#[cfg(not(feature = "cuda"))]
mod imp {
    pub fn reset() -> u64 {
        0
    }
    pub fn peak_since(_: u64) -> Option<u64> {
        None
    }
}

pub use imp::{peak_since, reset};
