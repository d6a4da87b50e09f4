#!/usr/bin/env bash
# A lease with the real SmolLM2 target, prepared here and assembled on the device: the parts that
# ../shared/tools/real-target.sh parts writes (.dev/gguf-a, .dev/gguf-b with the converter) and rows or other files arrive in calls of
# their own (at most 64 MiB travel per call; /tmp is kept while the machine stays warm), then the
# target is assembled and the working tree copied to a job folder that the next calls' fresh trees
# do not replace (docs/quality.md, "The next lease").
#
#   here, once:                   scripts/gpu_lease_setup.sh prepare      (everything below, into .dev/)
#   call 1, carry .dev/gguf-a:    scripts/gpu_lease_setup.sh part-a
#   call 2, carry DIR:            scripts/gpu_lease_setup.sh files DIR      (e.g. .dev/rows -> $TMP/rows)
#   calls 3-4 (a continuation):   files .dev/exp1, files .dev/exp2
#   call 5, carry .dev/gguf-b .whl [...]:
#                                 scripts/gpu_lease_setup.sh target && export PYTHONPATH=$TMP/site:$TMP/job
#                                 scripts/gpu_lease_setup.sh export DIR   (exp1 + exp2 -> the export DIR)
#                                 cd $TMP/job && scripts/gpu_detached.sh NAME WAIT_S CMD...
#
# prepare (on this machine, from the project root): the target's parts and the gguf wheel
# (../shared/tools), the shared held-out prompts, the 92,597 regenerated rows (.dev/rows, from the
# history: datasets/smollm2-135m-tasks/README.md) and a trained export kept in the history, by
# default the newest DFlash2 one (EXPORT=exports/smollm2-135m-dflash2-28k; its README's restore
# command names the commit and the parts), split into two halves that fit a call each (.dev/exp1/st.00,
# .dev/exp2/st.01 with config.json and SERVING.md); what is there is kept.
#
# target: the wheels in .whl/ into $TMP/site (if any), part a + part b -> $TMP/smol-src/model.gguf,
# the converter -> $TMP/smol (skipped when it is there: a second call is cheap), this tree without
# .dev/, .whl/, .venv/, .git/ and runs/ -> $TMP/job (replaced). TMP is $LEASE_TMP, default /tmp.
set -euo pipefail
tmp=${LEASE_TMP:-/tmp}
# where prepare finds the rows and the export (the READMEs name these commits) and the shared tools
rows_commit=${ROWS_COMMIT:-56d4946} export_dir=${EXPORT:-exports/smollm2-135m-dflash2-28k} half_bytes=46000000
case "${1:-}" in
  prepare)
    shared=${SHARED:-../shared}
    mkdir -p .dev
    [ -f .dev/gguf-b/part ] || "$shared/tools/real-target.sh" parts
    compgen -G ".whl/gguf-*.whl" >/dev/null || "$shared/tools/gpu-wheels.sh" gguf
    cp -n "$shared/data/smollm2-135m/heldout_synth.jsonl.gz" .dev/
    mkdir -p .dev/rows .dev/exp1 .dev/exp2
    for i in 00 01 02; do
      f=.dev/rows/regen-rows.part$i.jsonl.xz
      [ -s "$f" ] || git show "$rows_commit:datasets/smollm2-135m-tasks/${f##*/}" > "$f"
    done
    cp datasets/smollm2-135m-tasks/regen-rows.part03.jsonl.xz .dev/rows/
    # the export's README restores it: git show COMMIT:EXPORT/STEM.part$i.tar for its parts
    restore=$(grep -o "git show [0-9a-f]*:$export_dir/[^ ]*\.part\$i\.tar" "$export_dir/README.md" | head -1) || true
    [ -n "$restore" ] || { echo "$export_dir/README.md has no restore command (git show COMMIT:$export_dir/STEM.part\$i.tar)"; exit 1; }
    export_commit=${restore#git show }; export_commit=${export_commit%%:*}
    stem=${restore##*/}; stem=${stem%.part\$i.tar}
    e=.dev/$stem
    if [ ! -f "$e/model.safetensors" ]; then
      for i in 00 01 02 03 04 05; do git show "$export_commit:$export_dir/$stem.part$i.tar"; done | tar -x -C .dev
    fi
    head -c $half_bytes "$e/model.safetensors" > .dev/exp1/st.00
    tail -c +$((half_bytes + 1)) "$e/model.safetensors" > .dev/exp2/st.01
    cp "$e/config.json" "$e/SERVING.md" .dev/exp2/
    du -sh .dev/gguf-a .dev/gguf-b .dev/rows .dev/exp1 .dev/exp2 ;;
  export)
    dest=${2:?the export folder to write}
    mkdir -p "$dest" && cat "$tmp/exp1/st.00" "$tmp/exp2/st.01" > "$dest/model.safetensors"
    cp "$tmp/exp2/config.json" "$tmp/exp2/SERVING.md" "$dest/" && ls -la "$dest" ;;
  part-a)
    mkdir -p "$tmp/smol-src" && cp .dev/gguf-a/part "$tmp/smol-src/a.part"
    ls -la "$tmp/smol-src" ;;
  files)
    src=${2:?the carried folder}; dest=$tmp/$(basename "$src")
    mkdir -p "$dest" && cp -r "$src"/. "$dest"/ && ls -la "$dest" ;;
  target)
    [ -f "$tmp/smol-src/a.part" ] || { echo "no $tmp/smol-src/a.part: run 'part-a' in the call before (the machine must stay warm)"; exit 1; }
    if compgen -G ".whl/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target "$tmp/site" .whl/*.whl
    fi
    if [ ! -f "$tmp/smol/config.json" ]; then
      cat "$tmp/smol-src/a.part" .dev/gguf-b/part > "$tmp/smol-src/model.gguf"
      if ! PYTHONPATH="$tmp/site${PYTHONPATH:+:$PYTHONPATH}" \
        python3 .dev/gguf-b/real-target-convert.py "$tmp/smol-src" model.gguf "$tmp/smol"; then
        rm -rf "$tmp/smol"
        echo "the target's conversion failed; it needs the pure-Python gguf package, which the GPU machine lacks:"
        echo "../shared/tools/gpu-wheels.sh gguf puts its wheel in .whl/, carried in this call"
        exit 1
      fi
    fi
    rm -rf "$tmp/job" && mkdir -p "$tmp/job"
    # what a call's working copy carries, less the parts and wheels (and local environments and runs)
    tar --exclude=./.dev --exclude=./.whl --exclude=./.venv --exclude=./.git --exclude=./runs \
      --exclude=./.pytest_cache --exclude=./.ruff_cache -cf - . | tar -xf - -C "$tmp/job"
    echo "target $tmp/smol; job folder $tmp/job" ;;
  *) sed -n '2,25p' "$0"; exit 2 ;;
esac
