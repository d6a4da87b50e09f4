#!/usr/bin/env bash
# GPU checks and benchmarks on one H200 (torch 2.11, no network): logs go to $OUT (or ./gpu-logs).
# Usage: scripts/gpu_checks.sh [checks|bench|bench2|ablation|shapes|longest|loose|all]   (fla-core wheels in .whl/, see docs/performance.md)
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
what=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-300)" | tee -a "$OUT/summary.txt"
}
python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/summary.txt"
if [ "$what" = checks ] || [ "$what" = all ]; then
  step gpu_tests 240 python3 -m pytest -q -x -m gpu tests
  step target_check 180 python3 scripts/gpu_check_target.py
  step drafter_check 300 python3 scripts/gpu_check_drafter.py
  step bench_tiny_cuda 120 python3 -m dflash_train.cli bench --preset tiny --device cuda --steps 3 --json
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  step bench_27b_4k 200 python3 -m dflash_train.cli bench --preset qwen3.6-27b --profile "$OUT/profile_4k.txt" --json
  step bench_27b_128k_ckpt 230 python3 -m dflash_train.cli bench --preset qwen3.6-27b --seq-len 131072 --num-anchors 8192 --activation-checkpointing --steps 2 --warmup 1 --json
  step bench_27b_4k_rows2 160 python3 -m dflash_train.cli bench --preset qwen3.6-27b --rows 2 --steps 4 --json
fi
if [ "$what" = ablation ]; then
  step ablation 420 python3 scripts/gpu_ablation.py
  step gpu_tests 150 python3 -m pytest -q -x -m gpu tests
fi
if [ "$what" = shapes ]; then
  step shapes 560 python3 scripts/gpu_ablation.py --only shapes
fi
if [ "$what" = longest ]; then  # the 128K row that ran out of memory in `bench`, without allocator fragmentation
  step bench_27b_128k_ckpt_expandable 270 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m dflash_train.cli bench --preset qwen3.6-27b --seq-len 131072 --num-anchors 8192 --activation-checkpointing --steps 1 --warmup 1 --json
fi
if [ "$what" = bench2 ]; then
  step bench_27b_full_sdpa 200 python3 -m dflash_train.cli bench --preset qwen3.6-27b --attention-backend sdpa --no-compile --json
fi
if [ "$what" = loose ]; then  # the GPU figures of the loose-ends round: saves, length mixes, the speed floor
  df -h /tmp | tee -a "$OUT/summary.txt"
  step ckpt_bench 300 python3 scripts/gpu_checkpoint_bench.py --dir /tmp/ckpt-bench
  rm -rf /tmp/ckpt-bench
  step bench_27b_bf16 150 python3 -m dflash_train.cli bench --preset qwen3.6-27b --json
  step bench_27b_fp8 150 python3 -m dflash_train.cli bench --preset qwen3.6-27b --target-fp8 --json
  step bench_short_chat 200 python3 -m dflash_train.cli bench --preset qwen3.6-27b --lengths short-chat --json
  step bench_mixed_chat 240 python3 -m dflash_train.cli bench --preset qwen3.6-27b --lengths mixed-chat --json
fi
if [ "$what" = gpu_tests ]; then  # the whole GPU suite, with its wall time in summary.txt
  step gpu_tests_all 560 python3 -m pytest -q -m gpu tests
fi
