#!/usr/bin/python3
"""Fails a test run in which a test was skipped that this machine can run.

ctest reports a test that skipped (exit 77, GTEST_SKIP, "N skipped in") as skipped, which is
the truth, but CI would stay green with a suite that never ran. Each skipped test needs what its
label says; where this machine has it, the skip is a failure:

  system  the netns testbed (root, `ip netns`, veth, tc, nftables): `tests/testbed/testbed check`
  rdma    the Soft-RoCE guest: root, x86_64, qemu-system-x86_64 and a kernel with rdma_rxe
  gpu     an NVIDIA GPU (/dev/nvidia*): the CUDA kernels' tests
  other   a Debian system with what scripts/run installs (nothing else may skip there)

usage: tests/check_skips.py SOURCE_DIR BUILD_DIR JUNIT_XML [CTEST_ARGS...]
"""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def netns(source: Path) -> str | None:
    """None when the netns testbed can be made here, else why not."""
    r = subprocess.run([str(source / "tests" / "testbed" / "testbed"), "check"],
                       capture_output=True, text=True, timeout=120)
    return None if r.returncode == 0 else (r.stderr.strip() or r.stdout.strip() or "check failed")


def rdma(source: Path) -> str | None:
    """None when the Soft-RoCE guest can be booted here (what tests/rdma/rdma-vm needs)."""
    if os.geteuid() != 0:
        return "not root"
    if platform.machine() != "x86_64":
        return f"not x86_64 ({platform.machine()})"
    for prog in ("qemu-system-x86_64", "busybox", "cpio", "modprobe", "ib_write_bw"):
        if shutil.which(prog) is None:
            return f"{prog} is not installed"
    for dep in glob.glob("/lib/modules/*/modules.dep"):
        kver = Path(dep).parent.name
        if Path(f"/boot/vmlinuz-{kver}").exists() and "/rdma_rxe.ko" in Path(dep).read_text():
            return None
    return "no kernel in /boot with the rdma_rxe module"


def cuda_device(source: Path) -> str | None:
    """None when an NVIDIA GPU is visible here (the CUDA tests' `gpu` label)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return "no /dev/nvidia* device"
    if shutil.which("nvidia-smi") is None:
        return None
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return None if r.returncode == 0 and "GPU" in r.stdout else "nvidia-smi lists no GPU"


def debian(source: Path) -> str | None:
    return None if shutil.which("dpkg-query") else "not a Debian system (no dpkg)"


NEEDS = {"system": ("the netns testbed", netns), "rdma": ("the Soft-RoCE guest", rdma),
         "gpu": ("a CUDA device", cuda_device)}


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    source, build, junit = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    if not junit.exists():
        print(f"check_skips: {junit} was not written (ctest did not run)")
        return 1
    shown = subprocess.run(["ctest", "--show-only=json-v1", *sys.argv[4:]], cwd=build,
                           capture_output=True, text=True, timeout=300)
    labels = {}
    if shown.returncode == 0:
        for t in json.loads(shown.stdout).get("tests", []):
            for p in t.get("properties", []):
                if p.get("name") == "LABELS":
                    labels[t["name"]] = p.get("value", [])
    skipped = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is not None or case.get("status") == "notrun":
            out = case.findtext("system-out") or ""
            reason = next((l.strip() for l in out.splitlines() if "SKIP" in l.upper()), "")
            skipped.append((case.get("name"), reason))
    if not skipped:
        print("check_skips: no test was skipped")
        return 0
    verdicts: dict[str, str | None] = {}
    bad = 0
    for name, reason in skipped:
        need, probe = ("a Debian system", debian)
        # ctest's labels, else the name's first part (system.*, rdma.*).
        for label in labels.get(name, [name.split(".")[0]]):
            if label in NEEDS:
                need, probe = NEEDS[label]
        if need not in verdicts:
            verdicts[need] = probe(source)
        why_not = verdicts[need]
        if why_not is None:
            bad += 1
            print(f"check_skips: FAIL: {name} was skipped, but this machine has {need}: "
                  f"{reason or 'see its output above'}")
        else:
            print(f"check_skips: {name} skipped: this machine lacks {need} ({why_not})")
    if bad:
        print(f"check_skips: {bad} test(s) skipped that this machine can run")
        return 1
    print(f"check_skips: {len(skipped)} test(s) skipped, each for lack of what it needs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
