#!/usr/bin/env bash
# The device side of a lease with the real SmolLM2 target: the parts that ../shared/tools/real-target.sh
# parts writes (.dev/gguf-a, .dev/gguf-b with the converter) and rows or other files arrive in calls of
# their own (at most 64 MiB travel per call; /tmp is kept while the machine stays warm), then the
# target is assembled and the working tree copied to a job folder that the next calls' fresh trees
# do not replace (docs/quality.md, "The next lease").
#
#   call 1, carry .dev/gguf-a:    scripts/gpu_lease_setup.sh part-a
#   call 2, carry DIR:            scripts/gpu_lease_setup.sh files DIR      (e.g. .dev/rows -> $TMP/rows)
#   call 3, carry .dev/gguf-b .whl [...]:
#                                 scripts/gpu_lease_setup.sh target && export PYTHONPATH=$TMP/site:$TMP/job
#                                 cd $TMP/job && scripts/gpu_detached.sh NAME WAIT_S CMD...
#
# target: the wheels in .whl/ into $TMP/site (if any), part a + part b -> $TMP/smol-src/model.gguf,
# the converter -> $TMP/smol (skipped when it is there: a second call is cheap), this tree without
# .dev/, .whl/, .venv/, .git/ and runs/ -> $TMP/job (replaced). TMP is $LEASE_TMP, default /tmp.
set -euo pipefail
tmp=${LEASE_TMP:-/tmp}
case "${1:-}" in
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
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
