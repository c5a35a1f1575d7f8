//! Launches of kernels/flash_attn.cu: the varlen attention forward (output
//! and log-sum-exp) and its backward (delta, then dQ and dK dV).

use super::device::device_info;
use super::launch::{grid_stride, kernel, kernel_params, launch, Module};
use super::memory::{alloc_out, storage_ptr};
use super::params::dtype_tag;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

/// Mirror of `FlashParams` in kernels/flash_attn.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct FlashParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    dout: u64,
    out: u64,
    dk: u64,
    dv: u64,
    lse: u64,
    delta: u64,
    cu: u64,
    q_row: i64,
    k_row: i64,
    v_row: i64,
    batch: i32,
    heads: i32,
    total: i32,
    window: i32,
    scale_log2: f32,
    scale: f32,
}
kernel_params!(FlashParams);

/// The problem of one launch: `batch` sequences of at most `max_len` rows,
/// `total` rows in all, `heads` heads of `dh` columns.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FlashGeom {
    pub batch: usize,
    pub heads: usize,
    pub dh: usize,
    pub total: usize,
    pub max_len: usize,
    /// `|i - j| <= window` only; `None`: every key of the sequence.
    pub window: Option<usize>,
    pub scale: f32,
}

/// Row-major query / key / value rows as the kernels read them: rows
/// `stride` elements apart (a column slice of a fused QKV projection
/// passes as is), 16-byte aligned; anything else is first copied.
struct Rows {
    ptr: u64,
    stride: i64,
    _copy: Option<CudaStorage>,
}

fn rows(s: &CudaStorage, l: &Layout) -> Result<Rows> {
    // A column slice of a wider row-major matrix, rows 16-byte aligned: as is.
    let (dims, st) = (l.dims(), l.stride());
    if dims.len() == 2 && st[1] == 1 && st[0] % 8 == 0 && l.start_offset().is_multiple_of(8) {
        let ptr = storage_ptr(s, &Layout::contiguous_with_offset(dims, l.start_offset()))?;
        if ptr.is_multiple_of(16) {
            return Ok(Rows { ptr, stride: st[0] as i64, _copy: None });
        }
    }
    // SAFETY: copy_strided_src writes every element before the kernels read them.
    let mut copy = unsafe { s.device.alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut copy, 0, l)?;
    let ptr = storage_ptr(&copy, &Layout::contiguous(l.shape()))?;
    // H·dh with dh in 32, 64, 128: rows of whole 16-byte chunks.
    Ok(Rows { ptr, stride: *dims.last().unwrap_or(&0) as i64, _copy: Some(copy) })
}

fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).or_else(|_| bail!("{what}: {v} exceeds the attention kernels' 32-bit sizes"))
}

impl FlashGeom {
    fn params(&self, cu: &CudaStorage) -> Result<FlashParams> {
        if self.batch > 65_535 {
            bail!("cu_seqlens: {} sequences, at most 65 535 per launch on CUDA", self.batch)
        }
        Ok(FlashParams {
            cu: storage_ptr(cu, &Layout::contiguous(self.batch + 1))?,
            batch: int("cu_seqlens", self.batch)?,
            heads: int("heads", self.heads)?,
            total: int("q", self.total)?,
            // A window as wide as the longest sequence limits nothing; passing
            // it on would overflow the kernels' 32-bit row ranges near 2^31.
            window: match self.window {
                Some(w) if w < self.max_len => int("window", w)?,
                _ => -1,
            },
            scale_log2: self.scale * std::f32::consts::LOG2_E,
            scale: self.scale,
            ..Default::default()
        })
    }

    /// m16 row tiles per warp of a kernel (FaTile's MT): 2 once sequences
    /// reach 256 rows (B fragments shared by two tiles halve the
    /// shared-memory reads per MMA), 1 below (blocks of 128 rows would
    /// mostly pad short sequences); dQ keeps 1 at dh 128 (it would spill),
    /// dK dV always (its four accumulator sets fill the registers at 1).
    fn tiles(&self, stem: &str) -> usize {
        let long = self.max_len >= 256;
        match stem {
            "flash_fwd" if long => 2,
            "flash_bwd_dq" if long && self.dh <= 64 => 2,
            _ => 1,
        }
    }

