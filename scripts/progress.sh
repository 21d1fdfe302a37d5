# shellcheck shell=bash
# Sourced by scripts/run and tests/vllm/setup-venv: long quiet steps say that they are alive.

# with_progress WHAT [--watch PATH] [--log FILE] CMD...: runs CMD (its output to FILE when
# given); every 30 s while it runs, prints to standard error that WHAT is still going, for how
# long, and how large PATH has grown (the download or build it fills). Returns CMD's status.
with_progress() {
  local what=$1 watch= log=
  shift
  while [[ ${1:-} == --watch || ${1:-} == --log ]]; do
    [[ $1 == --watch ]] && watch=$2
    [[ $1 == --log ]] && log=$2
    shift 2
  done
  local start=$SECONDS
  if [[ -n $log ]]; then
    "$@" >"$log" 2>&1 &
  else
    "$@" &
  fi
  local pid=$! rc=0
  while true; do
    local waited=0
    while ((waited < 30)) && kill -0 "$pid" 2>/dev/null; do
      sleep 1
      waited=$((waited + 1))
    done
    kill -0 "$pid" 2>/dev/null || break
    local t=$((SECONDS - start)) size=
    [[ -n $watch && -e $watch ]] && size=", $(du -sh "$watch" 2>/dev/null | cut -f1) in $watch"
    printf '%s: still %s (%dm%02ds%s)\n' "${progress_name:-${0##*/}}" "$what" $((t / 60)) $((t % 60)) "$size" >&2
  done
  wait "$pid" || rc=$?
  return "$rc"
}
