//! The one way this crate launches a kernel: [`Module`] names the
//! kernels/*.cu file, [`kernel`] loads one of its functions for the device
//! (SASS where the device runs it, PTX otherwise), [`grid_stride`] or a
//! [`LaunchConfig`] sizes the launch, and [`launch`] queues it with its one
//! by-value parameter struct, a `#[repr(C)]` mirror of the kernel's C struct
//! declared with [`kernel_params!`](crate::cuda::launch::kernel_params).

use super::device::{device_info, DeviceInfo};
use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction, CudaModule, LaunchArgs, LaunchConfig};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

#[allow(dead_code)]
mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// The builds of one kernel file, oldest target first: PTX for each
/// target, and the SASS (cubin) of the sm_80 and sm_90a PTX.
struct Builds {
    sm75: &'static str,
    sm80: &'static str,
    /// Hopper-only (wgmma): runs on compute capability 9.0 exactly.
    sm90a: &'static str,
    sm80_cubin: &'static [u8],
    sm90a_cubin: &'static [u8],
}

macro_rules! modules {
    ($($variant:ident $tag:literal: $sm75:ident, $sm80:ident, $sm90a:ident, $sm80c:ident, $sm90ac:ident;)*) => {
        /// A kernels/*.cu file, compiled into one module per target.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub(crate) enum Module {
            $($variant,)*
        }

        impl Module {
            fn builds(self) -> Builds {
                match self {
                    $(Module::$variant => Builds {
                        sm75: ptx::$sm75,
                        sm80: ptx::$sm80,
                        sm90a: ptx::$sm90a,
                        sm80_cubin: ptx::$sm80c,
                        sm90a_cubin: ptx::$sm90ac,
                    },)*
                }
            }

            /// The kernel file's stem, naming its modules in candle's cache.
            fn tag(self) -> &'static str {
                match self {
                    $(Module::$variant => $tag,)*
                }
            }
        }
    };
}

modules! {
    MaxsimFwd "maxsim_fwd": MAXSIM_FWD_SM75, MAXSIM_FWD_SM80, MAXSIM_FWD_SM90A, MAXSIM_FWD_SM80_CUBIN, MAXSIM_FWD_SM90A_CUBIN;
    MaxsimBwd "maxsim_bwd": MAXSIM_BWD_SM75, MAXSIM_BWD_SM80, MAXSIM_BWD_SM90A, MAXSIM_BWD_SM80_CUBIN, MAXSIM_BWD_SM90A_CUBIN;
    Hidden "hidden": HIDDEN_SM75, HIDDEN_SM80, HIDDEN_SM90A, HIDDEN_SM80_CUBIN, HIDDEN_SM90A_CUBIN;
    Rows "rows": ROWS_SM75, ROWS_SM80, ROWS_SM90A, ROWS_SM80_CUBIN, ROWS_SM90A_CUBIN;
    Residual "residual": RESIDUAL_SM75, RESIDUAL_SM80, RESIDUAL_SM90A, RESIDUAL_SM80_CUBIN, RESIDUAL_SM90A_CUBIN;
    PlaidApprox "plaid_approx": PLAID_APPROX_SM75, PLAID_APPROX_SM80, PLAID_APPROX_SM90A, PLAID_APPROX_SM80_CUBIN, PLAID_APPROX_SM90A_CUBIN;
    Normalize "normalize": NORMALIZE_SM75, NORMALIZE_SM80, NORMALIZE_SM90A, NORMALIZE_SM80_CUBIN, NORMALIZE_SM90A_CUBIN;
    Encoder "encoder": ENCODER_SM75, ENCODER_SM80, ENCODER_SM90A, ENCODER_SM80_CUBIN, ENCODER_SM90A_CUBIN;
    Optim "optim": OPTIM_SM75, OPTIM_SM80, OPTIM_SM90A, OPTIM_SM80_CUBIN, OPTIM_SM90A_CUBIN;
    FlashAttn "flash_attn": FLASH_ATTN_SM75, FLASH_ATTN_SM80, FLASH_ATTN_SM90A, FLASH_ATTN_SM80_CUBIN, FLASH_ATTN_SM90A_CUBIN;
    Topk "topk": TOPK_SM75, TOPK_SM80, TOPK_SM90A, TOPK_SM80_CUBIN, TOPK_SM90A_CUBIN;
}

