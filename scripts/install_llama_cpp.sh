#!/usr/bin/env bash
# Optional peer for `kvmosaic bench` and `kvmosaic bench serve`: llama-cpp-python with its server
# (compiles llama.cpp from source, about 4 minutes on a 2-core machine). The benchmarks skip this
# peer when it is absent.
# Usage: scripts/install_llama_cpp.sh   (inside the project's virtual environment)
set -euo pipefail
if python -c "import llama_cpp, sse_starlette, starlette_context, pydantic_settings" 2>/dev/null; then
  echo "llama-cpp-python already installed: $(python -c 'import llama_cpp; print(llama_cpp.__version__)')"
  exit 0
fi
# On a CPU with AMX, llama.cpp 0.3.36's native build runs the shipped Q4_1 model through its AMX
# kernels, which crash (SIGSEGV in ggml_backend_amx_mul_mat on the first decode, seen on a 2-core
# Xeon VM): build for the same CPU with AVX-512 but without AMX there.
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && [ -z "${CMAKE_ARGS:-}" ]; then
  isa="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  for f in avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI; do
    grep -qw "${f%%:*}" /proc/cpuinfo && isa="$isa -DGGML_${f##*:}=ON"
  done
  export CMAKE_ARGS="-DGGML_NATIVE=OFF $isa"
  echo "AMX CPU: building llama.cpp without AMX ($CMAKE_ARGS)"
fi
# [server]: llama_cpp.server, the peer of `kvmosaic bench serve`.
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" pip install --no-cache-dir 'llama-cpp-python[server]'
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
