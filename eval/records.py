"""Measurement records of the report (``report.json``): the terms of c, lossless divergences, acceptance counted as
vLLM counts it, and a serving engine's check. :mod:`mtp_train.eval.report` holds the report that carries them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

class DraftCost(BaseModel):
    """The terms of c = ``draft_forward_ms`` / ``plain_decode_step_ms`` and of v = (``plain_decode_step_ms`` −
    ``decode_forward_ms`` + ``verify_forward_ms``) / ``plain_decode_step_ms``, both in plain decode steps, so that a
    reader can check them, and the wall times that explain the expected speedup's gap to the measured one.

    Older reports, told apart by ``decode_batch_steps`` being ``None``, took v = ``verify_forward_ms`` /
    ``decode_forward_ms`` (a ratio of bare forwards, in other units than c) or, before the probe, ``verify_step_ms`` /
    ``plain_decode_step_ms`` (the speculative run's own time: the prediction restated the measurement)."""

    model_config = ConfigDict(extra="forbid")

    draft_forwards: int
    """Batched draft forwards in speculative decode steps (chain forwards and re-syncs), the numerator's count."""
    draft_forward_ms: float
    plain_steps: int
    """Every step of the plain run at the same temperature (its wall time is the measured speedup's numerator)."""
    plain_decode_steps: int
    """The plain steps in which every scheduled sequence decoded exactly one token: the denominator's count."""
    plain_decode_step_ms: float
    spec_steps: int | None = None
    """Speculative decode steps (draft and verify), the count behind ``verify_step_ms``; ``None`` in old reports."""
    verify_step_ms: float | None = None
    """Mean wall time of a speculative decode step outside its draft forwards: the target's forward over k + 1
    tokens per sequence, acceptance and bookkeeping (measured, what v predicts; never v's term)."""
    verify_forward_ms: float | None = None
    """The target's forward over a step's tokens per sequence (k + 1, or the tree's N) with their logits, timed alone
    outside the speculative loop on contexts from the plain run (:mod:`mtp_train.eval.verify_probe`), at the batch
    sizes of ``decode_batch_steps`` and weighed by their steps; ``None`` where it was not measured."""
    decode_forward_ms: float | None = None
    """The same probe's forward over one token per sequence, weighed alike: the part of a plain decode step that the
    verify widens."""
    decode_batch_steps: dict[int, int] | None = None
    """The plain run's decode steps by batch size: the sizes the probe timed its forwards at (or interpolated
    between) and their weights; ``None`` in reports whose v was not in plain decode steps."""
    plain_wall_s: float | None = None
    spec_wall_s: float | None = None
    """The plain and the speculative run's wall times: the measured speedup is their ratio."""


class Divergence(BaseModel):
    """Where a T = 0 speculative output first differs from plain decoding of the same prompt."""

    model_config = ConfigDict(extra="forbid")

    draft: str
    """The draft and its k, e.g. ``mtp, k=2``."""
    prompt_id: str
    index: int
    """The generated token at which the outputs first differ (0 = the first generated token)."""
    plain_token: int | None
    spec_token: int | None
    """``None`` where that output ended before ``index``."""
    gap: float | None
    """Target log-prob of its top-1 minus its top-2 there, in nats; ``None`` when the two tokens are not its top-2."""
    near_tie: bool


class EngineAcceptance(BaseModel):
    """Acceptance in vLLM's convention (:class:`mtp_train.eval.metrics.EngineCounts`), beside τ."""

    model_config = ConfigDict(extra="forbid")

    mean_acceptance_length: float
    """1 + accepted / drafts: vLLM's mean acceptance length, SGLang's accept length (chain drafting)."""
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: list[int]


class EngineCheck(BaseModel):
    """The head served by an external engine on the eval's prompts (``bench/vllm_check.py``), against this runtime."""

    model_config = ConfigDict(extra="forbid")

    engine: str
    """e.g. ``vLLM 0.32.0 (CPU)``."""
    date: str
    k: int
    prompts: int
    max_new_tokens: int
    identical_to_plain: bool
    """The engine's speculative output equals the engine's own plain output on every prompt (T = 0)."""
    engine_mean_acceptance_length: float
    runtime_mean_acceptance_length: float
    """This runtime's 1 + accepted / drafts for the same head, prompts, k and max tokens."""
    relative_difference: float
    engine_accepted_per_position: list[int]
    runtime_accepted_per_position: list[int]
    engine_drafts: int
    runtime_drafts: int
    max_position_difference: float
    """The largest relative difference of the per-position acceptance rates (accepted there / drafts)."""
    within_tolerance: bool
    tolerance: float
