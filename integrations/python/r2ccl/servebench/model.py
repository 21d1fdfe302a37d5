"""What a serving engine's step costs: the model's shape, the deployment (TP and PP degrees,
prefill/decode disaggregation), the communication each step issues, and the compute time of a
step (a GPU roofline, a table of measured step times, or matmuls timed on this machine).

The communication is what vLLM issues for a dense decoder with tensor parallelism: one
all-reduce of tokens x hidden after the vocabulary-parallel embedding, two per layer (after the
attention's output projection and after the MLP's down projection), and an all-gather of the
sampled tokens' logits (vocab / TP per rank). Between pipeline stages the hidden states and the
residual travel, split across the TP ranks and all-gathered on the next stage (vLLM's
send_tensor_dict with its all_gather_group); the sampled token ids return to the first stage.
At the end of a prefill under disaggregation every layer's K and V of the prompt go from the
prefill instance's rank to the decode instance's rank of the same TP index and stage."""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2  # bf16

    def check(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            v = getattr(self, field)
            if not isinstance(v, int) or not 1 <= v <= 1 << 20:
                raise ValueError(f"model {self.name}: {field} {v} is not within 1-{1 << 20}")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"model {self.name}: dtype of {self.dtype_bytes} bytes (1, 2 or 4)")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: {self.heads} heads do not group into "
                             f"{self.kv_heads} KV heads")

    def layer_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = self.hidden * 2 * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return q + kv + o + mlp

    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer, all KV heads."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


PRESETS = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
}

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


