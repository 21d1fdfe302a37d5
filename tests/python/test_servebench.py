"""r2ccl-servebench's workload and figures (r2ccl.servebench.workload, .metrics): arrival
schedules, Mooncake trace lines and their errors, and TTFT / TPOT / ITL / E2EL / goodput
computed on request timelines whose answers are known, as `vllm bench serve` defines them."""

import json
import math

import pytest

from r2ccl.servebench import metrics, workload
from r2ccl.servebench.client import parse_fault, prompt_ids
from r2ccl.servebench.metrics import Result


def test_poisson_schedule_has_the_rate_and_lengths_asked_for():
    reqs = workload.poisson(400, 8.0, (16, 64), (5, 5), seed=3)
    assert [r.index for r in reqs] == list(range(400))
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and times[0] > 0
    assert times[-1] == pytest.approx(400 / 8.0)  # scaled so, as vLLM's benchmark does
    assert all(16 <= r.input_len <= 64 for r in reqs)
    assert {r.output_len for r in reqs} == {5}
    assert len({r.input_len for r in reqs}) > 10
    # Same seed, same schedule; another seed, another.
    assert workload.poisson(400, 8.0, (16, 64), (5, 5), seed=3) == reqs
    assert workload.poisson(400, 8.0, (16, 64), (5, 5), seed=4) != reqs


def test_burstier_arrivals_have_more_spread_gaps():
    def cv(reqs):
        t = [0.0] + [r.arrival_s for r in reqs]
        gaps = [b - a for a, b in zip(t, t[1:])]
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    poisson = cv(workload.poisson(2000, 10.0, (1, 1), (1, 1), 1.0, seed=1))
    bursty = cv(workload.poisson(2000, 10.0, (1, 1), (1, 1), 0.25, seed=1))
    assert 0.9 < poisson < 1.1  # exponential gaps: coefficient of variation 1
    assert bursty > 1.7  # gamma of shape 0.25: 2


@pytest.mark.parametrize("args, message", [
    ((0, 1.0, (1, 1), (1, 1)), "the number of requests must be positive, not 0"),
    ((5, 0.0, (1, 1), (1, 1)), "the request rate must be a positive finite number, not 0.0"),
    ((5, math.inf, (1, 1), (1, 1)), "the request rate must be a positive finite number, not inf"),
    ((5, 1.0, (0, 4), (1, 1)), "input length range 0-4 is not within 1-1048576"),
    ((5, 1.0, (1, 1), (9, 3)), "output length range 9-3 is not within 1-1048576"),
])
def test_bad_workloads_are_refused_naming_what_is_wrong(args, message):
    with pytest.raises(ValueError) as e:
        workload.poisson(*args)
    assert str(e.value) == message


def test_a_mooncake_trace_is_read_relative_to_its_first_request(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2]},
            {"timestamp": 30535, "input_length": 300, "output_length": 9},
            {"timestamp": 27482, "input_length": 10, "output_length": 700}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = workload.mooncake_trace(path, time_scale=0.5, max_input=4096, max_output=512)
    assert [(r.index, r.arrival_s, r.input_len, r.output_len) for r in reqs] == [
        (0, 0.0, 4096, 52), (1, 0.0, 10, 512), (2, pytest.approx(1.5265), 300, 9)]
    assert len(workload.mooncake_trace(path, limit=2)) == 2