/// The newest build of a kernel file that this device runs: its PTX, its
/// SASS where the device runs that (sm_80 SASS on 8.x, sm_90a on 9.0, not
/// while an older GPU is emulated), and its tag.
fn build_for(info: &DeviceInfo, m: &Builds) -> (&'static str, Option<&'static [u8]>, &'static str) {
    let sass = |bin| (!info.emulated).then_some(bin);
    match info.cc {
        90 => (m.sm90a, sass(m.sm90a_cubin), "sm90a"),
        cc if cc >= 80 => (m.sm80, if cc < 90 { sass(m.sm80_cubin) } else { None }, "sm80"),
        _ => (m.sm75, None, "sm75"),
    }
}

/// Loads kernel `name` of `module` for this device, and raises its dynamic
/// shared-memory limit when a launch needs `smem` bytes past the default
/// 48 KB. Each function is looked up and its limit raised once per device:
/// later calls cost a map lookup instead of two or three driver calls (the
/// function, its static shared memory, the attribute), which a launch of a
/// few microseconds of work pays for in host time.
pub(crate) fn kernel(dev: &CudaDevice, module: Module, name: &str, smem: u32) -> Result<CudaFunction> {
    struct Loaded {
        func: CudaFunction,
        /// The dynamic shared memory a launch may ask for now.
        allowed: usize,
    }
    type Cache = HashMap<(candle_core::cuda_backend::DeviceId, Module, String), Loaded>;
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    let key = (dev.id(), module, name.to_string());
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let loaded = match cache.entry(key) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let info = device_info(dev)?;
            let kind = module.tag();
            let func = match build_for(&info, &module.builds()) {
                (_, Some(cubin), tag) => sass_module(dev, kind, tag, cubin)?.load_function(name).w()?,
                (ptx, None, tag) => {
                    dev.get_or_load_custom_func(name, &format!("candle_maxsim_{kind}_{tag}"), ptx)?.into_cuda_function()
                }
            };
            let fixed = func.shared_size_bytes().w()? as usize;
            e.insert(Loaded { func, allowed: (48 * 1024usize).saturating_sub(fixed) })
        }
    };
    // Static shared memory counts toward the 48 KB a block gets without opting in.
    if smem as usize > loaded.allowed {
        let func = &loaded.func;
        func.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .w()?;
        loaded.allowed = smem as usize;
    }
    Ok(loaded.func.clone())
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

/// One-dimensional blocks of `threads` threads, `blocks` of them, with
/// `smem` bytes of dynamic shared memory.
pub(crate) fn blocks(blocks: u32, threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem }
}

/// A grid-stride launch over `units` units of work (rows, warps' tasks or
/// elements), `per_block` units per block of `threads` threads: one pass
/// where the grid allows, at most `per_sm` blocks per SM (the kernel strides
/// over the rest), never an empty grid.
pub(crate) fn grid_stride(
    dev: &CudaDevice,
    units: usize,
    per_block: usize,
    threads: u32,
    per_sm: usize,
) -> Result<LaunchConfig> {
    let cap = per_sm * device_info(dev)?.sm_count.max(1) as usize;
    Ok(blocks(units.div_ceil(per_block.max(1)).clamp(1, cap.max(1)) as u32, threads, 0))
}

/// A kernel's by-value arguments: one `#[repr(C)]` parameter struct (see
/// [`kernel_params!`]), or the warp-specialized forward's pair of the
/// parameter struct and the documents' tensor map.
pub(crate) trait KernelArgs {
    /// Pushes the arguments in the kernel's parameter order.
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>);
}

/// Declares `#[repr(C)]` structs as mirrors of kernel parameter structs:
/// each is plain data laid out as its C counterpart (field for field, in
/// order), the kernel's one parameter.
macro_rules! kernel_params {
    ($($t:ty),* $(,)?) => {
        $(
            // SAFETY: plain old data with the layout of the kernel's C struct.
            unsafe impl candle_core::cuda_backend::cudarc::driver::DeviceRepr for $t {}
            impl $crate::cuda::launch::KernelArgs for $t {
                fn push<'a>(&'a self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
                    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
                    b.arg(self);
                }
            }
        )*
    };
}
pub(crate) use kernel_params;

/// Queues `func` on the device's stream with `args`. An empty grid queues
/// nothing.
pub(crate) fn launch(dev: &CudaDevice, func: &CudaFunction, cfg: LaunchConfig, args: &impl KernelArgs) -> Result<()> {
    if cfg.grid_dim.0 == 0 {
        return Ok(());
    }
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(func);
    args.push(&mut b);
    // SAFETY: every `KernelArgs` is a mirror of its kernel's parameter list
    // (kernel_params!, or the (parameter struct, tensor map) pair of the
    // warp-specialized kernels), and its callers keep the buffers it points
    // to alive until the launch is queued (stream-ordered frees after it).
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
