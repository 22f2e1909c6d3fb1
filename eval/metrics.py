"""Acceptance metrics of speculative decoding from per-request traces, and the report's sweep point; no model needed.

Conventions (the definitions of ``DESIGN.md``, "Evaluation"):

- A **verification step** is one target forward that checks a draft of k tokens. ``accepted[s]`` is how many
  of that step's draft tokens were accepted (0..k); ``emitted[s]`` is how many tokens the step appended: the
  accepted ones plus the residual or bonus token (``accepted + 1``), or fewer when the request stopped inside
  the step (EOS or ``max_new_tokens``). The prefill forward that yields the first token is not a verification
  step. Plain decoding is ``accepted = 0, emitted = 1`` at every step.
- **τ** (``pooled_tau``): emitted tokens per verification step, **bonus token included**, pooled over all
  steps of all requests (not a mean of per-request ratios). Plain decoding has τ = 1.
- **α_j** (``alpha``), j = 1..k: *conditional* α_j = #steps with accepted ≥ j / #steps with accepted ≥ j−1
  (the rate draft position j is accepted given positions 1..j−1 were); *unconditional* α_j = #steps with
  accepted ≥ j / #steps. Both count ``accepted``, so a step cut short by EOS still credits its accepted
  drafts. A zero denominator gives 0.0.
- **distinct-2** (``distinct2``): distinct bigrams / bigrams, bigrams taken inside each output and the set of
  distinct ones over all outputs. A looping target scores low, and its inflated acceptance should be read
  against this figure.
- **Mean acceptance length, vLLM's convention** (``engine_acceptance``): 1 + accepted / drafts over the steps that
  verified a draft, accepted counted before the output was cut (:class:`EngineCounts`); comparable with what vLLM
  and SGLang print, where τ is not.
- **Expected speedup** (``expected_speedup``): τ / (v + f·c), f = draft forwards per step (k for a chain, 1 for a
  block draft: its block, the context's write folded in), c and v both in plain decode steps (the whole step as the plain run
  measured it): c = mean wall time of one batched draft forward in decode steps over that of one plain decode step,
  v = (plain decode step − one-token forward + verify forward of k + 1 tokens) over the plain decode step, the two
  forwards probed apart from the speculative run at the plain run's batch sizes (:mod:`mtp_train.eval.timing`). With
  v = 1 this is the textbook τ / (1 + k·c), which holds where verifying k + 1 tokens costs one decode step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mtp_train.eval.report import DraftCost, EngineAcceptance, Group, SweepPoint

# Prompt tokens; long-context drafts are read at 4k and 8k (data/long's sizes fall one per bucket from 512 on).
LENGTH_BUCKETS = ((0, 127, "0-127"), (128, 511, "128-511"), (512, 1023, "512-1023"), (1024, 2047, "1024-2047"),
                  (2048, 4095, "2048-4095"), (4096, 8191, "4096-8191"), (8192, None, "8192+"))


@dataclass
class RequestTrace:
    """What one request did under speculative (or plain) decoding."""

    prompt_id: str
    category: str
    prompt_tokens: int
    accepted: list[int] = field(default_factory=list)  # per verification step: draft tokens accepted (0..k)
    emitted: list[int] = field(default_factory=list)  # per verification step: tokens appended (1..accepted+1)
    output: list[int] = field(default_factory=list)  # the generated token ids
    drafted: list[int] | None = None  # per verification step: draft tokens verified (None: not recorded)

    def __post_init__(self) -> None:
        if len(self.accepted) != len(self.emitted):
            raise ValueError(f"{self.prompt_id}: {len(self.accepted)} accepted counts but {len(self.emitted)} emitted")
        if self.drafted is not None and (len(self.drafted) != len(self.accepted)
                                         or any(a > d for a, d in zip(self.accepted, self.drafted))):
            raise ValueError(f"{self.prompt_id}: drafted counts {self.drafted} do not fit accepted {self.accepted}")
        for s, (a, e) in enumerate(zip(self.accepted, self.emitted)):
            if a < 0 or not 1 <= e <= a + 1:
                raise ValueError(f"{self.prompt_id}: step {s} accepted {a} and emitted {e}; "
                                 "need accepted >= 0 and 1 <= emitted <= accepted + 1")
        if self.prompt_tokens < 0:
            raise ValueError(f"{self.prompt_id}: prompt_tokens {self.prompt_tokens} < 0")

    @property
    def steps(self) -> int:
        return len(self.accepted)


def num_steps(traces: Iterable[RequestTrace]) -> int:
    """Verification steps over all traces."""
    return sum(t.steps for t in traces)


def pooled_tau(traces: Iterable[RequestTrace]) -> float:
    """Σ emitted / Σ verification steps over all traces (bonus token included; plain decoding = 1); 0.0 if no step."""
    traces = list(traces)
    steps = num_steps(traces)
    return sum(sum(t.emitted) for t in traces) / steps if steps else 0.0


def alpha(traces: Iterable[RequestTrace], k: int) -> tuple[list[float], list[float]]:
    """``(conditional, unconditional)`` acceptance rates for draft positions j = 1..k (lists of length k)."""
    if k < 0:
        raise ValueError(f"k must be >= 0 (got {k})")
    # at_least[j] = number of steps with accepted >= j, for j = 0..k
    at_least = [0] * (k + 1)
    for t in traces:
        for a in t.accepted:
            if a > k:
                raise ValueError(f"{t.prompt_id}: a step accepted {a} draft tokens, more than k = {k}")
            for j in range(a + 1):
                at_least[j] += 1
    steps = at_least[0]
    conditional = [at_least[j] / at_least[j - 1] if at_least[j - 1] else 0.0 for j in range(1, k + 1)]
    unconditional = [at_least[j] / steps if steps else 0.0 for j in range(1, k + 1)]
    return conditional, unconditional


@dataclass
class EngineCounts:
    """Acceptance as vLLM counts it (``../shared/EXPORT.md`` section 5), over the verification steps that verified
    at least one draft token: ``drafts`` such steps, ``draft_tokens`` verified in all, ``accepted`` draft tokens
    accepted (before a stop token or ``max_new_tokens`` cut the output), ``accepted_per_position[i]`` the steps
    that accepted position i + 1. Its mean acceptance length ``1 + accepted / drafts`` (bonus included) is
    vLLM's and, for chain drafting, SGLang's ``accept len``; the report's τ (tokens kept per verification step)
    differs from it where an output ends inside a step, and at the last steps where this runtime drafts fewer
    than k tokens so as not to pass ``max_new_tokens``."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: list[int]

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 0.0

    @property
    def position_rates(self) -> list[float]:
        """Per draft position: the steps that accepted it / drafts (vLLM's per-position acceptance rate)."""
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]


