"""Continuous batching as vLLM's V1 scheduler does it: each step first gives every running
request its next tokens (one for a decoding request, the next chunk for one still in prefill),
then admits waiting requests first come, first served, while the step's token budget and the
batch's request limit allow; a prompt longer than what is left of the budget is split across
steps (chunked prefill).

Roles: "both" prefills and decodes (a request's first token comes at the end of its prefill);
"prefill" only prefills, and hands each request on when its prefill is done (its KV cache then
goes to a decode instance); "decode" takes requests whose KV cache has arrived: their first step
computes one token and samples the first output token, as a decode instance does after loading
the prompt's KV cache."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .workload import Request


@dataclass
class Seq:
    req: Request
    computed: int = 0  # tokens whose KV is in the cache (prompt and output)
    generated: int = 0
    token_s: list[float] = field(default_factory=list)

    @property
    def prompt_left(self) -> int:
        return max(self.req.input_len - self.computed, 0)


@dataclass
class Step:
    """What one step computes: (sequence, new tokens) pairs."""
    work: list[tuple[Seq, int]]

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.work)

    @property
    def context(self) -> int:
        """Tokens attended to: each sequence's cache plus its new tokens."""
        return sum(s.computed + n for s, n in self.work)

    def samples(self, role: str) -> list[Seq]:
        """The sequences that sample a token at the end of this step."""
        if role == "prefill":
            return []
        return [s for s, n in self.work if s.computed + n >= s.req.input_len]

    def prefills_done(self) -> list[Seq]:
        return [s for s, n in self.work if s.computed < s.req.input_len <= s.computed + n]


class Scheduler:
    def __init__(self, role: str, max_batch_tokens: int, max_seqs: int):
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role '{role}' is not both, prefill or decode")
        if max_batch_tokens < 1 or max_seqs < 1:
            raise ValueError("the token budget and the request limit must be positive")
        self.role, self.budget, self.max_seqs = role, max_batch_tokens, max_seqs
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.finished: list[Seq] = []

    def add(self, req: Request) -> Seq:
        """A new request; for a decode instance, one whose prompt's KV cache has arrived."""
        s = Seq(req)
        if self.role == "decode":
            s.computed = req.input_len - 1  # the last prompt token is computed here
        self.waiting.append(s)
        return s

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def plan(self) -> Step:
        work: list[tuple[Seq, int]] = []
        left = self.budget
        for s in self.running:
            if left == 0:
                break
            n = min(s.prompt_left, left) if s.prompt_left else 1
            work.append((s, n))
            left -= n
        while self.waiting and left > 0 and len(self.running) < self.max_seqs:
            s = self.waiting.popleft()
            self.running.append(s)
            n = min(s.prompt_left, left) if s.prompt_left else 1
            work.append((s, n))
            left -= n
        return Step(work)

    def complete(self, step: Step, t_end: float) -> list[Seq]:
        """Marks the step done at `t_end`: sequences that sampled get a token; returns the
        sequences that left (finished, or for a prefill instance, prefilled)."""
        sampled = {id(s) for s in step.samples(self.role)}
        left: list[Seq] = []
        for s, n in step.work:
            prefill_done = s.computed < s.req.input_len <= s.computed + n
            s.computed += n
            if id(s) in sampled:
                s.generated += 1
                s.token_s.append(t_end)
            if (self.role == "prefill" and prefill_done) or s.generated >= s.req.output_len:
                left.append(s)
        if left:
            gone = {id(s) for s in left}
            self.running = [s for s in self.running if id(s) not in gone]
            self.finished.extend(left)
        return left