def model_from(preset: str, overrides: dict[str, int | None], dtype: str = "bf16") -> ModelShape:
    """A preset with the fields given replaced (`preset` "custom" takes every field)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype '{dtype}' is not one of {', '.join(DTYPE_BYTES)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if preset == "custom":
        missing = [f for f in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")
                   if f not in given]
        if missing:
            raise ValueError(f"a custom model needs --{' --'.join(m.replace('_', '-') for m in missing)}")
        given.setdefault("head_dim", given["hidden"] // given["heads"])
        m = ModelShape("custom", dtype_bytes=DTYPE_BYTES[dtype], **given)
    else:
        if preset not in PRESETS:
            raise ValueError(f"model '{preset}' is not one of {', '.join(PRESETS)} or custom")
        m = replace(PRESETS[preset], dtype_bytes=DTYPE_BYTES[dtype], **given)
    m.check()
    return m


@dataclass(frozen=True)
class Deployment:
    tp: int = 1
    pp: int = 1
    prefill: int = 0  # prefill instances; 0 with decode 0: one instance does both
    decode: int = 0

    def check(self, model: ModelShape) -> None:
        if not (1 <= self.tp <= 64 and 1 <= self.pp <= 64):
            raise ValueError(f"TP {self.tp} and PP {self.pp} must be within 1-64")
        if (self.prefill == 0) != (self.decode == 0) or not (0 <= self.prefill <= 16
                                                             and 0 <= self.decode <= 16):
            raise ValueError("disaggregation needs both --prefill and --decode instances (1-16)")
        if model.kv_heads % self.tp and self.tp % model.kv_heads:
            raise ValueError(f"TP {self.tp} does not divide the {model.kv_heads} KV heads")
        if model.layers % self.pp:
            raise ValueError(f"PP {self.pp} does not divide the {model.layers} layers")

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def instances(self) -> int:
        return self.prefill + self.decode if self.disaggregated else 1

    @property
    def ranks_per_instance(self) -> int:
        return self.tp * self.pp

    @property
    def world(self) -> int:
        return self.instances * self.ranks_per_instance

    def role(self, instance: int) -> str:
        if not self.disaggregated:
            return "both"
        return "prefill" if instance < self.prefill else "decode"

    def place(self, rank: int) -> tuple[int, int, int]:
        """(instance, stage, TP index) of a global rank: instance-major, then stage, then TP."""
        instance, rest = divmod(rank, self.ranks_per_instance)
        stage, tp_index = divmod(rest, self.tp)
        return instance, stage, tp_index

    def rank_of(self, instance: int, stage: int, tp_index: int) -> int:
        return (instance * self.pp + stage) * self.tp + tp_index


def kv_shard_bytes(model: ModelShape, dep: Deployment, tokens: int) -> int:
    """One rank's K and V of `tokens` tokens in one layer (its KV heads; replicated heads when TP
    exceeds the KV heads)."""
    heads = max(model.kv_heads // dep.tp, 1)
    return tokens * 2 * heads * model.head_dim * model.dtype_bytes


# ---- compute time of a step

GPUS = {  # dense bf16 FLOP/s and HBM bytes/s, from the vendors' data sheets
    "h100": (989e12, 3.35e12),
    "h200": (989e12, 4.8e12),
    "a100": (312e12, 2.0e12),
    "l40s": (362e12, 0.864e12),
}
FLOP_EFFICIENCY = 0.5
BW_EFFICIENCY = 0.7


class Compute:
    """Seconds one stage of one instance spends computing a step, per layer and for the head."""

    def layer_s(self, tokens: int, context: int) -> float:
        raise NotImplementedError

    def head_s(self, sampled: int) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class Roofline(Compute):
    """Each layer takes the longer of reading its weights (1/TP of them) and its FLOPs
    (2 x parameters x tokens / TP), plus reading the attended context's KV cache; the head the
    same for the vocabulary projection of the sampled tokens. Efficiencies: 50% of peak FLOP/s,
    70% of HBM bandwidth. `scale` multiplies every time."""

    def __init__(self, gpu: str, model: ModelShape, dep: Deployment, scale: float = 1.0):
        if gpu not in GPUS:
            raise ValueError(f"GPU '{gpu}' is not one of {', '.join(GPUS)}")
        self.gpu, self.model, self.dep, self.scale = gpu, model, dep, scale
        flops, bw = GPUS[gpu]
        self.flops, self.bw = flops * FLOP_EFFICIENCY, bw * BW_EFFICIENCY

    def _matmul_s(self, params: int, tokens: int) -> float:
        tp = self.dep.tp
        return max(params * self.model.dtype_bytes / tp / self.bw,
                   2.0 * params * tokens / tp / self.flops)

    def layer_s(self, tokens: int, context: int) -> float:
        if tokens <= 0:
            return 0.0
        kv_read = context * self.model.kv_bytes_per_token_layer() / self.dep.tp / self.bw
        return self.scale * (self._matmul_s(self.model.layer_params(), tokens) + kv_read)

    def head_s(self, sampled: int) -> float:
        if sampled <= 0:
            return 0.0
        return self.scale * self._matmul_s(self.model.vocab * self.model.hidden, sampled)

    def describe(self) -> str:
        s = f", x{self.scale:g}" if self.scale != 1.0 else ""
        return f"roofline of one {self.gpu} per rank{s}"


class Table(Compute):
    """A step's time from a CSV of `tokens,ms` (a whole step of the whole model at that batch
    size in tokens, as measured on the target machine), linear between rows and beyond the last
    two; split evenly over the layers, the head included in the layers' share."""

    def __init__(self, path: str, model: ModelShape, dep: Deployment, scale: float = 1.0):
        rows = []
        with open(path, encoding="utf-8") as f:
            for n, row in enumerate(csv.reader(f), 1):
                if not row or row[0].strip().startswith("#") or row[0].strip() == "tokens":
                    continue
                try:
                    tokens, ms = int(row[0]), float(row[1])
                except (ValueError, IndexError):
                    raise ValueError(f"{path}, line {n}: expected tokens,ms") from None
                if tokens < 1 or not 0 <= ms < 1e6:
                    raise ValueError(f"{path}, line {n}: {tokens} tokens, {ms} ms out of range")
                rows.append((tokens, ms / 1e3))
        if len(rows) < 2:
            raise ValueError(f"{path}: a table needs at least two rows of tokens,ms")
        self.rows = sorted(rows)
        self.path, self.model, self.dep, self.scale = path, model, dep, scale

    def step_s(self, tokens: int) -> float:
        r = self.rows
        i = 1
        while i < len(r) - 1 and r[i][0] < tokens:
            i += 1
        (t0, s0), (t1, s1) = r[i - 1], r[i]
        return max(0.0, s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)) if t1 != t0 else s0

    def layer_s(self, tokens: int, context: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.scale * self.step_s(tokens) / self.model.layers

    def head_s(self, sampled: int) -> float:
        return 0.0

    def describe(self) -> str:
        return f"table {self.path}"


class Measured(Compute):
    """One layer's matmuls (1/TP of each, in torch on this machine's CPU, float32) timed at a few
    batch sizes and fitted as a + b x tokens; the head likewise at one and many tokens."""

    def __init__(self, model: ModelShape, dep: Deployment, scale: float = 1.0,
                 sizes: tuple[int, ...] = (1, 16, 64)):
        import torch

        tp = dep.tp
        h, q = model.hidden, model.heads * model.head_dim // tp
        kv = 2 * max(model.kv_heads // tp, 1) * model.head_dim
        inter = model.intermediate // tp
        weights = [torch.randn(h, q + kv), torch.randn(q, h), torch.randn(h, 2 * inter),
                   torch.randn(inter, h)]
        head = torch.randn(h, max(model.vocab // tp, 1))

        def timed(ws, tokens: int) -> float:
            x = [torch.randn(tokens, w.shape[0]) for w in ws]
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for xi, w in zip(x, ws):
                    xi @ w
                best = min(best, time.perf_counter() - t)
            return best

        pts = [(n, timed(weights, n)) for n in sizes]
        self.a, self.b = _fit(pts)
        self.ha, self.hb = _fit([(n, timed([head], n)) for n in (1, max(sizes))])
        self.scale = scale

    def layer_s(self, tokens: int, context: int) -> float:
        return self.scale * (self.a + self.b * tokens) if tokens > 0 else 0.0

    def head_s(self, sampled: int) -> float:
        return self.scale * (self.ha + self.hb * sampled) if sampled > 0 else 0.0

    def describe(self) -> str:
        return (f"measured here: {1e3 * self.a:.3f} ms + {1e6 * self.b:.2f} us/token per layer")


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / var if var else 0.0
    return max(my - b * mx, 0.0), max(b, 0.0)


def compute_from(spec: str, model: ModelShape, dep: Deployment, scale: float = 1.0) -> Compute:
    """--compute: "roofline:GPU", "table:FILE" or "measure"."""
    kind, _, arg = spec.partition(":")
    if not scale > 0:
        raise ValueError(f"the compute scale must be positive, not {scale}")
    if kind == "roofline":
        return Roofline(arg or "h100", model, dep, scale)
    if kind == "table":
        if not arg:
            raise ValueError("--compute table:FILE needs a file")
        return Table(arg, model, dep, scale)
    if kind == "measure":
        return Measured(model, dep, scale)
    raise ValueError(f"--compute '{spec}': expected roofline:GPU, table:FILE or measure")


# ---- communication volume

def step_comm_bytes(model: ModelShape, dep: Deployment, tokens: int, sampled: int) -> dict:
    """Bytes each rank hands to each kind of call in one step of one stage (the payload, not
    what the algorithm puts on the wire)."""
    act = tokens * model.hidden * model.dtype_bytes
    out = {}
    if dep.tp > 1:
        out["all_reduce"] = act * (2 * model.layers // dep.pp + 1)
        out["all_gather"] = sampled * (model.vocab // dep.tp) * model.dtype_bytes
    if dep.pp > 1:
        out["pp_send"] = 2 * act // dep.tp
    return out
