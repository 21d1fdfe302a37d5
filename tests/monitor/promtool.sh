#!/usr/bin/env bash
# Runs promtool with the given arguments; exits 77 (ctest: skipped) when it is not installed.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1; then
  echo "promtool not found (Debian package 'prometheus'; scripts/run installs it): skipping" >&2
  exit 77
fi
exec promtool "$@"
