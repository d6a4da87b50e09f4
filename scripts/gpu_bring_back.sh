#!/usr/bin/env bash
# Bring back to this call's $OUT what a detached GPU job wrote under DIR, within what one device call
# returns (8 files of at most 16 MiB, 64 MiB together): the small results every call (status.json,
# summary.json, table.txt), then the files not yet brought back, oldest first (regenerated rows,
# export parts, logs), each once per version (its name, size and modification time are kept in
# DIR/.brought-back; regenerated rows only once regen-rows.complete says they are whole). Call it after each wait (scripts/gpu_detached.sh); what did not fit comes next time.
#
# Usage: scripts/gpu_bring_back.sh DIR   (with $OUT set, as on the device machine)
set -u
dir=${1:?the job\'s output folder}; out=${OUT:?OUT is not set}
sent=$dir/.brought-back; touch "$sent"
files=0 bytes=0 max_files=8 max_bytes=$((64 * 1024 * 1024)) max_file=$((16 * 1024 * 1024))
take() {  # take FILE [always]: copy it to $OUT if it fits what is left of this call
  local f=$1 size id
  size=$(stat -c %s "$f"); id="$(basename "$f") $size $(stat -c %Y "$f")"
  [ "${2:-}" = always ] || ! grep -qxF "$id" "$sent" || return 0
  if [ "$size" -gt "$max_file" ]; then echo "too large to bring back: $f ($size bytes)"; return 0; fi
  if [ $((files + 1)) -gt $max_files ] || [ $((bytes + size)) -gt $max_bytes ]; then
    echo "next call: $(basename "$f")"; return 0
  fi
  cp "$f" "$out/" && files=$((files + 1)) bytes=$((bytes + size)) && echo "$id" >> "$sent"
}
for f in status.json summary.json table.txt; do [ -f "$dir/$f" ] && take "$dir/$f" always; done
while IFS= read -r f; do
  case $(basename "$f") in regen-rows.part*) [ -f "$dir/regen-rows.complete" ] || continue ;; esac  # still being written
  take "$f"
done < <(
  find "$dir" -maxdepth 1 -type f ! -name '.*' ! -name '*.stamp' ! -name '*.complete' \
    ! -name status.json ! -name summary.json ! -name table.txt -printf '%T@ %p\n' | sort -n | cut -d' ' -f2-)
echo "brought back $files files, $bytes bytes"
