"""P-EAGLE (``head.parallel_drafts``): an eagle3 head whose k drafts come from one forward, the last verified row and
k - 1 mask positions after it. What the drafter drafts is what the objective trains, the recipe refuses what would
train or draft past it, and it saves and loads (lossless decoding with it: tests/test_speculative.py)."""

from __future__ import annotations

import bisect

import pytest
import torch

from conftest import TINY_RECIPE, TINY_TARGET
from mtp_train.errors import UserError
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights

DRAFTS = 4


def _head(frozen: FrozenTarget):
    torch.manual_seed(0)
    spec = head_spec("eagle3", 1, frozen.cfg, "x", aux_layers=(1, 2, 3), draft_vocab=frozen.cfg.vocab_size,
                     mask_token_id=7, parallel_drafts=DRAFTS)
    head = build_head(spec).eval()
    for p in head.parameters():  # norms away from 1 and a mask state of some size, so that a misplaced one shows
        p.data.add_(0.1 * torch.randn_like(p))
    return head


def _batch(frozen: FrozenTarget) -> Batch:
    """Two packed documents (14 and 11 tokens), every token counted; the teacher row i's single top-K id is i, so
    that a scored row names its label."""
    h, v, cu = frozen.cfg.hidden_size, frozen.cfg.vocab_size, [0, 14, 25]
    n = cu[-1]
    torch.manual_seed(2)
    return Batch(torch.randint(0, v, (n,)), torch.randn(n, h), torch.ones(n, dtype=torch.bool), torch.zeros(n, 1),
                 torch.arange(n)[:, None], torch.full((n,), -3.0), cu, torch.randn(n, 3 * h))


def _scored(monkeypatch, head, frozen: FrozenTarget, batch: Batch) -> dict[tuple[int, int, int], torch.Tensor]:
    """``parallel_loss``: (document, anchor a, draft j = 0..K-1) -> the draft logits ``[V]`` it scores against the
    target's distribution of t_{a+2+j}."""
    from mtp_train.train import parallel, ttt

    calls = []
    real = ttt.draft_step_loss

    def scored(head_, frozen_, batch_, weights, t2d, picked, teacher_rows):
        calls.append((picked, teacher_rows))
        return real(head_, frozen_, batch_, weights, t2d, picked, teacher_rows)

    monkeypatch.setattr(ttt, "draft_step_loss", scored)
    monkeypatch.setattr(parallel, "draft_step_loss", scored)
    with torch.no_grad():
        parallel.parallel_loss(head, frozen, batch, LossWeights(0.0, 1.0, DRAFTS, 0.8, "topk"))
    monkeypatch.undo()
    assert len(calls) == DRAFTS, "step 0, then each mask position"
    out, cu = {}, batch.cu_seqlens
    for j, (picked, rows) in enumerate(calls):
        for logits, row in zip(head.draft_logits(picked), rows.tolist()):
            d = bisect.bisect_right(cu, row) - 1
            out[d, row - cu[d] - 1 - j, j] = logits  # teacher row a + 1 + j
    return out


def test_the_drafters_parallel_drafts_are_what_the_objective_trains(monkeypatch):
    """For sequences ending at anchors of two documents (the target has verified t_0..t_{a+1}), the drafter's one
    forward (the kept rows, then k - 1 masks) gives, at every k = 1..K, the logits ``parallel_loss`` scores for
    t_{a+2+j}: step 0 at row a, mask position j at position a + j."""
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.drafters import ParallelDrafter
    from mtp_train.runtime.sampling import SamplingParams
    from mtp_train.runtime.sequence import Sequence

    frozen = FrozenTarget.load(TINY_TARGET)
    head, batch = _head(frozen), _batch(frozen)
    cu, tokens, h = batch.cu_seqlens, batch.tokens, frozen.cfg.hidden_size
    want = _scored(monkeypatch, head, frozen, batch)
    engine = Engine.from_pretrained(TINY_TARGET, page_size=4)
    drafter = ParallelDrafter(engine, head)
    anchors = [(0, a) for a in (0, 2, 5, 9, 11)] + [(1, a) for a in (1, 4, 7, 8)]
    seqs = [Sequence(i, tokens[cu[d] : cu[d] + a + 2].tolist(), SamplingParams(), frozenset(), a + 2)
            for i, (d, a) in enumerate(anchors)]
    compared = 0
    for ks in [[k] * len(seqs) for k in range(1, DRAFTS + 1)] + [[1 + b % DRAFTS for b in range(len(seqs))]]:
        with torch.no_grad():  # a prefill's feed: rows 0..a read t_1..t_{a+1} and fc of the states at 0..a
            states = drafter.features(None, list(batch.aux.split(h, dim=-1)))
            feeds = [drafter.feed(seq, 0, 0, states[cu[d] : cu[d] + a + 1]) for seq, (d, a) in zip(seqs, anchors)]
            for f, k in zip(feeds, ks):
                drafter.allocator.truncate(f.seq.draft_pages, 0)
                drafter.allocator.reserve(f.seq.draft_pages, len(f.tokens) + k + 1)
            drafter.forward(feeds)
            got = drafter.block_logits(list(zip(seqs, ks)), max(ks))
        for b, ((d, a), k) in enumerate(zip(anchors, ks)):
            for j in range(k):
                if (d, a, j) in want:  # (t_{a+2+j} lies in the document)
                    torch.testing.assert_close(got[b, j], want[d, a, j], rtol=1e-4, atol=1e-4,
                                               msg=lambda m: f"k={max(ks)}, document {d}, anchor {a}, draft {j}: {m}")
                    compared += 1
    assert compared > 60


