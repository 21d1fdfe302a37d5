#!/usr/bin/python3
"""bench/soak.py: a long verified all-reduce job on a busy machine, with real faults, counting
failovers of rails that no fault touched.

    bench/soak.py BUILD_DIR [--minutes M] [--no-load]       (root; /usr/bin/python3)

The netns testbed of 4 hosts x 4 NICs, every link shaped to 100 Mbit/s; four r2ccl-perf ranks
(one per host) run verified all-reduces (-c 1): 64 KiB for the first half of the run, 16 MiB for
the second.  Host 1 loses eth3 and eth4 (`ip link set down`) twice in each half, for a quarter of
it each time, then gets them back.  Unless --no-load, `stress-ng --cpu 2` keeps both cores busy
for the whole run, beside the job.

Passes (exit 0) when every rank exits 0, rank 0 reports every byte of every round verified, each
fault was detected on host 1's rails, and no rail that the faults did not touch (a rail between
two hosts other than 1, or host 1's eth1/eth2) ever failed.  Prints a Markdown summary: rounds,
faults, failovers of faulted rails, failovers of the others (with their reasons).
Exit status: 0 PASS, 1 FAIL, 2 usage, 77 no testbed here.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "system"))

FAULTED_HOST = 1
FAULTED_NICS = ("eth3", "eth4")
HOSTS, NICS = 4, 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", help="build directory (its bin/ has r2ccl-perf)")
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the run (default 10)")
    ap.add_argument("--no-load", action="store_true", help="without stress-ng beside the job")
    a = ap.parse_args()
    if a.minutes < 2:
        print("soak: --minutes must be at least 2", file=sys.stderr)
        return 2
    os.environ["R2CCL_TEST_BIN"] = str(Path(a.build).resolve() / "bin")
    import r2ccl_testbed as t  # after R2CCL_TEST_BIN is set

    if os.geteuid() != 0:
        print("soak: needs root (network namespaces)", file=sys.stderr)
        return 77
    if not a.no_load and shutil.which("stress-ng") is None:
        print("soak: stress-ng is not installed (apt-get install stress-ng), or pass --no-load",
              file=sys.stderr)
        return 2

    total = a.minutes * 60.0
    half = total / 2
    # Down for a quarter of each half, twice per half: at 1/8 and 5/8 of each half.
    faults = []
    for phase in (0.0, half):
        for start in (half / 8, half * 5 / 8):
            faults.append((phase + start, phase + start + half / 4))
    work = Path(tempfile.mkdtemp(prefix="r2ccl-soak-"))
    ev = str(work / "ev")
    args = ["allreduce", "-b", "64K", "-e", "16M", "-f", "256", "-w", "0", "-c", "1",
            "--duration", f"{half:g}", "--events", ev]
    with t.Testbed(hosts=HOSTS, nics=NICS, rate="100mbit") as tb:
        boot = f"{tb.mgmt_addr(0)}:{t.random_port()}"
        procs = t.perf_ranks(HOSTS, boot, args, hosts=list(range(HOSTS)))
        for down, up in faults:
            for nic in FAULTED_NICS:
                for action, when in (("down", down), ("up", up)):
                    procs.append(t.Proc(argv=[str(t.TESTBED), action, tb.name, str(FAULTED_HOST),
                                              nic], delay=when, name=f"{action} {nic} @{when:.0f}s"))
        if not a.no_load:
            procs.append(t.Proc(argv=["stress-ng", "--cpu", "2", "--timeout", f"{total + 60:.0f}s",
                                      "--quiet"], name="stress-ng --cpu 2"))
        res = t.launch_ranks(procs, testbed=tb, timeout=total + 180)
    ok = True
    problems = []
    if [r.returncode for r in res[:HOSTS]] != [0] * HOSTS:
        ok = False
        problems.append("a rank failed:\n" + t.describe(res[:HOSTS]))
    if t.CHECK_LINE not in res[0].stdout:
        ok = False
        problems.append("rank 0 did not report every byte verified")
    for r in res[HOSTS:]:
        if r.returncode != 0 and not r.name.startswith("stress-ng"):
            ok = False
            problems.append(f"{r.name} failed: {r.stderr.strip()}")

    faulted_fail, other_fail, readmitted = [], [], 0
    for rank in range(HOSTS):
        with open(f"{ev}.rank{rank}") as f:
            for line in f:
                e = json.loads(line)
                if e["kind"] == "readmitted":
                    readmitted += 1
                if e["kind"] != "failed":
                    continue
                touched = e["nic"] in FAULTED_NICS and FAULTED_HOST in (rank, e["peer"])
                (faulted_fail if touched else other_fail).append((rank, e))
    if not faulted_fail:
        ok = False
        problems.append("no fault was detected")
    if other_fail:
        ok = False
        problems.append("rails no fault touched failed over")

    rows = [line for line in res[0].stdout.splitlines() if line.strip() and line[0] != "#"]
    print(f"## soak: {a.minutes:g} min, 4 hosts x 4 NICs at 100 Mbit/s, "
          f"{'stress-ng --cpu 2 beside the job' if not a.no_load else 'no competing load'}\n")
    print("```")
    print("\n".join(rows[-4:]))
    print("```\n")
    print("| faults (host 1, eth3+eth4 down) | failed events, faulted rails | failed events, "
          "untouched rails | re-admissions | every byte verified |")
    print("|---:|---:|---:|---:|---|")
    print(f"| {len(faults)} | {len(faulted_fail)} | {len(other_fail)} | {readmitted} | "
          f"{'yes' if t.CHECK_LINE in res[0].stdout else 'NO'} |\n")
    for rank, e in other_fail:
        print(f"- untouched rail failed: rank {rank} -> peer {e['peer']} on {e['nic']}: "
              f"{e['detail']}")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    print("PASS" if ok else "FAIL")
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"soak: events kept in {work}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
