// The MaxSim forward's scheduler within a block: the pipeline's steps
// (document, tile of BD rows) over the block's non-empty documents, and the
// step record the warp-specialized producer hands to its consumers. Which
// block owns which queries and documents is block_work (common.cuh).
#pragma once
#include "maxsim_fwd_traits.cuh"

#if __CUDA_ARCH__ >= 750

// ---------------------------------------------------------------------------
// The pipeline's steps: (document, tile of BD rows) of a block's non-empty
// documents, in order.
// ---------------------------------------------------------------------------
template <typename C> struct DocSteps {
    int j, k;    // document, tile within it
    int end;     // one past the block's last document
    __device__ __forceinline__ DocSteps(const MaxSimParams& p, int begin, int end_) : k(0), end(end_) {
        j = nonempty(p, begin);
    }
    __device__ __forceinline__ bool more() const { return j < end; }
    __device__ __forceinline__ int nonempty(const MaxSimParams& p, int from) const {
        while (from < end) {
            const Range dr = d_rows(p, from);
            if (dr.end > dr.begin) break;
            ++from;
        }
        return from;
    }
    __device__ __forceinline__ void advance(const MaxSimParams& p) {
        const Range dr = d_rows(p, j);
        if (++k * C::BD >= dr.end - dr.begin) j = nonempty(p, j + 1), k = 0;
    }
    // The step's document rows: [start, start + n).
    __device__ __forceinline__ void rows(const MaxSimParams& p, int& start, int& n) const {
        const Range dr = d_rows(p, j);
        start = dr.begin + k * C::BD, n = min(C::BD, dr.end - start);
    }
};

// A step as the warp-specialized producer hands it to the consumers with its
// tile (one per ring stage, written before the stage's `full` arrival): the
// consumers read it instead of walking the documents' offsets themselves.
enum : uint32_t { STEP_DOC_LAST = 1, STEP_CHUNK_LAST = 2 };
struct __align__(16) StepInfo {
    int j, col0, n;  // document, its column of the tile's first row, valid rows
    uint32_t flags;  // STEP_DOC_LAST: the document's last tile; STEP_CHUNK_LAST: the query chunk's last step
};

#endif // __CUDA_ARCH__ >= 750