    /// Whether kernel `stem` has a Hopper (sm_90a wgmma) version for this
    /// problem on this device: the forward at head dims 64 and 128, the
    /// backward's dQ and dK dV at 64 (kernels/flash_attn_hopper.cuh).
    fn hopper(&self, stem: &str, dev: &CudaDevice) -> Result<bool> {
        let dims: &[usize] = if stem == "flash_fwd" { &[64, 128] } else { &[64] };
        // The default on sm_90 (CANDLE_MAXSIM_ATTENTION=mma opts out): a
        // training step (forward and backward) at 32 x 512 x 12 x 64 on an
        // H200 1.42x faster than on mma.sync, 1.83x at 4 x 4096 (BENCHMARKS.md).
        Ok(crate::knobs::knobs().attention_wgmma && device_info(dev)?.cc == 90 && dims.contains(&self.dh))
    }

    /// The Hopper version of kernel `stem`: blocks of two warpgroups over
    /// 128 rows, 64 rows of the other side per step, shared memory as
    /// FwdTile / BwdTile size it (the block's fixed tiles, then rings of
    /// 64-row slots: K and V in the forward, 4 slots at dh 64 and 3 at 128;
    /// in the backward 4 slots of two tiles and 512 bytes of statistics,
    /// each slot rounded to 1 KB; 1 KB to align the swizzled tiles).
    fn hopper_launch_of(&self, stem: &str, dt: DType) -> (String, LaunchConfig) {
        let dh = self.dh;
        let smem = if stem == "flash_fwd" {
            let slots = if dh == 64 { 4 } else { 3 };
            1024 + 2 * (128 * dh + 2 * slots * 64 * dh)
        } else {
            1024 + 2 * 2 * 128 * dh + 4 * (2 * 2 * 64 * dh + 2 * 64 * 4).div_ceil(1024) * 1024
        };
        let cfg = LaunchConfig {
            grid_dim: (self.max_len.div_ceil(128).max(1) as u32, self.heads as u32, self.batch as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        (format!("{stem}_wg_{}_d{dh}", dtype_tag(dt)), cfg)
    }

    /// The kernel that runs `stem` on this device, and its launch.
    fn kernel_of(&self, stem: &str, dt: DType, dev: &CudaDevice) -> Result<(String, LaunchConfig)> {
        Ok(if self.hopper(stem, dev)? { self.hopper_launch_of(stem, dt) } else { self.launch_of(stem, dt) })
    }

    /// Kernel `stem` for this problem: its name, launch grid (blocks of 64
    /// MT rows of each (sequence, head)) and shared memory, as FaTile in
    /// kernels/flash_attn.cu sizes it.
    fn launch_of(&self, stem: &str, dt: DType) -> (String, LaunchConfig) {
        let mt = self.tiles(stem);
        let (ld, bm) = (self.dh + 8, 64 * mt);
        let fwd_n = if self.dh == 128 && mt == 2 { 32 } else { 64 };
        let bwd_n = if self.dh == 128 { 32 } else { 64 };
        let smem = match stem {
            "flash_fwd" => (bm + 4 * fwd_n) * ld * 2,
            _ => (2 * bm + 4 * bwd_n) * ld * 2 + 4 * bwd_n * 4,
        } as u32;
        let cfg = LaunchConfig {
            grid_dim: (self.max_len.div_ceil(bm).max(1) as u32, self.heads as u32, self.batch as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem,
        };
        (format!("{stem}_{}_d{}_m{mt}", dtype_tag(dt), self.dh), cfg)
    }
}

/// Whether the kernels run on this device: F16 / BF16, head dims 32, 64
/// and 128, compute capability 8.0 or newer.
pub(crate) fn flash_supported(s: &CudaStorage, dh: usize) -> Result<bool> {
    Ok(matches!(s.dtype(), DType::F16 | DType::BF16) && matches!(dh, 32 | 64 | 128) && device_info(&s.device)?.cc >= 80)
}

/// `(O [T, H·dh], lse [H, T] F32, log2 domain)` of q, k, v.
pub(crate) fn flash_fwd(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    cu: &CudaStorage,
    g: &FlashGeom,
) -> Result<(CudaStorage, CudaStorage)> {
    let dev = &q.0.device;
    let dt = q.0.dtype();
    let hd = g.heads * g.dh;
    let out = alloc_out(dev, dt, g.total * hd)?;
    let lse = alloc_out(dev, DType::F32, g.heads * g.total)?;
    if g.total == 0 {
        return Ok((out, lse));
    }
    let (qr, kr, vr) = (rows(q.0, q.1)?, rows(k.0, k.1)?, rows(v.0, v.1)?);
    let p = FlashParams {
        q: qr.ptr,
        k: kr.ptr,
        v: vr.ptr,
        q_row: qr.stride,
        k_row: kr.stride,
        v_row: vr.stride,
        out: storage_ptr(&out, &Layout::contiguous(1))?,
        lse: storage_ptr(&lse, &Layout::contiguous(1))?,
        ..g.params(cu)?
    };
    let (name, cfg) = g.kernel_of("flash_fwd", dt, dev)?;
    let func = kernel(dev, Module::FlashAttn, &name, cfg.shared_mem_bytes)?;
    launch(dev, &func, cfg, &p)?;
    Ok((out, lse))
}

/// The gradients `[3, T, H·dh]` (dQ, dK, dV) from the forward's output `o`,
/// its gradient `dout` (both contiguous `[T, H·dh]`) and log-sum-exp.
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_bwd(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    o: (&CudaStorage, &Layout),
    dout: (&CudaStorage, &Layout),
    lse: (&CudaStorage, &Layout),
    cu: &CudaStorage,
    g: &FlashGeom,
) -> Result<CudaStorage> {
    let dev = &q.0.device;
    let dt = q.0.dtype();
    let n = g.total * g.heads * g.dh;
    let grads = alloc_out(dev, dt, 3 * n)?;
    if g.total == 0 {
        return Ok(grads);
    }
    let delta = alloc_out(dev, DType::F32, g.heads * g.total)?;
    let (qr, kr, vr) = (rows(q.0, q.1)?, rows(k.0, k.1)?, rows(v.0, v.1)?);
    let base = storage_ptr(&grads, &Layout::contiguous(1))?;
    let esz = dt.size_in_bytes() as u64;
    let p = FlashParams {
        q: qr.ptr,
        k: kr.ptr,
        v: vr.ptr,
        q_row: qr.stride,
        k_row: kr.stride,
        v_row: vr.stride,
        o: storage_ptr(o.0, o.1)?,
        dout: storage_ptr(dout.0, dout.1)?,
        out: base,
        dk: base + n as u64 * esz,
        dv: base + 2 * n as u64 * esz,
        lse: storage_ptr(lse.0, lse.1)?,
        delta: storage_ptr(&delta, &Layout::contiguous(1))?,
        ..g.params(cu)?
    };
    let func = kernel(dev, Module::FlashAttn, &format!("flash_delta_{}_d{}", dtype_tag(dt), g.dh), 0)?;
    launch(dev, &func, grid_stride(dev, g.total * g.heads, 8, 256, 16)?, &p)?;
    for stem in ["flash_bwd_dq", "flash_bwd_dkdv"] {
        let (name, cfg) = g.kernel_of(stem, dt, dev)?;
        let func = kernel(dev, Module::FlashAttn, &name, cfg.shared_mem_bytes)?;
        launch(dev, &func, cfg, &p)?;
    }
    Ok(grads)
}