@pytest.mark.parametrize("line, message", [
    ("{oops", "line 1: not JSON"),
    ("[1, 2]", "line 1: not a JSON object"),
    ('{"timestamp": 1, "output_length": 3}', "line 1: 'input_length' is missing or not a number"),
    ('{"timestamp": 1, "input_length": true, "output_length": 3}',
     "line 1: 'input_length' is missing or not a number"),
    ('{"timestamp": -5, "input_length": 2, "output_length": 3}', "line 1: 'timestamp' is -5"),
    ('{"timestamp": 1, "input_length": 2.5, "output_length": 3}', "line 1: 'input_length' is 2.5"),
    ('{"timestamp": 1, "input_length": 2, "output_length": 99999999}',
     "line 1: 'output_length' is 99999999, out of range"),
])
def test_bad_trace_lines_are_refused_naming_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError) as e:
        workload.mooncake_trace(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_an_empty_trace_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        workload.mooncake_trace(path)


def timeline(index, sent, chunks, tokens, error=""):
    return Result(index, sent, 100, list(chunks), tokens, error)


def test_latencies_are_vllms_definitions():
    a = timeline(0, 1.0, [1.2, 1.3, 1.5, 1.6], 4)  # TTFT 0.2, E2EL 0.6, TPOT 0.4/3
    b = timeline(1, 2.0, [2.5], 1)  # one token: TPOT 0, no gap
    c = timeline(2, 3.0, [3.1, 3.3], 2)  # TTFT 0.1, E2EL 0.3, TPOT 0.2
    assert a.ttft() == pytest.approx(0.2) and a.e2el() == pytest.approx(0.6)
    assert a.tpot() == pytest.approx(0.4 / 3) and b.tpot() == 0.0
    assert a.itls() == pytest.approx([0.1, 0.2, 0.1])
    s = metrics.summarize([a, b, c], 4.0, percentiles=(50, 100))
    assert (s["requests"], s["completed"], s["failed"]) == (3, 3, 0)
    assert s["output_tokens"] == 7 and s["input_tokens"] == 300
    assert s["request_throughput"] == 0.75 and s["output_throughput"] == 1.75
    assert s["p50_ttft_ms"] == pytest.approx(200.0) and s["p100_ttft_ms"] == pytest.approx(500)
    assert s["mean_ttft_ms"] == pytest.approx(800 / 3, abs=1e-3)
    # TPOT over the requests of more than one token; ITL over every gap of every request.
    assert s["mean_tpot_ms"] == pytest.approx((400 / 3 + 200) / 2, abs=1e-3)
    assert s["p50_itl_ms"] == pytest.approx(150.0)
    assert s["mean_itl_ms"] == pytest.approx(150.0)
    assert s["p50_e2el_ms"] == pytest.approx(500.0)


def test_goodput_counts_requests_that_met_every_slo_and_failures_are_named():
    fast = timeline(0, 0.0, [0.1, 0.2], 2)
    slow_first = timeline(1, 0.0, [0.9, 1.0], 2)
    slow_tokens = timeline(2, 0.0, [0.1, 0.9], 2)
    failed = timeline(3, 0.0, [], 0, "HTTP 500: boom")
    silent = timeline(4, 0.0, [], 0)
    slos = metrics.parse_slos("ttft:500 tpot:300")
    assert slos == {"ttft": 0.5, "tpot": 0.3}
    s = metrics.summarize([fast, slow_first, slow_tokens, failed, silent], 2.0, slos=slos)
    assert s["good_requests"] == 1 and s["goodput"] == 0.5
    assert s["failed"] == 2
    assert s["errors"] == {"HTTP 500: boom": 1, "no token streamed": 1}


@pytest.mark.parametrize("text, message", [
    ("ttft500", "SLO 'ttft500': expected KEY:MILLISECONDS with KEY one of ttft, tpot, e2el"),
    ("itl:5", "SLO 'itl:5': expected KEY:MILLISECONDS with KEY one of ttft, tpot, e2el"),
    ("ttft:fast", "SLO 'ttft:fast': 'fast' is not a number of milliseconds"),
    ("tpot:0", "SLO 'tpot:0': the bound must be positive"),
])
def test_bad_slos_are_refused_naming_them(text, message):
    with pytest.raises(ValueError) as e:
        metrics.parse_slos(text)
    assert str(e.value) == message


def test_percentiles_interpolate_as_numpy_does():
    v = [1.0, 2.0, 3.0, 4.0]
    assert metrics.percentile(v, 50) == 2.5
    assert metrics.percentile(v, 90) == pytest.approx(3.7)
    assert metrics.percentile([7.0], 99) == 7.0
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError, match="percentile 101 is not within 0-100"):
        metrics.percentile(v, 101)


def test_faults_and_prompts():
    f = parse_fault("120.5:ip -n h0 link set eth1 down")
    assert (f.at_s, f.command) == (120.5, "ip -n h0 link set eth1 down")
    for bad in ("now:ip link", "-1:ip link", "12:", "12"):
        with pytest.raises(ValueError, match="expected SECONDS:COMMAND"):
            parse_fault(bad)
    req = workload.Request(3, 0.0, 50, 4)
    ids = prompt_ids(req, 7, (10, 999))
    assert len(ids) == 50 and all(10 <= i <= 999 for i in ids)
    assert prompt_ids(req, 7, (10, 999)) == ids  # the same prompt for the same seed and index
    assert prompt_ids(workload.Request(4, 0.0, 50, 4), 7, (10, 999)) != ids


# ---- standalone mode: the scheduler, the model, and two ranks over loopback

from r2ccl.servebench import model as sbmodel  # noqa: E402
from r2ccl.servebench.scheduler import Scheduler  # noqa: E402
from r2ccl.servebench.workload import Request  # noqa: E402


def run_to_end(sched, reqs, limit=1000):
    """Steps at times 1, 2, 3...; every request added before the first step."""
    for q in reqs:
        sched.add(q)
    steps = []
    for t in range(1, limit):
        if sched.idle:
            break
        step = sched.plan()
        steps.append([(s.req.index, n) for s, n in step.work])
        sched.complete(step, float(t))
    return steps


