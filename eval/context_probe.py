"""The draft's cost c by context length: one draft forward over one plain decode step, both at batch 1, at the
context of each length bucket the eval's prompts fall in.

A draft layer attends to the whole context (or to its window, ``head.window``), so c grows with the context where the
target's step grows more slowly, and a single c over short and long prompts hides it. For each bucket
(:data:`mtp_train.eval.metrics.LENGTH_BUCKETS`) the prompt of median length among its prompts is decoded twice for
:data:`PROBE_TOKENS` tokens at T = 0, plainly (each decode step timed, :func:`plain_decode`) and with the draft at k
(its draft forwards timed by the decoder, as in the sweep). c of the bucket is the mean draft forward over the mean
plain decode step. The draft is warm (the sweep's warm-up ran before), and nothing here enters the sweep's timings.
"""

from __future__ import annotations

from mtp_train.eval.metrics import length_bucket
from mtp_train.eval.timing import plain_decode
from mtp_train.runtime.drafters import Drafter
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.speculative import SpeculativeDecoder

PROBE_TOKENS = 24


def bucket_contexts(token_ids: list[list[int]]) -> dict[str, list[int]]:
    """The prompt of median length in each length bucket (the shorter middle one of an even count)."""
    by_bucket: dict[str, list[list[int]]] = {}
    for ids in token_ids:
        by_bucket.setdefault(length_bucket(len(ids)), []).append(ids)
    return {b: sorted(group, key=len)[(len(group) - 1) // 2] for b, group in by_bucket.items()}


def context_times(engine: Engine, drafter: Drafter, k: int, token_ids: list[list[int]], repeats: int = 1
                  ) -> dict[str, tuple[float, float]]:
    """Seconds of one draft forward and of one plain decode step by length bucket of ``token_ids``, over ``repeats``
    probes of each, in turn (a bucket whose probe made no decode step or draft forward is left out)."""
    params = [SamplingParams(temperature=0.0, max_new_tokens=PROBE_TOKENS)]
    times = {}
    for bucket, ids in bucket_contexts(token_ids).items():
        draft_s = forwards = step_s = steps = 0
        for _ in range(repeats):
            _, plain = plain_decode(engine, [ids], params)
            decoder = SpeculativeDecoder(engine, drafter, k)
            decoder.generate([ids], params)
            draft_s, forwards = draft_s + decoder.timings.draft_s, forwards + decoder.timings.draft_forwards
            step_s, steps = step_s + plain.decode_s, steps + plain.decode_steps
        if steps and forwards and step_s > 0:
            times[bucket] = (draft_s / forwards, step_s / steps)
    return times


def context_costs(engine: Engine, drafter: Drafter, k: int, token_ids: list[list[int]]) -> dict[str, float]:
    """c by length bucket of ``token_ids``: ``context_times``' draft forward over its plain decode step."""
    return {b: draft / step for b, (draft, step) in context_times(engine, drafter, k, token_ids).items()}