def engine_counts(traces: Iterable[RequestTrace], k: int) -> EngineCounts | None:
    """The vLLM-convention counts of ``traces`` (``None`` when a trace did not record its drafted counts)."""
    traces = list(traces)
    if any(t.drafted is None for t in traces):
        return None
    drafts = tokens = accepted = 0
    per_position = [0] * k
    for t in traces:
        for a, d in zip(t.accepted, t.drafted):
            if d == 0:
                continue
            drafts, tokens, accepted = drafts + 1, tokens + d, accepted + a
            for i in range(a):
                per_position[i] += 1
    return EngineCounts(drafts, tokens, accepted, per_position)


def distinct2(outputs: Iterable[Iterable[int]]) -> float:
    """Distinct bigrams / bigrams over all outputs, bigrams within each output only; 0.0 when there are none."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for out in outputs:
        out = list(out)
        pairs = list(zip(out, out[1:]))
        total += len(pairs)
        seen.update(pairs)
    return len(seen) / total if total else 0.0


def length_bucket(prompt_tokens: int) -> str:
    """Context-length bucket of a prompt (``LENGTH_BUCKETS``): ``"0-127"`` ... ``"4096-8191"``, ``"8192+"``."""
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0 (got {prompt_tokens})")
    for low, high, name in LENGTH_BUCKETS:
        if high is None or prompt_tokens <= high:
            return name
    raise AssertionError("unreachable")


def _order(key: str) -> tuple[int, str]:
    names = [name for _, _, name in LENGTH_BUCKETS]
    return (names.index(key), "") if key in names else (len(names), key)


def group_by(traces: Iterable[RequestTrace], key: str | Callable[[RequestTrace], str]) -> dict[str, list[RequestTrace]]:
    """Traces grouped by ``key``, keys sorted (length buckets in length order), traces in input order.

    ``key`` is a function of a trace, or a name: ``"length_bucket"`` (of ``prompt_tokens``) or a trace
    attribute such as ``"category"`` or ``"prompt_id"``.
    """
    if isinstance(key, str):
        name = key
        if name == "length_bucket":
            key = lambda t: length_bucket(t.prompt_tokens)  # noqa: E731
        elif name in RequestTrace.__dataclass_fields__:
            key = lambda t: str(getattr(t, name))  # noqa: E731
        else:
            raise ValueError(f"unknown group key {name!r}; use 'length_bucket', a trace field or a function")
    groups: dict[str, list[RequestTrace]] = {}
    for t in traces:
        groups.setdefault(key(t), []).append(t)
    return {k: groups[k] for k in sorted(groups, key=_order)}


def expected_speedup(tau: float, k: int, c: float, v: float = 1.0) -> float:
    """τ / (v + k·c): speedup over plain decoding when a draft step costs c and a verify v plain decode steps."""
    if k < 0 or c < 0 or v <= 0:
        raise ValueError(f"need k >= 0, c >= 0 and v > 0 (got k={k}, c={c}, v={v})")
    return tau / (v + k * c)


def _group(traces: list[RequestTrace], k: int) -> Group:
    return Group(num_prompts=len(traces), num_steps=num_steps(traces), tau=round(pooled_tau(traces), 4),
                 alpha=[round(a, 4) for a in alpha(traces, k)[0]], distinct2=round(distinct2(t.output for t in traces), 4))


def _prompt_set(trace: RequestTrace) -> str:
    return trace.prompt_id.split("/", 1)[0]


@dataclass(frozen=True)
class PointTiming:
    """What the timing of one sweep point found: the draft cost ratio ``c``, the verify cost ratio ``v`` (``None``:
    not measured, and the expected speedup takes 1), the terms of both (``cost``) and the measured speedup
    (plain wall time / speculative wall time)."""

    c: float
    measured_speedup: float
    v: float | None = None
    cost: DraftCost | None = None


@dataclass(frozen=True)
class LosslessVerdict:
    """What the lossless check of one sweep point found; all ``None`` where it did not run (T > 0)."""

    lossless: bool | None = None
    greedy_violations: int | None = None
    divergences: int | None = None


def sweep_point(k: int, temperature: float, traces: list[RequestTrace], timing: PointTiming,
                verdict: LosslessVerdict = LosslessVerdict(), forwards: int | None = None) -> SweepPoint:
    """The report's record of one speculative run at (k, temperature): its metrics overall and by group, what
    its timing found and, at T = 0, what the lossless check found. ``forwards``: the draft's forwards per step when
    they are not k (a block draft's 2)."""
    tau = pooled_tau(traces)
    cond, uncond = alpha(traces, k)
    counts = engine_counts(traces, k)
    c, v = timing.c, timing.v
    return SweepPoint(
        k=k, temperature=temperature, tau=round(tau, 4), alpha=[round(a, 4) for a in cond],
        alpha_unconditional=[round(a, 4) for a in uncond], draft_cost_ratio=round(c, 4),
        verify_cost_ratio=None if v is None else round(v, 4),
        expected_speedup=round(expected_speedup(tau, k if forwards is None else forwards, c, v or 1.0), 4),
        draft_forwards_per_step=forwards,
        measured_speedup=round(timing.measured_speedup, 4),
        distinct2=round(distinct2(t.output for t in traces), 4), lossless=verdict.lossless, num_prompts=len(traces),
        num_steps=sum(len(t.accepted) for t in traces), generated_tokens=sum(len(t.output) for t in traces),
        by_category={name: _group(g, k) for name, g in group_by(traces, "category").items()},
        by_length={name: _group(g, k) for name, g in group_by(traces, "length_bucket").items()},
        by_prompt_set={name: _group(g, k) for name, g in group_by(traces, _prompt_set).items()},
        cost=timing.cost, greedy_violations=verdict.greedy_violations, divergences=verdict.divergences,
        engine_acceptance=None if counts is None else EngineAcceptance(
            mean_acceptance_length=round(counts.mean_acceptance_length, 4), drafts=counts.drafts,
            draft_tokens=counts.draft_tokens, accepted=counts.accepted,
            accepted_per_position=counts.accepted_per_position),
    )
