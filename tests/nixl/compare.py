"""NIXL under rail faults, r2ccl's backend beside NIXL's UCX backend, on the same testbed.

    UCX_MODULES=^ib VENV/bin/python tests/nixl/compare.py [--transfers 400] [--deadline 60]

For each backend and each case (healthy; host 0's eth2 down, black-holed or flapped while it
carries data) the stream of tests/nixl/nixl_peer.py runs once: 1 MiB READs and WRITEs with
notifications, 8 in flight, two hosts x four NICs at 100 Mbit/s. UCX runs over TCP on the same
four NICs (UCX_TLS=tcp, UCX_NET_DEVICES=eth1,...,eth4). Prints one Markdown row per run: how many
transfers completed, the time, and how the run ended (ok; an error; no progress until the
deadline, told apart by whether anything moved in its last 15 s). Root (network namespaces); the environment of `scripts/run vllm-test`.
"""

import argparse
import sys
import time
from pathlib import Path
import tempfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_nixl_faults import NICS, RATE, SLACK_S, start  # noqa: E402
from r2ccl_testbed import TESTBED, BusyTrigger, Testbed  # noqa: E402

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": ",".join(NICS), "UCX_MODULES": "^ib"}


def faults(tb):
    return {
        "healthy": None,
        "eth2 down": ["ip", "-n", tb.ns(0), "link", "set", "eth2", "down"],
        "eth2 black-holed": [str(TESTBED), "blackhole", tb.name, "0", "eth2"],
        "eth2 flapped": [str(TESTBED), "flap", tb.name, "0", "eth2", "300", "3000"],
    }


def run(backend, case, transfers, deadline):
    with Testbed(hosts=2, nics=4, rate=RATE) as tb, tempfile.TemporaryDirectory() as d:
        fault = faults(tb)[case]
        env = UCX_ENV if backend == "UCX" else None
        procs = start(tb, Path(d), transfers, backend=backend, env=env,
                      init_args=["--deadline", str(deadline)],
                      target_args=["--deadline", str(deadline + 20)])
        t0 = time.monotonic()
        try:
            while procs[1].progress() < (8 << 20) and procs[1].proc.poll() is None and \
                    time.monotonic() - t0 < SLACK_S:
                time.sleep(0.05)
            if fault:
                trig = BusyTrigger(tb.ns(0), "eth2", fault, delay=0.0, max_wait=3.0).start()
                trig.finish(timeout=40)
            # Progress sampled every second: a run that moved nothing for its last 15 s stalled.
            samples = []
            rc = None
            while time.monotonic() - t0 < deadline + SLACK_S:
                rc = procs[1].proc.poll()
                if rc is not None:
                    break
                samples.append((time.monotonic(), procs[1].progress()))
                time.sleep(1.0)
            took = time.monotonic() - t0
            recent = [b for t, b in samples if t > samples[-1][0] - 15] if samples else []
            stalled = len(recent) > 1 and recent[-1] == recent[0]
        finally:
            for p in procs:
                p.kill()
        done = procs[1].progress() >> 20
        text = procs[1].text()
        if rc == 0:
            outcome = "every transfer done, every byte and notification checked"
        elif (rc == 3 or rc is None) and stalled:
            outcome = f"stalled: nothing moved in the last 15 s before the deadline ({deadline} s)"
        elif rc == 3 or rc is None:
            outcome = f"still moving at the deadline ({deadline} s)"
        else:
            err = next((ln for ln in text.splitlines() if ln.startswith("error ")), f"rc={rc}")
            outcome = err[:120]
        return f"| {backend} | {case} | {done if rc != 0 else transfers} of {transfers} | " \
               f"{took:.1f} s | {outcome} |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transfers", type=int, default=400)
    ap.add_argument("--deadline", type=int, default=60)
    ap.add_argument("--backends", default="R2CCL,UCX")
    ap.add_argument("--cases", default="healthy,eth2 down,eth2 black-holed,eth2 flapped")
    args = ap.parse_args()
    print("| backend | case | transfers done | time | outcome |")
    print("|---|---|---|---|---|")
    for backend in args.backends.split(","):
        for case in args.cases.split(","):
            print(run(backend, case, args.transfers, args.deadline), flush=True)


if __name__ == "__main__":
    main()