def test_continuous_batching_chunks_prefills_and_decodes_first():
    sched = Scheduler("both", max_batch_tokens=8, max_seqs=4)
    reqs = [Request(0, 0.0, 10, 3), Request(1, 0.0, 3, 2)]
    steps = run_to_end(sched, reqs)
    # Request 0's prompt of 10 takes the whole first step and 2 of the second; request 1's
    # prompt of 3 fits beside it; then both decode one token a step.
    assert steps[0] == [(0, 8)]
    assert steps[1] == [(0, 2), (1, 3)]
    assert steps[2] == [(0, 1), (1, 1)]
    assert steps[3] == [(0, 1)]
    assert len(steps) == 4
    by = {s.req.index: s for s in sched.finished}
    # The first token comes with the end of the prefill; one more per decode step.
    assert by[0].token_s == [2.0, 3.0, 4.0]
    assert by[1].token_s == [2.0, 3.0]


def test_the_request_limit_holds_and_waiting_requests_go_first_come_first_served():
    sched = Scheduler("both", max_batch_tokens=100, max_seqs=2)
    steps = run_to_end(sched, [Request(i, 0.0, 4, 2) for i in range(3)])
    assert [i for i, _ in steps[0]] == [0, 1]
    assert [i for i, _ in steps[2]] == [2]


def test_prefill_and_decode_instances():
    p = Scheduler("prefill", max_batch_tokens=16, max_seqs=8)
    p.add(Request(0, 0.0, 20, 5))
    first = p.plan()
    assert p.complete(first, 1.0) == [] and first.samples("prefill") == []
    second = p.plan()
    assert [s.req.index for s in second.prefills_done()] == [0]
    left = p.complete(second, 2.0)
    assert [s.req.index for s in left] == [0] and p.idle and left[0].token_s == []
    d = Scheduler("decode", max_batch_tokens=16, max_seqs=8)
    steps = run_to_end(d, [Request(0, 0.0, 20, 3)])
    assert steps == [[(0, 1)], [(0, 1)], [(0, 1)]]  # the last prompt token, then decodes
    assert d.finished[0].token_s == [1.0, 2.0, 3.0]


def test_model_presets_deployments_and_compute():
    m = sbmodel.model_from("llama-3.1-8b", {})
    assert (m.layers, m.hidden, m.kv_heads, m.dtype_bytes) == (32, 4096, 8, 2)
    # About 8 billion parameters: 32 layers and the embedding and head.
    total = m.layers * m.layer_params() + 2 * m.vocab * m.hidden
    assert 7.9e9 < total < 8.1e9
    dep = sbmodel.Deployment(tp=2, pp=2, prefill=1, decode=1)
    dep.check(m)
    assert dep.world == 8 and dep.place(5) == (1, 0, 1) and dep.rank_of(1, 0, 1) == 5
    assert [dep.role(i) for i in range(2)] == ["prefill", "decode"]
    assert sbmodel.kv_shard_bytes(m, dep, 10) == 10 * 2 * 4 * 128 * 2
    c = sbmodel.step_comm_bytes(m, sbmodel.Deployment(tp=2), 3, 1)
    assert c["all_reduce"] == 3 * 4096 * 2 * 65 and c["all_gather"] == 128256 // 2 * 2
    r = sbmodel.Roofline("h100", m, sbmodel.Deployment(tp=2))
    # Decode reads the layer's half of the weights; a long prefill is bound by FLOPs.
    assert r.layer_s(1, 0) == pytest.approx(m.layer_params() / 2 * 2 / (3.35e12 * 0.7))
    assert r.layer_s(4096, 0) == pytest.approx(2 * m.layer_params() / 2 * 4096 / (989e12 * 0.5))
    assert r.layer_s(0, 0) == 0.0


@pytest.mark.parametrize("call, message", [
    (lambda: sbmodel.model_from("llama-9", {}), "model 'llama-9' is not one of"),
    (lambda: sbmodel.model_from("custom", {"layers": 2}), "a custom model needs --hidden"),
    (lambda: sbmodel.model_from("llama-3.1-8b", {"kv_heads": 5}), "32 heads do not group into 5"),
    (lambda: sbmodel.Deployment(tp=3).check(sbmodel.PRESETS["llama-3.1-8b"]),
     "TP 3 does not divide the 8 KV heads"),
    (lambda: sbmodel.Deployment(pp=3).check(sbmodel.PRESETS["llama-3.1-8b"]),
     "PP 3 does not divide the 32 layers"),
    (lambda: sbmodel.Deployment(prefill=1).check(sbmodel.PRESETS["llama-3.1-8b"]),
     "disaggregation needs both"),
    (lambda: sbmodel.compute_from("roofline:tpu", sbmodel.PRESETS["llama-3.1-8b"],
                                  sbmodel.Deployment()), "GPU 'tpu' is not one of"),
    (lambda: sbmodel.compute_from("abacus", sbmodel.PRESETS["llama-3.1-8b"],
                                  sbmodel.Deployment()), "expected roofline:GPU, table:FILE"),
])
def test_bad_models_and_deployments_are_refused_naming_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        call()


