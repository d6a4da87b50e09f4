#!/usr/bin/env bash
# A long GPU job that outlives one device call: started detached (its own process session) the first
# time, then each call waits for it up to WAIT_S seconds and reports where it is. A lent machine runs
# one command at most 10 minutes but stays warm ~30 s between calls and keeps /tmp, so a pipeline of
# 20+ minutes (synth -> regen -> train -> eval, scripts/gpu_data_scale.py) runs as one process across
# back-to-back calls of this script, with no stage restarted or model reloaded between calls.
#
# Usage: scripts/gpu_detached.sh NAME WAIT_S CMD...   (later calls: scripts/gpu_detached.sh NAME WAIT_S)
# State in $DETACHED_DIR (default /tmp/detached)/NAME.{pid,log,rc}; the log is copied to $OUT/NAME.log
# after each wait. The job holds none of this call's output streams, so piping a call (`... | tail`)
# returns when the call does, not when the job ends.
# A later call that gives a command waits for the job if it is the same command (a rerun of the call
# that started it: never started twice), and is refused if it is another one: a new command needs a
# new NAME (the old job's state stays readable).
# Exit code: 0 when the job finished with 0, 3 while it still runs, the job's own code when it failed,
# 4 when it ended without one (killed), 2 when NAME was never started and no command is given, or
# was started with another command.
set -u
name=$1 wait_s=$2; shift 2
dir=${DETACHED_DIR:-/tmp/detached}; mkdir -p "$dir"
pid_file=$dir/$name.pid log=$dir/$name.log rc_file=$dir/$name.rc cmd_file=$dir/$name.cmd
alive() { [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; }
if [ -f "$pid_file" ] && [ $# -gt 0 ] && [ "$(cat "$cmd_file" 2>/dev/null)" != "$*" ]; then
  echo "$name: already started with another command ($(cat "$cmd_file" 2>/dev/null)); not run: $*"
  echo "$name: give the new command another NAME (this one's state is in $dir/$name.*)"; exit 2
fi
if [ ! -f "$pid_file" ]; then
  [ $# -gt 0 ] || { echo "$name: not started and no command given"; exit 2; }
  printf '%s' "$*" >"$cmd_file"
  # setsid: the job is not killed when this call's command returns
  setsid bash -c 'log=$0 rc=$1; shift; "$@" >"$log" 2>&1; echo $? >"$rc"' "$log" "$rc_file" "$@" \
    </dev/null >/dev/null 2>&1 &
  echo $! >"$pid_file"
  echo "$name: started (pid $(cat "$pid_file")): $*"
fi
deadline=$(( $(date +%s) + wait_s ))
while alive && [ ! -f "$rc_file" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
[ -n "${OUT:-}" ] && cp "$log" "$OUT/$name.log" 2>/dev/null
tail -n 25 "$log" 2>/dev/null
if [ -f "$rc_file" ]; then
  rc=$(cat "$rc_file"); echo "$name: finished, exit $rc"; exit "$rc"
fi
if ! alive; then
  echo "$name: ended without an exit code (killed by a signal, or the machine was restarted)"; exit 4
fi
echo "$name: still running"; exit 3
