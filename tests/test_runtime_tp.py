"""Tensor parallelism over real processes (torchrun, gloo) gives the TP=1 results."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY_TARGET
from mtp_train.errors import UserError
from mtp_train.models.tp import TensorParallel
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams


@pytest.mark.slow
def test_tp2_over_gloo_matches_tp1(tmp_path):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (9, 33, 20)]
    torch.save(prompts, tmp_path / "prompts.pt")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(REPO / "tests" / "tp_worker.py"), str(TINY_TARGET), str(tmp_path / "prompts.pt"),
        str(tmp_path / "out.pt"), "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tp2 = torch.load(tmp_path / "out.pt", weights_only=True)
    assert tp2["world_size"] == 2 and tp2["heads_per_rank"] == 2
    assert tp2["speculative_tokens"] == tp2["tokens"], "speculative decoding under TP=2 is lossless"
    assert sum(map(sum, tp2["accepted"])) > 0, "the leader's draft was used"
    assert tp2["tree_tokens"] == tp2["tokens"], "tree drafting under TP=2 is lossless"

    engine = Engine.from_pretrained(TINY_TARGET, page_size=16)
    tp1 = engine.score(prompts, layers=[-1], topk=16)
    assert torch.equal(tp2["topk_ids"], tp1.topk_ids)
    assert (tp2["topk_logprobs"] - tp1.topk_logprobs).abs().max() <= 1e-5
    assert (tp2["logsumexp"] - tp1.logsumexp).abs().max() <= 1e-5
    assert (tp2["hidden"] - tp1.hidden).abs().max() <= 1e-5
    tokens = [r.tokens for r in engine.generate(prompts, SamplingParams(max_new_tokens=16, stop_token_ids=()))]
    assert tp2["tokens"] == tokens


def test_tp_must_divide_kv_heads():
    with pytest.raises(UserError, match="does not divide the model's 2 KV heads"):
        Engine.from_pretrained(TINY_TARGET, tp=TensorParallel(rank=0, size=4))


@pytest.mark.slow
def test_tp_ranks_agree_on_one_page_count_under_page_pressure(tmp_path):
    """Rank 0 measures room for 24 pages, rank 1 for 200: both size 24, and decoding under that pressure (waits and
    preemptions) keeps their schedulers in step and gives the TP=1 tokens. With a pool each, rank 1's scheduler
    would run sequences that rank 0 holds back, and the ranks' collectives would no longer pair up."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (9, 30, 17, 22, 12, 26)]
    torch.save(prompts, tmp_path / "prompts.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "tp_budget_worker.py"), str(TINY_TARGET), str(tmp_path / "prompts.pt"),
           str(tmp_path / "out.pt"), "24,200"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["pages"] == [24, 24]
    engine = Engine.from_pretrained(TINY_TARGET, page_size=4, num_pages=24, max_seqs=8)
    alone = [r.tokens for r in engine.generate(prompts, SamplingParams(max_new_tokens=24, stop_token_ids=()))]
    assert out["tokens"] == alone
