//! The MaxSim forward's tile choice, FlashAttention's tile_size.h /
//! heuristics.h: the tile table (kernels/tiles.def, parsed by build.rs), the
//! kernel family a problem runs on, the configurations a device can run, and
//! the static rule that picks one, each decision with the measurement behind
//! it. The autotuner (maxsim_fwd.rs) times the same candidates instead.

use super::device::DeviceInfo;
use crate::layout::{Pairing, Problem};
use candle_core::{bail, DType, Result};

/// One row of kernels/tiles.def: a tile configuration of the tensor-core
/// forward, as the kernels instantiate it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TileRow {
    name: &'static str,
    /// `mma16`, `wide16`, `xwide16`, `f32`, `turing`, `hopper` or `hopperws` (see kernels/tiles.def).
    family: &'static str,
    wm: usize,
    wn: usize,
    mt: usize,
    nt: usize,
    stages: usize,
    /// Pipeline depth of the residual kernels; 0: none.
    res_stages: usize,
}

/// kernels/tiles.def, parsed by build.rs.
mod table {
    use super::{HiddenTile, TileRow};
    include!(concat!(env!("OUT_DIR"), "/tiles.rs"));
}

/// The fused projection head's tile.
pub(crate) const HIDDEN: HiddenTile = table::HIDDEN;

/// A tile configuration: a row of kernels/tiles.def.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct TileConfig(&'static TileRow);

impl std::fmt::Debug for TileConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.name)
    }
}

impl std::hash::Hash for TileRow {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.name.hash(h)
    }
}

impl TileConfig {
    pub(super) fn all() -> impl Iterator<Item = TileConfig> {
        table::TILES.iter().map(TileConfig)
    }
    pub(super) fn name(self) -> &'static str {
        self.0.name
    }
    pub(super) fn parse(s: &str) -> Option<Self> {
        Self::all().find(|c| c.name() == s)
    }
    /// wgmma tiles (swizzled document stages, sm_90a).
    pub(super) fn hopper(self) -> bool {
        matches!(self.0.family, "hopper" | "hopperws")
    }
    /// Warp-specialized: a TMA producer warpgroup besides the consumers,
    /// persistent blocks, the documents' tensor map as a second parameter.
    pub(super) fn ws(self) -> bool {
        self.0.family == "hopperws"
    }
    /// (query rows per block, doc rows per stage, threads).
    pub(super) fn shape(self) -> (usize, usize, u32) {
        let r = self.0;
        let producer = if self.ws() { 128 } else { 0 };
        (16 * r.wm * r.mt, 8 * r.wn * r.nt, (32 * r.wm * r.wn + producer) as u32)
    }
    /// Pipeline depth of the dense or the residual kernels.
    pub(super) fn stages(self, residual: bool) -> usize {
        if residual {
            self.0.res_stages
        } else {
            self.0.stages
        }
    }
    /// The element types it is compiled for, and from which module (compute capability).
    /// U8 stands for the I8 kernels, F8E4M3 for the e4m3 ones (wgmma only).
    pub(super) fn runs(self, dtype: DType, cc: i32) -> bool {
        let half = matches!(dtype, DType::F16 | DType::BF16);
        let int8 = dtype == DType::U8;
        match self.0.family {
            "f32" => dtype == DType::F32 && cc >= 80,
            "turing" => dtype == DType::F16 && cc < 80,
            "hopper" | "hopperws" => (half || int8 || dtype == DType::F8E4M3) && cc == 90,
            "wide16" | "xwide16" => half && cc >= 80,
            _ => (half || int8) && cc >= 80,
        }
    }
    /// Dynamic shared memory of its kernels, as maxsim_fwd.cu lays it out
    /// (the kernels trap when given less): mma.sync stages Q and the document
    /// tiles in rows padded by 16 bytes; Hopper tiles hold only the swizzled
    /// document stages, plus 1024 bytes of alignment slack; then the stages'
    /// masks. After the masks rounded up to 16 bytes, 8-bit kernels
    /// (`elem` 1) stage each tile's F32 token scales, and residual kernels
    /// (`res_nbits` > 0) its packed residual bytes (`dpad * res_nbits / 8`
    /// per row).
    pub(super) fn smem(self, dpad: usize, elem: usize, res_nbits: usize) -> u32 {
        let residual = res_nbits > 0;
        let (bq, bd, _) = self.shape();
        let st = self.stages(residual);
        let tiles = if self.hopper() { 1024 + st * bd * dpad * elem } else { (bq + st * bd) * (dpad * elem + 16) };
        let pad = (st * bd).next_multiple_of(16) - st * bd;
        let scales = if elem == 1 { pad + st * bd * 4 } else { 0 };
        let res = if residual { pad + st * bd * dpad * res_nbits / 8 } else { 0 };
        (tiles + st * bd + scales + res) as u32
    }
}

