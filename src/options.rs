//! Options of the dense entry points, and the one rule that resolves
//! [`Backward::Auto`] (used by every entry point and by the CUDA backward).

/// How the backward computes `grad_D`.
///
/// Measured on an H200 (bf16, training steps of `examples/bench.rs --train`):
/// `LowMem` is the faster mode at both standard training shapes (many short
/// queries against many documents, and KD lists), `Unified` at small grids
/// and long queries, where its one fused kernel needs no per-document hit
/// lists. `Auto` picks between them by that measured rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backward {
    /// `LowMem` for KD layouts and for Nq ≥ 256 ∧ Nd ≥ 256 ∧ Lq ≤ 64,
    /// `Unified` otherwise.
    #[default]
    Auto,
    /// One fused kernel; grad_D by f32 atomics into a full-size f32 buffer
    /// (not bitwise reproducible on CUDA).
    Unified,
    /// Destination-owned grad_D: no atomics, no full-size f32 buffer,
    /// bitwise deterministic.
    LowMem,
}

impl Backward {
    /// Resolves `Auto` for a problem of `nq` queries of at most `lq` tokens
    /// against `nd` documents; `kd`: the KD layout (each query its own K documents).
    pub(crate) fn resolve(self, kd: bool, nq: usize, nd: usize, lq: usize) -> Backward {
        match self {
            // A full-size f32 grad_D buffer costs most on KD lists and on
            // large grids of short queries.
            Backward::Auto if kd || (nq >= 256 && nd >= 256 && lq <= 64) => Backward::LowMem,
            Backward::Auto => Backward::Unified,
            b => b,
        }
    }
}

/// Options of [`crate::maxsim_with`] and [`crate::maxsim_pairs_with`].
#[derive(Clone, Copy, Debug, Default)]
pub struct MaxSimOptions {
    /// L2-normalize every token of Q and D inside the op (exact Jacobian in the backward).
    pub normalize: bool,
    /// How the backward computes `grad_D`.
    pub backward: Backward,
}

/// How the CUDA forward picks its tile configuration (kernels/tiles.def),
/// for the whole process: see [`set_tile_selection`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TileSelection {
    /// A fixed rule of the problem's shape, derived from measurements on an
    /// H200 (`static_config` in src/cuda/maxsim_fwd.rs): no timing, the same
    /// kernel on every run.
    #[default]
    Static,
    /// Time every configuration that fits on the first call of each problem
    /// class (on its inputs, three runs each) and keep the fastest for the
    /// process: may beat the rule on a GPU it was not measured on, at the
    /// cost of that first call and of a kernel choice that can differ
    /// between runs.
    Autotune,
}

static AUTOTUNE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets how the CUDA forward picks its tiles from now on, for every entry
/// point of this process (default [`TileSelection::Static`]).
pub fn set_tile_selection(s: TileSelection) {
    AUTOTUNE.store(s == TileSelection::Autotune, std::sync::atomic::Ordering::Relaxed);
}

/// The tile selection in force.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn tile_selection() -> TileSelection {
    if AUTOTUNE.load(std::sync::atomic::Ordering::Relaxed) {
        TileSelection::Autotune
    } else {
        TileSelection::Static
    }
}
