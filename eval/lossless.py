"""Is speculative decoding lossless at T = 0? Two checks, chosen by the target's dtype.

- **float32**: strict token identity. Plain and speculative decoding of a prompt must give the same tokens; a
  verify forward batches other tokens than a decode step, but float32 rounding does not move an argmax unless
  two logits tie within ~1e-6, which real targets do not.
- **bf16 / fp16**: plain and speculative decoding are not bitwise batch-invariant (a verify forward of k + 1
  tokens sums in another order than a decode step of one), so where the target's top-2 are nearly tied the two
  may pick different tokens, both correct. What losslessness means there is checked instead:
  (a) every emitted token equals the target's own argmax in the verification forward that decided it
  (``SpeculativeDecoder.greedy_violations`` = 0), the guarantee of the acceptance rule;
  (b) at every divergence from plain decoding, the prompt and the common prefix are scored again by the
  runtime's target: the divergence is a **near-tie** when the two tokens are the target's top-2 there and their
  log-prob gap is below :data:`NEAR_TIE_NATS`. A divergence that is not a near-tie fails the check.

In both modes a greedy violation fails the check, and every divergence is reported with its gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mtp_train.eval.report import Divergence, Report

if TYPE_CHECKING:
    from mtp_train.runtime.engine import Engine, GenerationResult

NEAR_TIE_NATS = 0.5
"""Largest top-1 minus top-2 log-prob gap (nats) at which a bf16/fp16 divergence counts as a near-tie.

The lm_head's logits are bf16, rounded to 2^-8 of their size: one unit in the last place is 0.0625 for a logit
in [8, 16), 0.125 in [16, 32) and 0.25 in [32, 64), where the top logits of LLMs lie. Batched and single-token
forwards differ by a few such units once the differences of every layer have added up, so two tokens whose
log-probs are within 0.5 nats (a probability ratio under 1.65) may swap under a change of batch shape. A larger
gap is more than rounding explains: it is a bug."""

STRICT = "strict token identity (fp32)"
NEAR_TIE = "verify-forward argmax + near-tie divergences ({dtype})"

SHOWN = 10
"""Divergences listed in the report (all are counted)."""


def check_name(engine: Engine) -> str:
    """The check that applies to the engine's target: strict in float32, the near-tie check otherwise."""
    dtype = engine.model.output.weight.dtype  # compared by name: the renderer imports this module, not torch
    if str(dtype) == "torch.float32":
        return STRICT
    return NEAR_TIE.format(dtype={"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype), str(dtype)))


def first_difference(plain: list[int], spec: list[int]) -> int | None:
    """The first index at which the two outputs differ (one ending early counts), ``None`` when equal."""
    if plain == spec:
        return None
    return next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))


def classify(plain: int | None, spec: int | None, top_ids: list[int], top_logprobs: list[float],
             threshold: float = NEAR_TIE_NATS) -> tuple[float | None, bool]:
    """``(gap, near_tie)`` of a divergence, from the target's top-2 ids and log-probs at that position.

    The gap is top-1 minus top-2 log-prob when the two tokens are the target's top-2 (in either order), else
    ``None``; it is a near-tie when that gap is below ``threshold``.
    """
    if plain is None or spec is None or plain == spec or {plain, spec} != set(top_ids[:2]):
        return None, False
    gap = float(top_logprobs[0] - top_logprobs[1])
    return gap, gap < threshold


@dataclass
class LosslessCheck:
    """One T = 0 sweep point's check (``draft`` names it, e.g. ``mtp, k=2``): its greedy violations and its
    divergences from plain decoding, judged by ``method``."""

    draft: str
    method: str
    greedy_violations: int = 0
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def lossless(self) -> bool:
        if self.greedy_violations:
            return False
        if self.method == STRICT:
            return not self.divergences
        return all(d.near_tie for d in self.divergences)

    def why(self) -> str | None:
        """One line on why it failed, ``None`` when it passed."""
        if self.lossless:
            return None
        if self.greedy_violations:
            return (f"{self.draft}: {self.greedy_violations} greedy violation(s) (emitted tokens that are not the "
                    "verify forward's argmax)")
        d = next(d for d in self.divergences if self.method == STRICT or not d.near_tie)
        gap = "not the target's top-2" if d.gap is None else f"top-2 gap {d.gap:.3f} nats"
        return (f"{d.draft}: {d.prompt_id}: generated token {d.index}: plain {d.plain_token} vs speculative "
                f"{d.spec_token} ({gap})")