/// The kernel family a problem runs on.
#[derive(Clone, Copy, Debug)]
pub(super) enum Path {
    /// `dpad`: stored tile width (64, 128, 256); `width`: columns multiplied
    /// (48, 64, 96, 128, 256; 8-bit: 32, 64, 96, 128), the kernel's
    /// `d<width>` suffix.
    Mma {
        dpad: usize,
        width: usize,
    },
    Simt,
}

/// The 8-bit element types: U8 (the bytes of I8) and F8E4M3.
pub(super) fn eight_bit(dtype: DType) -> bool {
    matches!(dtype, DType::U8 | DType::F8E4M3)
}

pub(super) fn path_for(info: &DeviceInfo, dtype: DType, dim: usize) -> Path {
    if eight_bit(dtype) {
        // 8-bit rows: one 128-byte panel, K steps of 32 (no SIMT kernel: the caller dequantizes).
        let width = dim.next_multiple_of(32).max(32);
        return if dim <= 128 && !candidates(info, dtype, 128, 0).is_empty() {
            Path::Mma { dpad: 128, width }
        } else {
            Path::Simt
        };
    }
    let dpad = match dim {
        0..=64 => 64,
        65..=128 => 128,
        129..=256 => 256,
        _ => 512,
    };
    let width = match dim {
        33..=48 => 48,
        65..=96 => 96,
        257..=384 => 384,
        _ => dpad,
    };
    if dim <= 512 && !candidates(info, dtype, dpad, 0).is_empty() {
        Path::Mma { dpad, width }
    } else {
        Path::Simt
    }
}

/// The tile configurations for this dtype and width that the device's module
/// has and whose shared memory fits the device (e.g. sm_86 / sm_89 allow
/// less per block than sm_80 / sm_90); the Hopper tiles exist only in the
/// sm_90a module, loaded on compute capability 9.0. Empty: the SIMT kernel.
pub(super) fn candidates(info: &DeviceInfo, dtype: DType, dpad: usize, res_nbits: usize) -> Vec<TileConfig> {
    TileConfig::all()
        .filter(|c| c.runs(dtype, info.cc))
        .filter(|c| {
            let width = match c.0.family {
                "wide16" => 256,
                "xwide16" => 512,
                _ => 128,
            };
            width == dpad.max(128)
        })
        .filter(|c| res_nbits == 0 || c.stages(true) > 0)
        .filter(|c| c.smem(dpad, dtype.size_in_bytes(), res_nbits) as usize <= info.smem_optin)
        .collect()
}

/// The tile configuration pinned by the `CANDLE_MAXSIM_TILE` knob, if any.
pub(super) fn pinned_config() -> Option<TileConfig> {
    crate::knobs::knobs().tile.as_deref().and_then(TileConfig::parse)
}

/// Whether the residual kernels cover this query dtype, dim and nbits on this
/// device: 16-byte centroid chunks (dim % 8 == 0) and, for the fused
/// kernels' 4-byte copies, whole words of packed bits per token.
pub(super) fn residual_supported(info: &DeviceInfo, dtype: DType, dim: usize, nbits: usize) -> bool {
    let words = (dim * nbits).is_multiple_of(32);
    let fused = matches!(dtype, DType::F16 | DType::BF16) && info.cc >= 80;
    fused
        && dim.is_multiple_of(8)
        && words
        && matches!(path_for(info, dtype, dim), Path::Mma { dpad, .. } if dpad <= 128)
}

/// Whether the standalone decompression kernel (kernels/residual.cu)
/// covers this dtype, dim and nbits on this device: F16/BF16 tokens, 8-feature
/// chunks (dim % 8 == 0) of whole words of packed bits, compute capability
/// 8.0+. Wider than [`residual_supported`]: any such dim, which the dense
/// kernels then score (dims over 128, e.g. 384 or 768 without a projection).
pub(super) fn decompress_supported(info: &DeviceInfo, dtype: DType, dim: usize, nbits: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && info.cc >= 80
        && dim > 0
        && dim.is_multiple_of(8)
        && (dim * nbits).is_multiple_of(32)
}

pub(super) fn simt_smem(dtype: DType, dim: usize) -> Result<u32> {
    let acc = if dtype == DType::F64 { 8 } else { 4 };
    // `SIMT_SMEM` in maxsim_fwd.cu: 47 KB of tile, the static buffer on top.
    const SIMT_SMEM: usize = 47 * 1024;
    let rows = 16.min(SIMT_SMEM / (dim * acc).max(1));
    if rows == 0 {
        bail!("d: dim {dim} is too large for the CUDA fallback kernel (at most {})", SIMT_SMEM / acc)
    }
    Ok((rows * dim * acc) as u32)
}

