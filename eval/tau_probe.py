"""τ while a head trains (``train.tau_every``): the runtime decodes a fixed set of held-out prompts speculatively
with the head as it stands, greedily, at the recipe's largest k, and the trainer logs τ and α₁ beside the loss.

The prompts are the eval's ``heldout`` set (rows the seeded draw kept out of training), the first
``train.tau_prompts`` that fit, decoded together (one batch) for ``train.tau_tokens`` new tokens each. The target
is loaded into its own engine once, on rank 0, beside the trainer (the memory plan counts it: ``memory.py``); the
train stage sits below the eval's modules, so ``run_train`` is handed ``TauProbe.start``. Each probe drafts with a
copy of the head in the target's dtype, so the head being trained is never touched. τ and α are counted as the
eval counts them (``mtp_train.eval.metrics``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch

from mtp_train.eval.loading import draft_vocab, fitting_prompts, room_for
from mtp_train.eval.metrics import alpha, pooled_tau
from mtp_train.eval.run import request_traces
from mtp_train.heads import DraftHead
from mtp_train.recipe import Recipe
from mtp_train.runtime.engine import Engine


@dataclass
class TauProbe:
    """The target's engine, the probe's prompts ``[n][len]`` and settings, and the ids an mtp/eagle head drafts
    from (``eval.draft_vocab``; None: all)."""

    engine: Engine
    prompts: list[list[int]]
    k: int
    max_new_tokens: int
    vocab: torch.Tensor | None

    @classmethod
    def start(cls, recipe: Recipe, device: torch.device) -> TauProbe:
        """Load the target and pick the prompts (the recipe's rules already refused a probe without held-out
        rows)."""
        from mtp_train.data.tokenizer import load_tokenizer
        from mtp_train.models.checkpoint import load_transformer
        from mtp_train.runtime.device import resolve_dtype
        from mtp_train.runtime.engine import default_stop_ids
        from mtp_train.runtime.kv_cache import KVPool

        t = recipe.train
        k = max(recipe.eval.k)
        model = load_transformer(recipe.target.path, dtype=resolve_dtype(recipe.target.dtype, device), device=device)
        tokenizer = load_tokenizer(recipe)
        prompts = fitting_prompts(recipe, ["heldout"], None, room_for(model.cfg, t.tau_tokens, k), tokenizer)[1]
        prompts = prompts[: t.tau_prompts]
        # the target's pages for every prompt with its answer, a step of drafts and a spare page each
        slots = sum(len(p) + t.tau_tokens + k + 32 for p in prompts)
        engine = Engine(model, stop_ids=default_stop_ids(recipe.target.path), backend=recipe.target.attention_backend,
                        kv_bytes=slots * KVPool.bytes_per_token(model.cfg, model.output.weight.dtype, 1),
                        max_seqs=max(1, len(prompts)))
        return cls(engine, prompts, k, t.tau_tokens, draft_vocab(recipe, model.cfg.vocab_size))

    def measure(self, head: DraftHead) -> dict[str, Any]:
        """``{"tau", "alpha1", "tau_s"}`` of ``head`` as it is now: τ pooled over the prompts (bonus included), α₁
        the first draft position's acceptance rate, ``tau_s`` the probe's wall seconds."""
        from mtp_train.runtime.drafters import head_drafter
        from mtp_train.runtime.sampling import SamplingParams
        from mtp_train.runtime.speculative import SpeculativeDecoder

        if not self.prompts:
            return {}
        started = time.perf_counter()
        drafter = head_drafter(self.engine, copy.deepcopy(head), self.vocab)  # the copy takes the runtime's layout
        decoder = SpeculativeDecoder(self.engine, drafter, self.k)
        results = decoder.generate(self.prompts, SamplingParams(max_new_tokens=self.max_new_tokens))
        traces = request_traces([_Prompt()] * len(results), self.prompts, results)
        return {"tau": round(pooled_tau(traces), 4), "alpha1": round(alpha(traces, self.k)[0][0], 4),
                "tau_s": round(time.perf_counter() - started, 3)}


class _Prompt:
    """What ``request_traces`` reads of an eval prompt, for prompts that need no name."""

    prompt_id = "tau"
    category = "heldout"
