# Source this file (do not run it):   source .ci/cuda-toolchain.sh
#
# Makes a CUDA 13.0 build toolchain available on a machine with no GPU and
# no system CUDA, so that `cargo build --features cuda` works here. The GPU
# machine runs driver 580 (CUDA 13.0): PTX from a newer nvcc is rejected
# there, so the versions below are pinned on purpose.
#
# Installs once into $CUDA_TOOLKIT_DIR (default /opt/cuda-13.0) from the
# Python package registry: nvcc, nvvm, runtime headers, CCCL, cuBLAS,
# cuRAND, NVRTC. Adds the unversioned .so links that the linker needs and a
# link-time stub for libcuda.so.1 (the real driver library is loaded on the
# GPU machine at run time). Then exports PATH, CUDA_ROOT, CUDA_PATH and
# CUDA_COMPUTE_CAP (default 90: H100/H200).

CUDA_TOOLKIT_DIR="${CUDA_TOOLKIT_DIR:-/opt/cuda-13.0}"
__cuda_root="$CUDA_TOOLKIT_DIR/nvidia/cu13"

if [ ! -x "$__cuda_root/bin/nvcc" ] || [ ! -e "$__cuda_root/lib/stubs/libcuda.so" ]; then
    echo "toolchain.sh: installing CUDA 13.0 build toolchain into $CUDA_TOOLKIT_DIR" >&2
    python3 -m pip install -q --disable-pip-version-check --no-deps --target "$CUDA_TOOLKIT_DIR" \
        "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-runtime==13.0.96" \
        "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85" "nvidia-cublas==13.0.2.14" \
        "nvidia-curand==10.4.0.35" "nvidia-cuda-nvrtc==13.0.88" >&2 \
    && (
        set -e
        cd "$__cuda_root/lib"
        for f in libcublas libcublasLt libcudart libnvrtc; do ln -sf "$f.so.13" "$f.so"; done
        ln -sf libcurand.so.10 libcurand.so
        mkdir -p stubs && cd stubs
        # Link-time stub: every driver API symbol declared in cuda.h, no body.
        gcc -E -P "$__cuda_root/include/cuda.h" \
            | grep -oE "\bcu[A-Z][A-Za-z0-9_]*[ ]*\(" | tr -d ' (' | sort -u \
            | awk '{print "void " $1 "(void){}"}' > libcuda_stub.c
        gcc -shared -fPIC -o libcuda.so libcuda_stub.c -Wl,-soname,libcuda.so.1
        ln -sf libcuda.so libcuda.so.1
        cd "$__cuda_root" && ln -sfn lib lib64
    ) || echo "toolchain.sh: install FAILED" >&2
fi

export PATH="$__cuda_root/bin:$PATH"
export CUDA_ROOT="$__cuda_root"
export CUDA_PATH="$__cuda_root"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
unset __cuda_root