def check_lossless(engine: Engine, draft: str, prompt_ids: list[str], token_ids: list[list[int]],
                   plain: list[GenerationResult], spec: list[GenerationResult], greedy_violations: int,
                   threshold: float = NEAR_TIE_NATS) -> LosslessCheck:
    """The check of one T = 0 sweep point (``draft`` names it, e.g. ``mtp, k=2``), each divergence scored again.

    Every rank of a tensor-parallel target must call it (scoring is a collective forward); the outputs are the
    same on every rank, and ``greedy_violations`` counts on the leader only.
    """
    check = LosslessCheck(draft, check_name(engine), greedy_violations)
    for pid, prompt, a, b in zip(prompt_ids, token_ids, plain, spec, strict=True):
        i = first_difference(a.tokens, b.tokens)
        if i is None:
            continue
        # Row t of score() is the target's distribution of token t + 1: the last row predicts generated token i.
        scored = engine.score([prompt + a.tokens[:i]], layers=[-1], topk=2)
        ids, lps = scored.topk_ids[-1].tolist(), scored.topk_logprobs[-1].tolist()
        x = a.tokens[i] if i < len(a.tokens) else None
        y = b.tokens[i] if i < len(b.tokens) else None
        gap, tie = classify(x, y, ids, lps, threshold)
        check.divergences.append(Divergence(draft=draft, prompt_id=pid, index=i, plain_token=x, spec_token=y,
                                            gap=None if gap is None else round(gap, 4), near_tie=tie))
    return check


def summarize(checks: list[LosslessCheck], method: str) -> dict:
    """The report's lossless fields over every T = 0 sweep point of every draft (``lossless`` n/a without one)."""
    if not checks:
        return {"lossless": None, "lossless_detail": None}
    reasons = [why for c in checks if (why := c.why()) is not None]
    found = [d for c in checks for d in c.divergences]
    return {"lossless": all(c.lossless for c in checks), "lossless_detail": "; ".join(reasons[:3]) or None,
            "lossless_check": method, "near_tie_nats": None if method == STRICT else NEAR_TIE_NATS,
            "greedy_violations": sum(c.greedy_violations for c in checks), "num_divergences": len(found),
            "divergences": found[:SHOWN]}


def lossless_blocks(r: Report) -> list[tuple]:
    """The report's "Lossless check" section (blocks as in :mod:`mtp_train.eval.sections`)."""
    if r.lossless is None:
        return [("p", "Lossless: n/a. No sweep point ran at temperature 0, where speculative decoding must give "
                      "plain greedy decoding's output; add 0.0 to eval.temperatures to check it.")]
    points = sum(p.lossless is not None for p in r.sweep)
    method = r.lossless_check or "token identity"  # what reports that do not name their check checked
    if r.lossless_check in (None, STRICT):
        how = "the speculative output must be token-identical to the runtime's plain greedy output"
    else:
        tie = r.near_tie_nats if r.near_tie_nats is not None else NEAR_TIE_NATS
        how = ("every emitted token must be the target's argmax in the verify forward that decided it, and every "
               "divergence from plain greedy decoding a near-tie: the two tokens the target's top-2 there, less "
               f"than {tie:g} nats apart (in bf16/fp16 a verify forward is not bitwise equal to a decode step)")
    blocks: list[tuple] = [("p", f"Check: {method}, at temperature 0 on every eval prompt ({points} sweep point(s) "
                                 f"of this draft, and those of the other drafts): {how}.")]
    if r.lossless:
        blocks.append(("p", "Lossless: yes."))
    else:
        blocks.append(("flag", "Lossless: NO" + (f": {r.lossless_detail}" if r.lossless_detail else ".")))
    if r.greedy_violations is not None:
        blocks.append(("p", f"Greedy violations: {r.greedy_violations}. Divergences from plain decoding: "
                            f"{r.num_divergences or 0} (every draft, every k)."))
    if r.divergences:
        rows = [[d.draft, d.prompt_id, str(d.index), str(d.plain_token), str(d.spec_token),
                 "—" if d.gap is None else f"{d.gap:.3f}", "yes" if d.near_tie else "NO"] for d in r.divergences]
        if (r.num_divergences or 0) > len(rows):
            blocks.append(("p", f"The first {len(rows)} of {r.num_divergences} divergences:"))
        blocks.append(("table", ["draft", "prompt", "token index", "plain token", "speculative token",
                                 "top-2 gap (nats)", "near-tie"], rows))
    return blocks
