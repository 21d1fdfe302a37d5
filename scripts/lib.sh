# shellcheck shell=bash disable=SC2154  # testbed, cmd0, cmd1 and the rest come from the caller
# Shared by scripts/demo.sh and bench/rails.sh (sourced, not run).
# The caller sets: TB_NAME (testbed name), RANK_TIMEOUT (s), testbed (path of the tool), and
# NAME (prefix of messages).

# r2_init TAG: a scratch directory in $work, removed on exit together with the testbed.
r2_init() {
  work=$(mktemp -d "/tmp/r2ccl-$1.XXXXXX")
  # One random token for the job's ranks (they are on the testbed's non-loopback addresses).
  R2CCL_BOOTSTRAP_TOKEN=${R2CCL_BOOTSTRAP_TOKEN:-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')}
  export R2CCL_BOOTSTRAP_TOKEN
  created=
  trap r2_cleanup EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

r2_cleanup() {
  [[ -z ${created:-} ]] || "$testbed" destroy "$TB_NAME" >/dev/null 2>&1 || true
  rm -rf "$work"
}

# r2_create_testbed ARGS...: `testbed create $TB_NAME ARGS...`, destroyed on exit.
r2_create_testbed() {
  "$testbed" create "$TB_NAME" "$@"
  created=1
}

# r2_run_pair TAG: runs the commands in the arrays cmd0 (rank 0) and cmd1 (rank 1) at once,
# each under a hard time limit; output in $work/TAG.{0,1}.{out,err}. Returns 1, after printing
# both ranks' output, unless both exit 0.
r2_run_pair() {
  local tag=$1 pid0 pid1 rc0=0 rc1=0 r
  timeout -k 5 "$RANK_TIMEOUT" "${cmd0[@]}" >"$work/$tag.0.out" 2>"$work/$tag.0.err" &
  pid0=$!
  timeout -k 5 "$RANK_TIMEOUT" "${cmd1[@]}" >"$work/$tag.1.out" 2>"$work/$tag.1.err" &
  pid1=$!
  wait "$pid0" || rc0=$?
  wait "$pid1" || rc1=$?
  ((rc0 == 0 && rc1 == 0)) && return 0
  echo "$NAME: $tag run FAILED (rank 0 exit $rc0, rank 1 exit $rc1; 124 = killed after ${RANK_TIMEOUT}s)" >&2
  for r in 0 1; do
    echo "--- rank $r output:" >&2
    cat "$work/$tag.$r.out" "$work/$tag.$r.err" >&2
  done
  return 1
}

# r2_free_port: a TCP port in 29500..29599 nothing listens on.
r2_free_port() {
  local p
  for ((p = 29500; p < 29600; p++)); do
    [[ -z $(ss -Htln "sport = :$p" 2>/dev/null) ]] && { echo "$p"; return 0; }
  done
  echo "$NAME: no free TCP port in 29500..29599" >&2
  return 1
}

# r2_require_testbed: exits 77 (skipped), saying why, unless a netns testbed can be made here.
r2_require_testbed() {
  if [[ $EUID -ne 0 ]]; then
    echo "$NAME: needs root for the netns testbed; skipped" >&2
    exit 77
  fi
  local why
  if ! why=$("$testbed" check 2>&1 >/dev/null); then
    echo "$NAME: no testbed here (${why#testbed: }); skipped" >&2
    exit 77
  fi
}
