#!/usr/bin/env bash
# The GPU procedure on one H200: the GPU test suite, then the benchmarks (`dflash-train bench MODE`).
# One log per step and a summary line each (exit code, seconds, last line: the JSON result) go to
# $OUT (default ./gpu-logs). docs/performance.md says what each step measured last time.
#
# Usage: scripts/gpu_checks.sh [GROUP ...]     (default: all)
#   tests       pytest -m gpu (the whole GPU suite, its wall time in the summary)
#   train       bench train at the Qwen3.6-27B shape: 4K bf16 (+ kernel profile) and FP8, 32K, 128K
#               with activation checkpointing, 2 rows, the drafter alone at 8,000 tokens
#   lengths     bench lengths short-chat and mixed-chat (buckets against packing)
#   checkpoint  bench checkpoint at the Qwen3.6-27B drafter shape (gather, DCP, DCP async) on $CKPT_DIR
#   eval        bench eval at the Qwen3.6-27B shape (8 layers); with $SMOLLM2 also the 164 x 512 bar
#   decode      bench decode (needs $SMOLLM2, a SmolLM2-135M-Instruct directory)
#   generation  bench generation at the Qwen3.6-27B shape (8 layers, 64 and 256 slots, against the padded
#               engine; first the top-p draw alone (sort, exact, exact compiled) at 1,024 x 49,152 and 64 x 248,320);
#               with $SMOLLM2 also 1,024 slots x 512 tokens with the decode-step profile
#   multi       scripts/gpu_multi_smoke.sh (NCCL smoke runs; a machine with 2+ GPUs)
# The fla-core (and torchao) wheels in .whl/ are installed first when present.
# One device call runs at most 10 minutes: every step's limit is at most 570 s, and all steps together
# stop at $BUDGET_S (default 570; 0 = no budget): a step starts only with 30 s left, its limit cut to
# what is left, and the steps that no longer fit are listed as not run. A group of several long steps
# (train, lengths, generation) does not fit one call: run its bench commands one or two per call, as
# scripts/gpu_figures.py does for the figures still owed (docs/performance.md, "Owed GPU figures").
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-570}
started=$(date +%s)
CKPT_DIR=${CKPT_DIR:-/tmp/ckpt-bench}
SMOLLM2=${SMOLLM2:-}
groups=("$@"); [ ${#groups[@]} -eq 0 ] && groups=(tests train lengths checkpoint eval decode generation)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
step() {  # step NAME TIMEOUT CMD...: run CMD under a wall-clock limit (cut to the budget left), log it, summarize it
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  if [ "$BUDGET_S" -gt 0 ]; then
    local left=$(( BUDGET_S - (t0 - started) ))
    if [ "$left" -lt 30 ]; then
      printf '%-24s not run: under 30 s of BUDGET_S=%s left\n' "$name" "$BUDGET_S" | tee -a "$OUT/summary.txt"
      return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
  fi
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-24s rc=%-3s %5ss  %s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-400)" | tee -a "$OUT/summary.txt"
}
bench_step() {  # bench_step NAME TIMEOUT MODE ARGS...: one `dflash-train bench` command as a step
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 -m dflash_train.cli bench "$@" --no-progress --json
}
q36=(--preset qwen3.6-27b)
git log -1 --format='commit %h %cs' 2>/dev/null | tee -a "$OUT/summary.txt"
echo "source $(python3 scripts/gpu_figures.py --print-source-digest)" | tee -a "$OUT/summary.txt"  # the code by content
python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/summary.txt"
for group in "${groups[@]}"; do
  case $group in
    tests)
      step gpu_tests 570 python3 -m pytest -q -m gpu tests ;;
    train)
      bench_step train_tiny_cuda 180 train --preset tiny --device cuda --steps 3
      bench_step train_27b_4k 570 train "${q36[@]}" --profile "$OUT/profile_4k.txt"
      bench_step train_27b_4k_fp8 570 train "${q36[@]}" --target-fp8
      bench_step train_27b_32k 570 train "${q36[@]}" --seq-len 32768 --num-anchors 2048 --steps 2 --warmup 1
      bench_step train_27b_32k_fp8 570 train "${q36[@]}" --target-fp8 --seq-len 32768 --num-anchors 2048 --steps 2 --warmup 1
      bench_step train_27b_128k_ckpt 570 train "${q36[@]}" --seq-len 131072 --num-anchors 8192 --activation-checkpointing --steps 1 --warmup 1
      bench_step train_27b_4k_rows2 570 train "${q36[@]}" --rows 2 --steps 4
      bench_step train_27b_drafter_8k 570 train "${q36[@]}" --drafter-only --seq-len 8000 --num-anchors 1024 --steps 3 --warmup 1 ;;
    lengths)
      bench_step lengths_short_chat 570 lengths short-chat "${q36[@]}" --steps 30 --warmup 2
      bench_step lengths_mixed_chat 570 lengths mixed-chat "${q36[@]}" --steps 30 --warmup 2 ;;
    checkpoint)
      df -h "$(dirname "$CKPT_DIR")" | tee -a "$OUT/summary.txt"
      bench_step checkpoint_27b 570 checkpoint "${q36[@]}" --dir "$CKPT_DIR" --saves 2
      rm -rf "$CKPT_DIR" ;;
    eval)
      bench_step eval_27b_8layers 570 eval "${q36[@]}" --num-layers 8 --num-prompts 32 --max-new-tokens 128
      if [ -n "$SMOLLM2" ]; then
        bench_step eval_smollm2_164x512 570 eval --target "$SMOLLM2" --num-prompts 164 --max-new-tokens 512 --batch-size 64 --ignore-eos
      fi ;;
    decode)
      if [ -n "$SMOLLM2" ]; then
        bench_step decode_smollm2 570 decode --target "$SMOLLM2" --num-prompts 8 --max-new-tokens 256
      else
        echo "decode: skipped (set SMOLLM2 to a SmolLM2-135M-Instruct directory)" | tee -a "$OUT/summary.txt"
      fi ;;
    generation)
      bench_step generation_27b_8layers 570 generation "${q36[@]}" --num-layers 8 --batch-sizes 64,256 \
        --num-prompts 512 --max-new-tokens 256 --num-stop-ids 2 --engines padded,slots,slots-flex --profile \
        --sampler-shapes 1024x49152,64x248320 --out "$OUT/generation_27b.json"
      if [ -n "$SMOLLM2" ]; then
        bench_step generation_smollm2 570 generation --target "$SMOLLM2" --num-prompts 1024 --batch-sizes 1024 \
          --max-new-tokens 512 --engines slots,slots-flex,padded --profile --out "$OUT/generation_smollm2.json"
      fi ;;
    multi)
      OUT=$OUT scripts/gpu_multi_smoke.sh "${GPUS:-2}" ;;
    *)
      echo "unknown group $group (tests train lengths checkpoint eval decode generation multi)" >&2; exit 2 ;;
  esac
done
