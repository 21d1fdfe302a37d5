#!/usr/bin/env python3
"""Checks deploy/grafana/r2ccl-dashboard.json: valid JSON, the instance and device template
variables, a query in every panel, only metric families that monitor/README.md documents, and
(when promtool is installed) that every query parses as PromQL.

usage: check_dashboard.py DASHBOARD.json
"""

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "monitor" / "README.md"


def fail(msg: str) -> None:
    print(f"check_dashboard: {msg}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    if len(sys.argv) != 2:
        fail("usage: check_dashboard.py DASHBOARD.json")
    path = Path(sys.argv[1])
    try:
        dash = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path}: {e}")

    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    for name in ("instance", "device"):
        if name not in variables:
            fail(f"no template variable '{name}'")

    documented = set(re.findall(r"`(r2ccl_[a-z0-9_]+)", README.read_text()))
    exprs = []
    for p in dash.get("panels", []):
        if p.get("type") == "row":
            continue
        targets = [t.get("expr", "") for t in p.get("targets", [])]
        if not targets or not all(targets):
            fail(f"panel '{p.get('title')}' has no query")
        for e in targets:
            names = set(re.findall(r"\b(r2ccl_[a-z0-9_]+)", e))
            if not names:
                fail(f"panel '{p.get('title')}': '{e}' uses no r2ccl_ family")
            unknown = names - documented
            if unknown:
                fail(f"panel '{p.get('title')}': {sorted(unknown)} not documented in {README}")
            exprs.append(e)
    families = {n for e in exprs for n in re.findall(r"\b(r2ccl_(?:nic|rail)_[a-z0-9_]+)", e)}
    if not any(f.startswith("r2ccl_nic_") for f in families) or not any(
            f.startswith("r2ccl_rail_") for f in families):
        fail("the dashboard needs both r2ccl_nic_* and r2ccl_rail_* panels")

    promtool = shutil.which("promtool")
    if promtool is None:
        print("check_dashboard: promtool not found; PromQL syntax not checked")
        return
    # Each query as a recording rule, Grafana's variables replaced by values, through promtool.
    rules = {"groups": [{"name": "dashboard", "rules": []}]}
    for i, e in enumerate(exprs):
        q = e.replace("$__rate_interval", "1m").replace("$instance", ".*").replace("$device", ".*")
        rules["groups"][0]["rules"].append({"record": f"dashboard_query_{i}", "expr": q})
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        json.dump(rules, f)  # JSON is YAML
        f.flush()
        r = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True,
                           timeout=60, check=False)
    if r.returncode != 0:
        fail(f"promtool rejects a query:\n{r.stdout}{r.stderr}")
    print(f"check_dashboard: {len(exprs)} queries in {len(dash['panels'])} panels OK")


if __name__ == "__main__":
    main()