/// The static tile choice, FlashAttention's tile_size.h style: one line per
/// decision with the measurement behind it (an H200, bf16 and f16: every
/// configuration timed on 336 problem classes by examples/tile_sweep.rs, dims
/// 48 to 128, and pinned one by one on the benchmark shapes of
/// examples/bench.rs). `fits`: the configurations of this dtype and width
/// that the device runs, in kernels/tiles.def order (never empty).
pub(super) fn static_config(info: &DeviceInfo, pb: &Problem, dtype: DType, fits: &[TileConfig]) -> TileConfig {
    let pick = |name: &str| fits.iter().copied().find(|c| c.name() == name);
    let list = matches!(pb.pairs, Pairing::List { .. });
    // Query rows that meet each document, documents, their longest length.
    let rows = if list { pb.q.max_len() } else { pb.q.rows() };
    let (nd, ld) = (pb.d.n(), pb.d.max_len().max(1));
    // Padded rows per real row with document tiles of `bd` rows.
    let waste = |bd: usize| ld.div_ceil(bd) * bd * 100 / ld;
    // Blocks of a 128-row query tile: under a few waves, tile efficiency matters less than filling the SMs.
    let blocks = rows.div_ceil(128) * nd;
    let sms = info.sm_count as usize;
    // `hws` is absent from `fits` where TMA cannot read the rows (see choose_config).
    let ws = pick("hws").is_some();
    let choice = if fits.iter().any(|c| c.hopper()) {
        // Hopper, f16 / bf16 / 8-bit.
        if list {
            "narrow" // KD lists of 32-token queries: narrow best or within 8 % (K 8 and 32, Ld 180)
        } else if ws && rows > 64 && ld > 128 && (dtype != DType::F8E4M3 || ld > 256) {
            "hws" // scores 1.04-1.41x the rule below on every grid, scan and long document of Ld >= 256 (colpali 1.27x); argmax 1.05-1.37x, at Lq 32 / Ld 256 1.03-1.15x; Ld 128 leaves one tile per document to overlap (64 x 5000: argmax 0.86x); I8 1.00-1.17x (colpali 1.10x); e4m3 1.00-1.10x at Ld 300-8192, 0.95x at Ld 256
        } else if ws && ld <= 64 && rows > 64 && blocks >= 4 * sms && dtype != DType::U8 {
            "hws64" // grids and scans of short documents (32 x 10 000 and 256 x 256, Lq 32, Ld 64): bf16 1.18-1.19x `large`, e4m3 1.26-1.27x `hlarge`; I8's `large` 1.27x faster than hws64; 16 x 16 grids too small
        } else if ld <= 64 && rows <= 64 {
            "hsmall" // 64-row document tiles: a 128-row tile would be half padding
        } else if ld <= 64 {
            "large" // I8 and small grids of short documents: large best of the non-warp-specialized tiles from 16x16 to 256x256 and 32 x 10 000, Lq 32, Ld 64
        } else if rows <= 64 && waste(128) > waste(64) * 11 / 10 {
            "hsmall" // one query against documents 64-row tiles fit better (Ld 300: hsmall best, hmid 1.03-1.06x)
        } else if rows <= 64 {
            "hmid" // one or two 32-token queries (rerank, scan): hmid best at 1000 and 10 000 documents of 128
        } else if blocks < 6 * sms && waste(128) > waste(64) * 115 / 100 {
            "large" // small grids of documents that pad a 128-row tile (32x32 Ld 300, 48x48 Ld 180: large best; 1000x4 Ld 300: hlarge)
        } else if blocks < 4 * sms {
            "hmid" // too few hlarge blocks to fill the SMs twice (longdoc 16 x 32 x 8192: hmid 1.13x faster)
        } else {
            "hlarge" // in-batch grids, scans and long queries: hlarge best on every benchmark shape above
        }
    } else if list {
        "narrow" // mma.sync set on KD lists: narrow best (small within 5 %)
    } else if rows <= 32 {
        "small" // one 32-token query: small best of the mma.sync set (large 1.3-1.6x)
    } else {
        "large" // 64 query rows and more: large best of the mma.sync set
    };
    // The residual kernels exist for large, narrow and hsmall only: the
    // nearest of those by tile shape (not measured apart). F32 follows the
    // same split between its two tiles (not measured apart either); a set
    // of one (wide, compact) is its only member.
    let nearest = match choice {
        "hlarge" => "large",
        "hmid" => "hsmall",
        _ => "narrow",
    };
    let f32_choice = if rows <= 32 { "fsmall" } else { "flarge" };
    pick(choice).or_else(|| pick(nearest)).or_else(|| pick(f32_choice)).unwrap_or(fits[0])
}

/// The fused projection head's tile (the `HIDDEN_TILE` row of kernels/tiles.def).
pub(crate) struct HiddenTile {
    /// Document rows per chunk.
    pub bd: usize,
    /// Query rows per MaxSim step.
    pub bq: usize,
    /// dmodel columns per projection step.
    pub ks: usize,
    pub stages: usize,
    pub threads: u32,
}
