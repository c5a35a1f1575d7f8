// The MaxSim forward's kernel traits: one tile configuration (a row of
// kernels/tiles.def at a dtype and width) as compile-time constants, and the
// shared-memory layout they imply (mirrored by src/cuda/tile_size.rs).
#pragma once
#include "common.cuh"

template <typename T, int DPAD_, int WM_, int WN_, int MT_, int NT_, int STAGES_, bool HOPPER_ = false,
          int KDIM_ = DPAD_>
struct TileConfig {
    using Elem = T;
    static constexpr int DPAD = DPAD_;       // stored tile width (64, 128 or 256; 128 for 8-bit)
    static constexpr int WM = WM_, WN = WN_; // warps along query rows / document columns
    static constexpr int MT = MT_, NT = NT_; // m16 tiles and n8 tiles per warp
    static constexpr int NWARPS = WM * WN, NTHREADS = 32 * NWARPS;
    static constexpr int BQ = WM * MT * 16;  // query rows per block
    static constexpr int BD = WN * NT * 8;   // document rows per pipeline stage
    // Columns multiplied: DPAD, or less for dims 48 and 96 and 8-bit dims
    // 32 to 96 (their tiles are stored wider, the zero columns past KDIM
    // are skipped).
    static constexpr int KSTEPS = KDIM_ / Frag<T>::K;
    static_assert(KDIM_ % Frag<T>::K == 0 && KDIM_ <= DPAD_, "KDIM");
    // Dims over 256: the A fragments of all K steps would not fit in
    // registers; each K step reads its own from the staged Q rows instead.
    static constexpr bool A_SMEM = KDIM_ > 256;
    static constexpr int AK = A_SMEM ? 1 : KSTEPS; // K steps of A held in registers
    static constexpr int STAGES = STAGES_;   // cp.async pipeline depth (tiles in flight + 1)
    static constexpr bool HOPPER = HOPPER_;  // wgmma (sm_90a) instead of mma.sync
    // 8-bit: per-token scales (F32) staged with each document tile.
    static constexpr bool SCALED = sizeof(T) == 1;
    // Hopper tiles ask for two resident blocks per SM (registers capped at 128
    // for 256 threads), so one block's epilogue overlaps the other's wgmma.
    static constexpr int MIN_BLOCKS = HOPPER ? 2 : 1;
    // Tile rows: padded by 16 B (conflict-free ldmatrix), or for wgmma
    // panels of [BD, 128 bytes], 128-byte swizzled.
    static constexpr int EPC = 16 / (int)sizeof(T); // elements per 16-byte chunk
    static constexpr int SROW = DPAD + EPC;
    static constexpr int ROW_STEP = HOPPER ? 8 * EPC : SROW;
    static constexpr int TILE_ELEMS = HOPPER ? BD * DPAD : BD * SROW;
    // mma.sync stages Q in its own rows so that the first D tiles load while Q
    // does; the Hopper path loads Q fragments straight from global memory.
    static constexpr int Q_ELEMS = HOPPER ? 0 : BQ * SROW;
    static constexpr int ALIGN_SLACK = HOPPER ? 1024 : 0; // swizzled tiles start 1024-aligned
    // Then the stages' masks and, for 8-bit tiles, their scales (16-byte aligned).
    static constexpr int MASK_BYTES = (STAGES * BD + 15) & ~15;
    static constexpr int SCALE_BYTES = SCALED ? STAGES * BD * 4 : 0;
    static constexpr int SMEM_BYTES =
        ALIGN_SLACK + (Q_ELEMS + STAGES * TILE_ELEMS) * (int)sizeof(T) + MASK_BYTES + SCALE_BYTES;
    // Element offset of 16-byte chunk `ch` of tile row `r`.
    static __device__ __forceinline__ int offset(int r, int ch) {
        if (HOPPER) return swizzle128<BD, EPC>(r, ch);
        return r * SROW + ch * EPC;
    }
    static_assert(NT % 2 == 0, "ldmatrix.x4 loads two n8 tiles");
    static_assert(!(HOPPER && A_SMEM), "wgmma tiles hold A in registers");
    static_assert(!HOPPER || (sizeof(T) <= 2 && WN == 1 && MT == 1 && WM % 4 == 0 && (BD == 64 || BD == 128) &&
                              DPAD % (8 * EPC) == 0),
                  "wgmma tiles: warpgroups along the query rows, the whole tile along N");
};
