#!/usr/bin/python3
"""bench/kv_startup.py: do r2ccl-kvbench's rails survive start-up, when both ranks fill their
buffers at once (and, with --load, with both cores busy)?

    bench/kv_startup.py BUILD_DIR [--runs N] [--load]       (root; /usr/bin/python3)

The netns testbed of 2 hosts x 4 NICs at 100 Mbit/s; N runs (default 8) of r2ccl-kvbench
(16 verified push requests of 256-1024 tokens, 4 in flight), R2CCL_LOG=info so that every rail
failure is logged. With --load, `stress-ng --cpu 2` runs beside each run. A rail declared dead by
silence or stall ("no probe reply", "stalled", "black hole"), or by a link event, in a run where
no fault is injected is a false failover. Closures when a rank exits at the end (peer reset or
closed, broken pipe) are not counted.

Prints one line per run and the total; exit 0 when every run succeeded with no false failover.
"""
import argparse
import os
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "system"))
FALSE_FAILOVER = re.compile(r"no probe reply|stalled|black hole|link down")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", help="build directory (its bin/ has r2ccl-kvbench)")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--load", action="store_true", help="stress-ng --cpu 2 beside each run")
    a = ap.parse_args()
    if not 1 <= a.runs <= 100:
        print("kv_startup: --runs is 1 to 100", file=sys.stderr)
        return 2
    os.environ["R2CCL_TEST_BIN"] = str(Path(a.build).resolve() / "bin")
    import r2ccl_testbed as t  # after R2CCL_TEST_BIN is set

    if os.geteuid() != 0:
        print("kv_startup: needs root (network namespaces)", file=sys.stderr)
        return 77
    if a.load and shutil.which("stress-ng") is None:
        print("kv_startup: stress-ng is not installed (apt-get install stress-ng)", file=sys.stderr)
        return 2
    kvbench = t.BIN_DIR / "r2ccl-kvbench"
    args = ["--requests", "16", "--min-tokens", "256", "--max-tokens", "1024", "--concurrency", "4"]
    total, bad_runs = 0, 0
    with t.Testbed(hosts=2, nics=4, rate="100mbit") as tb:
        for i in range(a.runs):
            boot = f"{tb.mgmt_addr(0)}:{t.random_port()}"
            procs = [t.Proc(env=t.rank_env(r, 2, boot, R2CCL_LOG="info"), argv=[str(kvbench), *args],
                            host=r, name=f"kvbench rank {r}") for r in (0, 1)]
            if a.load:
                procs.append(t.Proc(argv=["stress-ng", "--cpu", "2", "--timeout", "90s", "--quiet"],
                                    name="stress-ng --cpu 2"))
            res = t.launch_ranks(procs, testbed=tb, timeout=240)
            false = [line for r in res[:2] for line in r.stderr.splitlines()
                     if FALSE_FAILOVER.search(line)]
            rcs = [r.returncode for r in res[:2]]
            total += len(false)
            bad_runs += rcs != [0, 0] or bool(false)
            print(f"run {i}: exit {rcs}, false failovers {len(false)}"
                  + "".join(f"\n  {line}" for line in false[:4]), flush=True)
    print(f"{a.runs} runs{' under stress-ng --cpu 2' if a.load else ''}: "
          f"{total} false failovers, {bad_runs} runs with a problem")
    return 0 if bad_runs == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