def test_a_step_time_table_interpolates(tmp_path):
    f = tmp_path / "steps.csv"
    f.write_text("tokens,ms\n1,10\n101,30\n")
    m = sbmodel.PRESETS["llama-3.1-8b"]
    t = sbmodel.compute_from(f"table:{f}", m, sbmodel.Deployment())
    assert t.layer_s(51, 0) * m.layers == pytest.approx(0.020)
    assert t.layer_s(201, 0) * m.layers == pytest.approx(0.050)
    f.write_text("tokens,ms\n1,x\n")
    with pytest.raises(ValueError, match="line 2: expected tokens,ms"):
        sbmodel.compute_from(f"table:{f}", m, sbmodel.Deployment())


def test_a_standalone_runs_report_counts_failures_and_the_communication_share(tmp_path):
    from r2ccl.servebench import report

    base = {"instance": 0, "stage": 0, "tp_index": 0, "backend": "r2ccl", "leader": True,
            "model": {"name": "llama-3.1-8b"}, "deployment": {"tp": 2}, "compute": "x",
            "comm": {"all_reduce": {"calls": 2, "bytes": 100, "seconds": 0.5}}, "kv_bytes": 0}
    rank0 = dict(base, rank=0, role="both", errors=[], requests_total=3, duration_s=10.0,
                 steps=[[0.0, 1.0, 10, 0.25], [1.0, 2.0, 2, 0.75]],
                 requests=[
                     {"index": 0, "arrival_s": 0.0, "input_len": 8, "output_len": 3,
                      "token_s": [1.0, 1.5, 2.0], "error": ""},
                     {"index": 1, "arrival_s": 0.5, "input_len": 8, "output_len": 3,
                      "token_s": [1.0], "error": "not finished within the drain time"},
                     {"index": 2, "arrival_s": 0.5, "input_len": 8, "output_len": 1,
                      "token_s": [1.5], "error": ""}])
    rank1 = dict(base, rank=1, role="both", errors=[], leader=False, steps=[[0.0, 2.0, 10, 1.0]])
    for r in (rank0, rank1):
        (tmp_path / f"rank{r['rank']}.json").write_text(json.dumps(r))
    (tmp_path / "faults.jsonl").write_text(json.dumps({"at_s": 1.2, "command": "x", "rc": 0}) + "\n")
    s = report.summarize(report.load(tmp_path))
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"not finished within the drain time": 1}
    assert s["p50_ttft_ms"] == pytest.approx(1000.0)  # 1.0 s and 1.0 s
    assert s["comm_share"]["both"]["share"] == pytest.approx(2.0 / 4.0)
    assert s["comm_share"]["both"]["mean_step_share"] == pytest.approx((0.25 + 0.75 + 0.5) / 3)
    assert s["comm"]["all_reduce"] == {"calls": 4, "bytes": 200, "seconds": 1.0}
    assert s["faults"][0]["at_s"] == 1.2
    assert "| run | 2/3 | 1 | 1000.0 |" in report.table([("run", s)])
    with pytest.raises(ValueError, match="no rank.*json"):
        report.load(tmp_path / "nothing")


def test_standalone_refuses_bad_launch_arguments_by_name(tmp_path, capsys):
    from r2ccl.servebench.__main__ import main

    out = str(tmp_path / "out")
    assert main(["standalone", "--rank", "0", "--out", out]) == 2
    assert "--rank and --world go together" in capsys.readouterr().err
    assert main(["standalone", "--rank", "0", "--world", "1", "--master", "nohost", "--out",
                 out]) == 2
    assert "--master 'nohost' is not HOST:PORT" in capsys.readouterr().err
    assert main(["standalone", "--rank", "3", "--world", "2", "--master", "127.0.0.1:1",
                 "--out", out]) == 2
    assert "rank 3 is not within a world of 2" in capsys.readouterr().err
    assert main(["standalone", "--rank", "0", "--world", "1", "--fault", "soon:ls",
                 "--out", out]) == 2
    assert "fault 'soon:ls': expected SECONDS:COMMAND" in capsys.readouterr().err
