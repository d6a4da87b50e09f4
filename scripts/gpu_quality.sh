#!/usr/bin/env bash
# The quality runs of docs/quality.md on one H200: train several drafters for a real small target side
# by side on one GPU, then measure exact-mode tau on the held-out sets (DFlash vs n-gram vs DDTree).
#
#   scripts/gpu_quality.sh TARGET_DIR DATA_DIR [TRAIN_SECONDS]
#
# DATA_DIR holds regen.jsonl.gz (the target's own replies to synthesized prompts, from
# scripts/gpu_synth_regen.py) and heldout_synth.jsonl (synthesized prompts never regenerated nor
# trained on). evalsets/handwritten.jsonl is the second held-out set. Every run trains under a time
# cap: at TRAIN_SECONDS it gets SIGTERM, saves at the step boundary, and is exported from that
# checkpoint, so one device call always ends with every drafter evaluated. Logs and eval.json of each
# run go to $OUT (or ./gpu-logs); the table is printed last.
set -u
target=${1:?target dir}; data=${2:?data dir}; train_s=${3:-300}
final=${OUT:-gpu-logs}; mkdir -p "$final"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
work=/tmp/quality; OUT=$work/logs; mkdir -p "$OUT"  # bundled into $final/quality.tgz at the end
zcat "$data/regen.jsonl.gz" > "$work/regen-all.jsonl"
head -n 2000 "$work/regen-all.jsonl" > "$work/regen-2k.jsonl"
wc -l "$work"/*.jsonl "$data/heldout_synth.jsonl" evalsets/handwritten.jsonl | tee "$OUT/data.txt"

# name | data | extra overrides
# max_steps is set so the cosine schedule ends inside the time cap when the runs share the GPU.
runs=(
  "ce|regen-all|train.loss=ce train.max_steps=${STEPS:-1000} eval.prompts=[$data/heldout_synth.jsonl,evalsets/handwritten.jsonl] eval.every_steps=${EVAL_EVERY:-250} eval.num_prompts=64 eval.batch_size=128"
  "ce+kl|regen-all|train.loss=ce+kl train.max_steps=${STEPS:-1000}"
  "ce-2k|regen-2k|train.loss=ce train.max_steps=${STEPS:-1000}"
)
t0=$(date +%s)
for spec in "${runs[@]}"; do
  IFS='|' read -r name rows extra <<<"$spec"
  # shellcheck disable=SC2086
  timeout -s TERM -k 60 "$train_s" python3 -m dflash_train.cli train smollm2-135m \
    target.path="$target" data.paths="[$work/$rows.jsonl]" output_dir="$work/run-$name" \
    data.cache_dir="$work/cache-$name" train.num_epochs=8 $extra --json >"$OUT/train-$name.log" 2>&1 &
done
wait
echo "training done in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/data.txt"

evaluate() {  # evaluate NAME EXTRA_FLAGS...
  local name=$1; shift
  local run="$work/run-$name" export="$work/run-$name/export"
  if [ ! -f "$export/config.json" ]; then  # stopped by the time cap: export the newest checkpoint
    python3 -m dflash_train.cli export "$run" "$export" >>"$OUT/train-$name.log" 2>&1
  fi
  python3 -m dflash_train.cli eval --target "$target" --drafter "$export" \
    --prompts "$data/heldout_synth.jsonl" evalsets/handwritten.jsonl --max-new-tokens 512 \
    --baseline ngram --batch-size 128 --no-progress --output-dir "$OUT/eval-$name" "$@" --json \
    >"$OUT/eval-$name.log" 2>&1
  cp "$run/metrics.jsonl" "$OUT/metrics-$name.jsonl" 2>/dev/null
}
t0=$(date +%s)
evaluate ce --ddtree-budget 32 &
for name in ce+kl ce-2k; do evaluate "$name" & done
# The bf16 lossless verdict: real decoding of one prompt per file next to the exact mode.
python3 -m dflash_train.cli eval --target "$target" --drafter "$work/run-ce/export" \
  --prompts "$data/heldout_synth.jsonl" evalsets/handwritten.jsonl --num-prompts 1 --max-new-tokens 256 \
  --baseline ngram --decode-prompts 1 --no-progress --json >"$OUT/decode-ce.log" 2>&1 &
wait
echo "evals done in $(( $(date +%s) - t0 )) s (three side by side)" | tee -a "$OUT/data.txt"
python3 - "$OUT" <<'EOF'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':10} {'steps':>6} {'train_tau':>9} | {'file':24} {'tau':>6} {'ngram':>6} {'ddtree':>6} {'ratio':>6}")
for log in sorted(out.glob("eval-*.log")):
    if log.suffix != ".log":
        continue
    name = log.stem[5:]
    train_log = (out / f"train-{name}.log").read_text(errors="replace")
    steps = re.findall(r"step (\d+)/\d+", train_log)
    taus = re.findall(r"tau ([0-9.]+)", train_log)
    try:
        report = json.loads(log.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"{name:10} eval failed: {log.read_text()[-300:]!r}")
        continue
    print(f"{name:10} timings {report.get('timings')}")
    for r in report.get("per_file") or []:
        file, tau, ng = r["file"], r.get("tau"), r.get("ngram_tau")
        ratio = tau / ng if tau and ng else float("nan")
        print(f"{name:10} {steps[-1] if steps else '-':>6} {taus[-1] if taus else '-':>9} | {Path(file).name[:24]:24} "
              f"{tau or float('nan'):6.3f} {ng or float('nan'):6.3f} {r.get('ddtree_tau') or float('nan'):6.3f} {ratio:6.2f}")
EOF
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
log = Path(sys.argv[1]) / "decode-ce.log"
try:
    report = json.loads(log.read_text().strip().splitlines()[-1])
    keys = ("lossless", "lossless_up_to_ties", "divergences", "tokens_per_s", "baseline_tokens_per_s", "speedup")
    print("decode ce:", json.dumps({k: report.get(k) for k in keys})[:1500])
except (OSError, ValueError, IndexError):
    print("decode ce failed:", log.read_text()[-500:] if log.exists() else "no log")
EOF
tar czf "$final/quality.tgz" -C "$work" logs && ls -la "$final"
