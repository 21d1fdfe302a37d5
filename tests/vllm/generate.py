"""One vLLM run for tests/vllm/run.py: a tiny model, tensor parallel size 2 on the mp backend,
greedy decoding; prints the generated token ids, the two most likely tokens at each step with
their log-probabilities (and r2ccl's rail metrics) as one JSON line.
With --nnodes 2 this process is the head node (TP rank 0); the other node runs vLLM's headless
workers (`vllm serve ... --headless --node-rank 1`).

usage: generate.py MODEL_DIR --mode eager|compiled --dtype bfloat16|float32
                   [--nnodes N --master-addr A --master-port P]
                   [--calls N] [--marker FILE --marker-after K]
                   [--metrics-port P --metrics-addrs A0,A1]

Call times are wall-clock (time.time()), comparable with the driver's. With --marker, FILE is
written once K calls have returned, so that a driver outside the vLLM
processes can inject a fault while the remaining calls run. Which communicator the TP group
uses is decided by the environment (R2CCL_VLLM=1: r2ccl's plugin; unset: vLLM's own)."""

import argparse
import json
import pathlib
import random
import re
import sys
import time
import urllib.request

PROMPTS_PER_CALL = 4
TOKENS = 32
# The scheduler's limits, the same on the worker node (run.py passes them to worker.py): each
# node sizes its warm-up batches from its own configuration.
BATCHED_TOKENS = 2048
SEQS = 64


def prompts(call: int) -> list[str]:
    rng = random.Random(call)
    return [" ".join(f"w{rng.randrange(4, 2000)}" for _ in range(rng.randrange(3, 24))) for _ in range(PROMPTS_PER_CALL)]


def rail_metrics(port: int, addrs: list[str]) -> dict:
    """r2ccl's rail counters of every rank (rank r at addrs[r], port + r), summed by name (and
    how many series each has)."""
    out = {}
    for r, addr in enumerate(addrs):
        try:
            with urllib.request.urlopen(f"http://{addr}:{port + r}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError as e:
            out[f"rank{r}_error"] = str(e)
            continue
        for name in ("r2ccl_rail_failovers_total", "r2ccl_rail_up", "r2ccl_rail_replayed_bytes_total",
                     "r2ccl_rail_tx_bytes_total"):
            values = [float(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
            out[f"rank{r}_{name}"] = sum(values)
            out[f"rank{r}_{name}_series"] = len(values)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mode", choices=["eager", "compiled"], required=True)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], required=True)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--marker")
    ap.add_argument("--marker-after", type=int, default=2)
    ap.add_argument("--metrics-port", type=int)
    ap.add_argument("--metrics-addrs", default="127.0.0.1,127.0.0.1")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=29501)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        model=args.model,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        enforce_eager=args.mode == "eager",
        dtype=args.dtype,
        max_model_len=512,
        max_num_batched_tokens=BATCHED_TOKENS,
        max_num_seqs=SEQS,
        seed=0,
        nnodes=args.nnodes,
        node_rank=0,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    init_s = time.monotonic() - started
    # The two most likely tokens at each step, with their log-probabilities: the driver tells a
    # difference at a near tie (both runs' choices among the reference's top two, which are
    # within rounding of each other) from a wrong value.
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    tokens, top2, times = [], [], []
    for call in range(args.calls):
        t0 = time.time()
        outs = llm.generate(prompts(call), params, use_tqdm=False)
        times.append([t0, time.time()])
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        top2.append([[sorted(([tok, lp.logprob] for tok, lp in step.items()), key=lambda x: -x[1])[:2]
                      for step in o.outputs[0].logprobs] for o in outs])
        if args.marker and call + 1 == args.marker_after:
            pathlib.Path(args.marker).write_text(f"{time.time()}\n")
    result = {"init_s": init_s, "tokens": tokens, "top2": top2, "call_times": times}
    if args.metrics_port:
        result["metrics"] = rail_metrics(args.metrics_port, args.metrics_addrs.split(","))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
