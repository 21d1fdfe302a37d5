#!/usr/bin/python3
"""bench/adaptive.py: degraded mode adapting on its own, and what it costs when nothing is wrong.

    bench/adaptive.py BUILD_DIR [--rate 25mbit] [--duration 70] [--quick]   (root; /usr/bin/python3)

The netns testbed of 4 hosts x 4 NICs, every NIC shaped to --rate (link-bound), one r2ccl-perf
rank per host, int32 sum all-reduces with every byte checked on every rank (-c 1). Four checks,
each baseline measured in the same run as what it is compared with:

1. Lost NICs mid-run: a 16 MiB all-reduce runs for --duration seconds with the automatic choice;
   at a third of it host 1 loses eth3 and eth4. The rounds after the fault (the first two after
   it left out) against those before: at least 0.70 of the healthy rate (the lower bound allows
   0.75, a ring 0.5), and the plan after it is a degraded one.
2. A slow host: host 1's four NICs shaped to half the rate (nothing is down). The automatic
   choice must pick the weighted plan and be within 10% of the weighted plan forced.
3. No per-call tax: a healthy 1 MiB all-reduce with degraded mode on (its agreement once, then
   only a generation count in each call) against R2CCL_DEGRADED_ALGO=off, alternated, the best
   of two each: within 5%.
4. Registration: a 16 MiB all-reduce on buffers registered once (r2ccl-perf --register) against
   unregistered ones (the communicator's registration cache): within 5%.

Prints a Markdown table per check and PASS or FAIL. Exit status: 0 PASS, 1 FAIL, 2 usage,
77 no testbed here.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "system"))

HOSTS, NICS = 4, 4
FAULTED_HOST = 1
DEGRADED_PLANS = ("weighted", "r2cc", "balance")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", help="build directory (its bin/ has r2ccl-perf)")
    ap.add_argument("--rate", default="25mbit", help="every NIC's rate (default 25mbit)")
    ap.add_argument("--duration", type=float, default=70.0,
                    help="seconds of the mid-run fault job (default 70)")
    ap.add_argument("--quick", action="store_true", help="checks 3 and 4 only")
    a = ap.parse_args()
    os.environ["R2CCL_TEST_BIN"] = str((Path(a.build) / "bin").resolve())
    import r2ccl_testbed as t  # after R2CCL_TEST_BIN is set

    if os.geteuid() != 0:
        print("adaptive: needs root (network namespaces)", file=sys.stderr)
        return 77
    work = Path(tempfile.mkdtemp(prefix="r2ccl-adaptive-"))
    problems = []
    out = []

    def job(tb, tag, args, env=None, faults=(), timeout=600):
        rep, res, wrong = t.perf_job(tb, HOSTS, ["allreduce", "-d", "int32", "-c", "1", *args],
                                     str(work / f"{tag}.json"), extra_env=env, faults=faults,
                                     timeout=timeout)
        if wrong:
            problems.append(f"{tag}: {wrong}")
        return rep, res

    def timed(rep):
        return rep["results"][-1]["time_us"] * 1e-6, rep["results"][-1]["algo"]

    if not a.quick:
        # 1. NICs lost mid-run.
        with t.Testbed(hosts=HOSTS, nics=NICS, rate=a.rate) as tb:
            at = a.duration / 3
            faults = [t.Proc(argv=[str(t.TESTBED), "down", tb.name, str(FAULTED_HOST), f"eth{k}"],
                             delay=at, name=f"down eth{k}") for k in (3, 4)]
            launched = time.time()
            rep, res = job(tb, "midrun", ["-b", "16M", "-e", "16M", "-w", "1", "--duration",
                                          str(a.duration)], faults=faults)
            if rep is not None:
                # The fault's wall time: launch_ranks starts every process at its delay.
                fault_wall = launched + at
                rounds = rep.get("rounds", [])
                before = [r for r in rounds[1:] if r["wall_s"] + r["seconds"] < fault_wall]
                after_all = [r for r in rounds if r["wall_s"] > fault_wall]
                after = after_all[2:]
                if len(before) < 3 or len(after) < 3:
                    problems.append(f"mid-run: too few rounds ({len(before)} before the fault, "
                                    f"{len(after)} after it); raise --duration")
                else:
                    healthy = statistics.median(r["seconds"] for r in before)
                    degraded = statistics.median(r["seconds"] for r in after)
                    ratio = healthy / degraded
                    plans_after = sorted({r["algo"] for r in after})
                    agreements = (rep.get("agreed") or {}).get("agreements")
                    out.append("### 1. Host 1 loses eth3 and eth4 mid-run (16 MiB, automatic "
                               "choice)\n")
                    out.append("| phase | rounds | median s | plan | rate vs healthy |")
                    out.append("|---|---:|---:|---|---:|")
                    out.append(f"| healthy | {len(before)} | {healthy:.3f} | "
                               f"{','.join(sorted({r['algo'] for r in before}))} | 1.000 |")
                    out.append(f"| 2 of 4 NICs down on host 1 | {len(after)} | {degraded:.3f} | "
                               f"{','.join(plans_after)} | {ratio:.3f} |")
                    out.append(f"\nagreements: {agreements} (the first call, then the change); "
                               f"lower bound 0.75, ring 0.50\n")
                    if ratio < 0.70:
                        problems.append(f"mid-run: {ratio:.3f} of the healthy rate, under 0.70")
                    if not set(plans_after) <= {"weighted", "r2cc"}:
                        problems.append(f"mid-run: the plan after the fault was {plans_after}")

        # 2. A host slow on every NIC.
        with t.Testbed(hosts=HOSTS, nics=NICS, rate=a.rate) as tb:
            rate = int("".join(c for c in a.rate if c.isdigit()))
            unit = "".join(c for c in a.rate if not c.isdigit())
            for k in range(1, NICS + 1):
                tb.tb("degrade", str(FAULTED_HOST), f"eth{k}", f"{rate // 2}{unit}")
            times = {}
            for plan in ("weighted", "auto", "balance"):
                rep, _ = job(tb, f"shaped-{plan}", ["-b", "16M", "-e", "16M", "-w", "1", "-n", "4"],
                             env={"R2CCL_ALGO": plan})
                if rep is not None:
                    times[plan] = timed(rep)
            out.append("### 2. Host 1 with every NIC at half rate (16 MiB)\n")
            out.append("| plan | s | plan run | vs weighted forced |")
            out.append("|---|---:|---|---:|")
            for plan, (s, algo) in times.items():
                ref = times.get("weighted", (s, ""))[0]
                out.append(f"| {plan} | {s:.3f} | {algo} | {s / ref:.3f} |")
            out.append("")
            if "auto" in times and "weighted" in times:
                s, algo = times["auto"]
                if algo != "weighted":
                    problems.append(f"shaped host: the automatic choice ran {algo}, not weighted")
                if s > 1.10 * times["weighted"][0]:
                    problems.append(f"shaped host: auto {s:.3f} s, weighted forced "
                                    f"{times['weighted'][0]:.3f} s")

    # 3 and 4 on a healthy testbed.
    with t.Testbed(hosts=HOSTS, nics=NICS, rate=a.rate) as tb:
        runs = {"on": [], "off": [], "registered": [], "unregistered": []}
        for _ in range(2):
            for name, env in (("on", {}), ("off", {"R2CCL_DEGRADED_ALGO": "off"})):
                rep, _ = job(tb, f"tax-{name}", ["-b", "1M", "-e", "1M", "-w", "2", "-n", "20"],
                             env=env)
                if rep is not None:
                    runs[name].append(timed(rep))
            for name, extra in (("registered", ["--register"]), ("unregistered", [])):
                rep, _ = job(tb, f"reg-{name}", ["-b", "16M", "-e", "16M", "-w", "1", "-n", "4",
                                                 *extra])
                if rep is not None:
                    runs[name].append(timed(rep))
        best = {k: min(v) for k, v in runs.items() if v}
        out.append("### 3, 4. Healthy: degraded mode's cost, and registration\n")
        out.append("| run | size | best of 2, s | plan | ratio |")
        out.append("|---|---|---:|---|---:|")
        for name, base, size in (("on", "off", "1 MiB"), ("off", "off", "1 MiB"),
                                 ("unregistered", "registered", "16 MiB"),
                                 ("registered", "registered", "16 MiB")):
            if name in best and base in best:
                s, algo = best[name]
                out.append(f"| {name} | {size} | {s:.4f} | {algo} | {s / best[base][0]:.3f} |")
        out.append("")
        for name, base in (("on", "off"), ("unregistered", "registered")):
            if name in best and base in best and best[name][0] > 1.05 * best[base][0]:
                problems.append(f"{name}: {best[name][0]:.4f} s against {base} "
                                f"{best[base][0]:.4f} s")

    print(f"## adaptive degraded mode on the testbed: {HOSTS} hosts x {NICS} NICs at {a.rate}, "
          f"int32 sum, every byte checked\n")
    print("\n".join(out))
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    print("PASS" if not problems else "FAIL")
    print(f"adaptive: outputs in {work}", file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
