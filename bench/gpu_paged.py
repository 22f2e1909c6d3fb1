"""Log-probs read over cached pages, for bench/gpu_check.py's paged parity: a prefill, decode steps of one token per
sequence, then one verify step of several tokens per sequence, each attending to the K/V already in the pages (as
speculative decoding does). The same tokens through two attention backends give the same rows, so the rows compare
position for position."""

from __future__ import annotations

import torch

from mtp_train.runtime.batch import TreeMask
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.sequence import Sequence


def paged_logprobs(engine: Engine, prompts: list[list[int]], continuation: list[list[int]], decode_steps: int,
                   tree: bool = False) -> torch.Tensor:
    """``decode_steps`` single-token decode steps over each prompt's cached pages, then one verify step with the
    rest of its ``continuation``: the log-probs of every decoded and verified position, ``[B * len(c), V]`` fp32
    (step by step, sequence by sequence). The prefill's own rows are left out: fresh prefills are compared apart.
    ``tree``: the verify goes as a draft tree shaped as a chain (a ``TreeMask``, FlashInfer's custom mask on CUDA),
    which must give the causal verify's rows."""
    params = SamplingParams(max_new_tokens=len(continuation[0]), stop_token_ids=())
    seqs = [Sequence(i, list(p), params, frozenset(), len(p)) for i, p in enumerate(prompts)]
    rows = []

    def step(new: list[list[int]], mask: TreeMask | None = None) -> torch.Tensor:
        scheduled = list(zip(seqs, new, strict=True))
        engine.reserve(scheduled)
        with torch.no_grad():
            _, hidden, _ = engine.forward(scheduled, (), None, mask)
            return engine.model.logits(hidden).float().log_softmax(-1)

    step(prompts)
    for t in range(decode_steps):
        rows.append(step([[c[t]] for c in continuation]))
    verify = [c[decode_steps:] for c in continuation]
    mask = None
    if tree:
        chain = torch.ones(len(verify[0]), len(verify[0]), dtype=torch.bool).tril().to(engine.device)
        mask = TreeMask([seq.cached for seq in seqs], [chain] * len(seqs))
    rows.append(step(verify, mask))
    for seq in seqs:
        engine.release(seq)
    return torch.cat(rows)


def fresh_rows(engine: Engine, prompts: list[list[int]], continuation: list[list[int]], decode_steps: int
               ) -> torch.Tensor:
    """The rows ``paged_logprobs`` returns, in its order, from one fresh prefill of each whole sequence (prompt and
    continuation): what the cached pages must reproduce."""
    whole = [p + c for p, c in zip(prompts, continuation, strict=True)]
    scored = engine.score(whole, layers=[-1])
    with torch.no_grad():
        logprobs = engine.model.logits(scored.hidden[:, -1].to(engine.device)).float().log_softmax(-1)
    starts = [0]
    for seq in whole:
        starts.append(starts[-1] + len(seq))
    index = [starts[b] + len(p) + t for t in range(decode_steps) for b, p in enumerate(prompts)]
    index += [starts[b] + len(p) + t for b, p in enumerate(prompts) for t in range(decode_steps, len(continuation[b]))]
    return logprobs[torch.tensor(index, device=logprobs.device)]


def step_syncs(engine: Engine, prompts: list[list[int]], k: int = 4) -> dict[str, int]:
    """The most host syncs one step made, on a real GPU (``mtp_train.runtime.syncs``): plain greedy decoding
    (``step``; its first is the prefill), speculative decoding with a random mtp head at ``k`` (``_spec_step``,
    ``_plain_step``), with a random dflash block drafter (``dflash _spec_step``) and with a draft tree of the mtp head
    (``tree _spec_step``: its masked plans), each after an untimed warm-up. At most ``SYNC_BUDGET`` each is the pass
    mark."""
    from mtp_train.heads import build_head, head_spec
    from mtp_train.runtime.drafters import HeadDrafter, head_drafter
    from mtp_train.runtime.speculative import SpeculativeDecoder
    from mtp_train.runtime.syncs import cuda_syncs, most_per_call
    from mtp_train.runtime.tree import TreeShape
    from mtp_train.runtime.tree_decoder import TreeDecoder

    params = SamplingParams(max_new_tokens=8, stop_token_ids=())
    torch.manual_seed(0)
    dtype = engine.model.output.weight.dtype
    mtp = HeadDrafter(engine, build_head(head_spec("mtp", 1, engine.cfg, "random")).to(engine.device, dtype))
    dflash = build_head(head_spec("dflash", 1, engine.cfg, "random", aux_layers=(1, 2, 3), block_size=k + 1,
                                  mask_token_id=engine.cfg.vocab_size - 1)).to(engine.device, dtype)
    runners = [("", engine, ("step",)), ("", SpeculativeDecoder(engine, mtp, k), ("_spec_step", "_plain_step")),
               ("dflash ", SpeculativeDecoder(engine, head_drafter(engine, dflash), k), ("_spec_step",)),
               ("tree ", TreeDecoder(engine, mtp, TreeShape(4, 3, 8)), ("_spec_step",))]
    counts: dict[str, int] = {}
    for label, runner, names in runners:
        runner.generate(prompts, params)
        with cuda_syncs() as syncs, most_per_call(runner, names, lambda: syncs.count) as most:
            runner.generate(prompts, params)
        counts.update({label + name: n for name, n in most.items()})
    return counts
