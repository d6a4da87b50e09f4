#!/usr/bin/env bash
# Multi-GPU smoke runs over NCCL on the tiny task (bf16, flex attention): FSDP2 colocated, a resume
# of it across a restart, split placement 1 target : 1 drafter rank, and DDP. Logs go to $OUT.
# Usage: scripts/gpu_multi_smoke.sh [NUM_GPUS]   (fla-core wheels in .whl/, see docs/performance.md)
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
gpus=${1:-2}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
work=${WORK:-/tmp/dflash-smoke}
python3 - "$work" <<'EOF' || exit 1
import sys
from pathlib import Path
from tests.train_helpers import confident_tiny_target, write_repeat_task
work = Path(sys.argv[1]); work.mkdir(parents=True, exist_ok=True)
confident_tiny_target(work / "target")
write_repeat_task(work / "data.jsonl", rows=96)
EOF
common=(target.path=$work/target "data.paths=[$work/data.jsonl]" data.cache_dir=$work/cache
  "target.target_layer_ids=[0,2]" "data.seq_buckets=[64,128]" data.token_budget=256 train.num_anchors=8
  train.lr=3e-3 logging.every_steps=5 logging.progress_bar=off checkpoint.every_steps=10
  train.dist_timeout_s=60)
if [ "${DEVICE:-cuda}" = cuda ]; then
  common+=(train.device=cuda train.dtype=bfloat16 target.dtype=bfloat16)
else  # a CPU (gloo) dry run of this script
  common+=(train.device=cpu train.dtype=float32 target.dtype=float32)
fi
run() {  # run NAME RUN_DIR PROCS OVERRIDES...
  local name=$1 dir=$work/$2 procs=$3; shift 3
  local t0=$(date +%s)
  timeout "${RUN_TIMEOUT:-75}" torchrun --standalone --nproc-per-node "$procs" -m dflash_train.cli train tiny-cpu \
    "${common[@]}" output_dir="$dir" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local last=$(tail -n 1 "$dir/metrics.jsonl" 2>/dev/null | cut -c1-220)
  printf '%-14s rc=%-3s %3ss  %s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "${last:-$(tail -n 1 "$OUT/$name.log" | cut -c1-220)}" | tee -a "$OUT/summary.txt"
}
run fsdp fsdp "$gpus" train.parallel=fsdp train.max_steps=20
run fsdp_resume fsdp "$gpus" train.parallel=fsdp train.max_steps=30 "checkpoint.allow_changed=[train.max_steps]"
grep -ih "resum" "$OUT/fsdp_resume.log" | head -2 | cut -c1-200 | tee -a "$OUT/summary.txt"
run split split "$gpus" train.placement=split train.target_ranks=$(( gpus / 2 )) train.max_steps=20
run ddp ddp "$gpus" train.parallel=ddp train.max_steps=20