def test_a_draft_past_the_parallel_drafts_is_refused():
    from mtp_train.recipe import load_recipe

    base = ["head.kind=eagle3", "head.parallel_drafts=3", "train.unroll=1", "eval.trees=[]"]
    load_recipe(TINY_RECIPE, [*base, "eval.k=[1,3]"])  # within: accepted
    for extra, words in [(["eval.k=[4]"], ("eval.k", "head.parallel_drafts")),
                         (["eval.k=[2]", "eval.trees=[{topk: 2, depth: 4, draft_tokens: 6}]"], ("eval.trees", "depth")),
                         (["eval.k=[2]", "train.unroll=2"], ("train.unroll", "train.unroll: 1")),
                         (["eval.k=[2]", "head.kind=mtp"], ("head.parallel_drafts", "eagle3"))]:
        with pytest.raises(UserError) as e:
            load_recipe(TINY_RECIPE, [*base, *extra])
        assert all(w in str(e.value) for w in words), str(e.value)


def test_a_saved_head_loads_with_its_mask_state(tmp_path):
    from mtp_train.train.checkpoint import load_head, save_head

    frozen = FrozenTarget.load(TINY_TARGET)
    head = _head(frozen)
    save_head(tmp_path / "eagle3", head, {})
    loaded = load_head(tmp_path / "eagle3")
    assert loaded.spec.parallel_drafts == DRAFTS and loaded.spec.mask_token_id == 7
    assert torch.equal(loaded.mask_hidden, head.mask_hidden)
    assert "P-EAGLE" in loaded.spec.describe()


def _saved_run(tmp_path):
    """A random P-EAGLE head saved as the trained head of a tiny-recipe run; the head and the recipe."""
    from mtp_train.features.manifest import target_fingerprint
    from mtp_train.recipe import load_recipe
    from mtp_train.train.checkpoint import save_head

    frozen = FrozenTarget.load(TINY_TARGET)
    torch.manual_seed(0)
    head = build_head(head_spec("eagle3", 1, frozen.cfg, target_fingerprint(TINY_TARGET), aux_layers=(1, 2, 3),
                                draft_vocab=1024, mask_token_id=7, parallel_drafts=DRAFTS))
    run = tmp_path / "run"
    save_head(run / "heads" / "eagle3", head, {})
    return head, load_recipe(TINY_RECIPE, [f"output_dir={run}", "head.kind=eagle3", f"head.parallel_drafts={DRAFTS}",
                                           "head.mask_token_id=7", "train.unroll=1", "eval.k=[1,2]", "eval.trees=[]"])


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_the_export_writes_the_mask_state_and_the_parallel_keys_vllm_reads(tmp_path, fmt):
    """vLLM 0.32 serves a P-EAGLE head as eagle3 with ``parallel_drafting``: the mask token from the config
    (``mask_token_id``; speculators' ``peagle`` type maps it to ``pard_token``) and ``mask_hidden`` from the
    weights, under that name."""
    import json

    from safetensors.torch import load_file

    from mtp_train.export import export_head

    head, recipe = _saved_run(tmp_path)
    out = export_head(recipe, fmt, tmp_path / fmt)
    assert torch.equal(load_file(out / "model.safetensors")["mask_hidden"], head.mask_hidden.detach())
    config = json.loads((out / "config.json").read_text())
    assert config["mask_token_id"] == 7
    if fmt == "speculators":
        assert config["speculators_model_type"] == "peagle"
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DRAFTS
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["parallel_drafting"] is True


def test_sglang_export_of_a_parallel_head_is_refused(tmp_path):
    from mtp_train.export import export_head

    _, recipe = _saved_run(tmp_path)
    with pytest.raises(UserError, match="SGLang 0.5.23 drafts eagle3 heads in a chain only"):
        export_head(recipe, "sglang", tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()


@pytest.mark.slow
def test_vllm_serves_the_exported_parallel_head_as_this_runtime_does(peagle_run, tmp_path):
    """vLLM's CPU build, eagle3 with ``parallel_drafting``: its speculative output equals its plain output, and its
    per-position acceptance is this runtime's within 3%."""
    from conftest import vllm_check

    proc = vllm_check(peagle_run, tmp_path / "work", "--k", "2", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: 2/2 k within 3%" in proc.stdout
