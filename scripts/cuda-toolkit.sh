#!/usr/bin/env bash
# A CUDA 13.0 toolkit for building `--features cuda` on a machine without one (and without a
# GPU): NVIDIA publishes nvcc, the runtime headers, cuBLAS, cuRAND, NVRTC and NCCL (for
# `--features nccl`, data-parallel training over several GPUs) as PyPI wheels. They
# go into a venv under ~/.cache (or ART_CUDA_ROOT) once; the script then prints the environment a
# build needs:
#
#   eval "$(scripts/cuda-toolkit.sh)"
#   cargo build --release -p art-core --features server,cuda --bin art
#
# CUDA 13.0 on purpose: binaries built with a newer nvcc carry PTX that a 13.0 driver (580)
# refuses. The GPU's own driver provides libcuda at run time; for linking here a stub library
# with the driver API's entry points stands in for it (the binary never calls the stub).
set -euo pipefail

CUDA_ROOT="${ART_CUDA_ROOT:-$HOME/.cache/art-cuda-13.0}"
WHEELS=(
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.5.25 nvidia-nccl-cu13==2.28.9
)

toolkit_dir() { # where the wheels put the toolkit, or nothing before they are installed
  compgen -G "$CUDA_ROOT/venv/lib/python3*/site-packages/nvidia/cu13" | head -n 1 || true
}

nccl_dir() { compgen -G "$CUDA_ROOT/venv/lib/python3*/site-packages/nvidia/nccl" | head -n 1 || true; }

if [ ! -x "$(toolkit_dir)/bin/nvcc" ] || [ ! -d "$(nccl_dir)/lib" ]; then
  python3 -m venv "$CUDA_ROOT/venv" >&2
  "$CUDA_ROOT/venv/bin/pip" install --quiet --disable-pip-version-check "${WHEELS[@]}" >&2
fi
TOOLKIT="$(toolkit_dir)"
[ -x "$TOOLKIT/bin/nvcc" ] || { echo "cuda-toolkit.sh: no nvcc under $CUDA_ROOT after installing the wheels" >&2; exit 1; }

NCCL="$(nccl_dir)"

# The wheels ship versioned libraries only (libcublas.so.13); the linker looks for libcublas.so.
for versioned in "$TOOLKIT"/lib/lib{cudart,cublas,cublasLt,curand,nvrtc}.so.[0-9]* "$NCCL"/lib/libnccl.so.[0-9]*; do
  case "$versioned" in *.so.*.*) continue ;; esac # the fully versioned files have links already
  ln -sf "$(basename "$versioned")" "${versioned%.so.*}.so"
done

# Link-time stand-in for the driver's libcuda.so: one dummy function per `cu*` entry point that
# cuda.h declares.
STUB="$TOOLKIT/lib/stubs/libcuda.so"
if [ ! -f "$STUB" ]; then
  mkdir -p "$(dirname "$STUB")"
  printf '#include <cuda.h>\n' | gcc -E -I"$TOOLKIT/include" - \
    | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' | sort -u \
    | sed 's/.*/int &(void) { return 999; }/' > "$CUDA_ROOT/libcuda-stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUB" "$CUDA_ROOT/libcuda-stub.c"
fi

# A binary built with `nccl` loads libnccl.so.2 at start: from LD_LIBRARY_PATH, or the system's.
echo "export CUDA_HOME='$TOOLKIT' CUDA_COMPUTE_CAP=90 PATH='$TOOLKIT/bin':\"\$PATH\" LIBRARY_PATH='$TOOLKIT/lib:$TOOLKIT/lib/stubs:$NCCL/lib'"
