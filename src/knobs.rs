//! Debug and test knobs, read from the environment once, in this one place. They select kernels for testing and diagnosis; none is
//! needed for correct or fast results.
//!
//! | variable | effect |
//! |---|---|
//! | `CANDLE_MAXSIM_ARCH=sm75\|sm80` | run the PTX module, kernel choice and shared-memory limit of an older GPU on this one |
//! | `CANDLE_MAXSIM_TILE=<config>` | pin the forward's tile configuration (`large`, `small`, `narrow`, `wide`, `xwide`, `hlarge`, `hmid`, `hsmall`, `hsmall3`, `hws`, `hws64`, `hwsmid`, `compact`, `flarge`, `fsmall`) where it applies |
//! | `CANDLE_MAXSIM_LOG=1` | print each tile-selection decision to stderr |
//! | `CANDLE_MAXSIM_RESIDUAL=tile` | keep residual scoring on the tile kernels (never the warp kernel) |
//! | `CANDLE_MAXSIM_CPU=gemm` | CPU forward on the portable GEMM path even where the AVX-512 lane kernels run (CI tests both) |
//! | `CANDLE_MAXSIM_CPU=bf16dot\|bf16widen` | BF16 CPU forward and linear layers on VDPBF16PS (where the CPU has it; never AMX tiles), or widened to F32, whatever the CPU's vendor (CI tests both) |
//! | `CANDLE_MAXSIM_CPU=noamx` | BF16 linear layers on the CPU never on AMX tiles (VDPBF16PS where the CPU has it, else widened to F32) |
//! | `CANDLE_MAXSIM_ATTENTION=mma` | on sm_90, the attention kernels of sm_80 (mma.sync) instead of those on wgmma (sm_90a) |
//! | `CANDLE_MAXSIM_LAZY_ARGMAX=<column>` | the document column from which the 16-bit argmax forward on wgmma tiles scans a tile only where some row's maximum rises (default 8 192; 0: never; same results either way) |

use std::sync::OnceLock;

/// From this document column on, the argmax forward skips the scan of tiles
/// where no row's maximum rises. Past a few thousand columns most tiles
/// raise none: `nearest_centroids` of 8 192 tokens over 262 144 centroids
/// 1.59 -> 1.28 ms on an H200 (from column 1 024 or 8 192 alike); on
/// documents up to 8 192 columns the check never runs.
const DEFAULT_LAZY_ARGMAX_COLS: i32 = 8192;

/// The knobs in force for this process.
#[doc(hidden)]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Knobs {
    /// Emulated compute capability (75 or 80), if any.
    pub arch: Option<u32>,
    /// Pinned tile configuration name, if any.
    pub tile: Option<String>,
    /// Print tile-selection decisions.
    pub log: bool,
    /// Residual scoring on the tile kernels only.
    pub residual_tile: bool,
    /// CPU forward on the GEMM path only.
    pub cpu_gemm: bool,
    /// BF16 CPU forward pinned to VDPBF16PS (true) or to widening (false).
    pub cpu_bf16_dot: Option<bool>,
    /// BF16 linear layers on the CPU never on AMX tiles.
    pub cpu_no_amx: bool,
    /// Attention on the wgmma kernels where the device has them (the default).
    pub attention_wgmma: bool,
    /// First document column of the argmax forward's lazy scan (0: never).
    pub lazy_argmax_cols: i32,
}

impl Knobs {
    fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok();
        Knobs {
            arch: match var("CANDLE_MAXSIM_ARCH").as_deref() {
                Some("sm75") => Some(75),
                Some("sm80") => Some(80),
                _ => None,
            },
            tile: var("CANDLE_MAXSIM_TILE"),
            log: std::env::var_os("CANDLE_MAXSIM_LOG").is_some(),
            residual_tile: var("CANDLE_MAXSIM_RESIDUAL").as_deref() == Some("tile"),
            cpu_gemm: var("CANDLE_MAXSIM_CPU").as_deref() == Some("gemm"),
            cpu_bf16_dot: match var("CANDLE_MAXSIM_CPU").as_deref() {
                Some("bf16dot") => Some(true),
                Some("bf16widen") => Some(false),
                _ => None,
            },
            cpu_no_amx: var("CANDLE_MAXSIM_CPU").as_deref() == Some("noamx"),
            attention_wgmma: var("CANDLE_MAXSIM_ATTENTION").as_deref() != Some("mma"),
            lazy_argmax_cols: var("CANDLE_MAXSIM_LAZY_ARGMAX")
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_LAZY_ARGMAX_COLS)
                .max(0),
        }
    }
}

/// The process's knobs, read from the environment on first use.
#[doc(hidden)]
pub fn knobs() -> &'static Knobs {
    static KNOBS: OnceLock<Knobs> = OnceLock::new();
    KNOBS.get_or_init(Knobs::from_env)
}
