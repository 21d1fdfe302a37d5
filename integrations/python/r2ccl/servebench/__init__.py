"""r2ccl-servebench: serving latency (TTFT, TPOT, ITL, end-to-end) and goodput under SLOs, with
NIC faults applied from outside while the load runs. `python -m r2ccl.servebench --help`.

Engine mode sends its workload (Poisson arrivals, or a Mooncake-format trace) to a serving
engine's OpenAI-compatible completions API and measures from the client's side, reading
r2ccl's Prometheus counters from the engine's processes before and after."""
