#!/usr/bin/env bash
# The engine on a CUDA device: tests/test_cuda.py, then the engine-level suites with their
# engines on the GPU (tests/conftest.py: KVMOSAIC_TEST_DEVICE). Needs a torch with CUDA and the
# project installed with its test extras (scripts/setup.sh), the Redis tests left out unless a
# redis-server is found. CI has no GPU: run this where there is one (docs/ARCHITECTURE.md, "Devices").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')"
$PY -m pytest -q -s -p no:cacheprovider tests/test_cuda.py
skip=()
if ! $PY -c "import sys; from kvmosaic.tiers.redis_server import find_redis_server; sys.exit(find_redis_server() is None)"; then
  skip=(-k "not redis and not write_through_tier_after_reset")  # those need a redis-server binary
fi
KVMOSAIC_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider "${skip[@]}" \
  tests/test_families.py tests/test_cache_equivalence.py tests/test_radix_engine.py \
  tests/test_model_vs_transformers.py tests/test_blend_engine.py tests/test_tier_engine.py \
  tests/test_auto_reuse.py tests/test_engine_api.py tests/test_hybrid_engine.py "$@"
# The server on the GPU (one process: --replicas needs Ray, which the check does not assume).
KVMOSAIC_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider tests/test_server_auto_reuse.py -k one-process
