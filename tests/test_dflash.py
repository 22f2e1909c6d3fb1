"""The dflash head: its training blocks compute what the runtime's block computes, it trains, drafts in one forward
and exports for vLLM (lossless decoding with it, greedy under page pressure and sampled: tests/test_speculative.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_TARGET, assert_one_line_user_error, run_cli
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.runtime.batch import build_batch
from mtp_train.runtime.drafters import BlockDrafter
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.kv_cache import PageTable
from mtp_train.runtime.speculative import SpeculativeDecoder
from mtp_train.train.blocks import BlockAttention
from mtp_train.train.checkpoint import load_head
from test_speculative import GREEDY

BLOCK = 5


def _head(frozen: FrozenTarget, layers: int = 2, window: int = 0):
    torch.manual_seed(0)
    spec = head_spec("dflash", layers, frozen.cfg, "x", aux_layers=(1, 2, 3), block_size=BLOCK, mask_token_id=7,
                     window=window)
    head = build_head(spec).eval()
    for p in head.parameters():  # norms away from 1, so that a norm applied in the wrong place shows
        p.data.add_(0.1 * torch.randn_like(p))
    return head


def test_block_attention_equals_a_dense_mask(monkeypatch):
    """Block rows over a range of context rows and their own block's keys, a few rows at a time (the scores made again
    in backward), equal SDPA over every key with the block's mask, forward and gradients: context positions below the
    anchor, and the anchor's own block."""
    from mtp_train.heads import attention

    monkeypatch.setattr(attention, "SCORE_CHUNK_BYTES", 2 * BLOCK * 4 * 16 * 4)  # chunks of two blocks or fewer
    torch.manual_seed(0)
    n, anchors, hq, hkv, d = 11, torch.tensor([0, 3, 9]), 4, 2, 8
    r = anchors.numel() * BLOCK
    inputs = [torch.randn(r, hq, d), torch.randn(r, hkv, d), torch.randn(r, hkv, d), torch.randn(n, hkv, d),
              torch.randn(n, hkv, d)]
    weight = torch.randn(r, hq, d)
    plan = BlockAttention([0, n], [anchors], BLOCK)
    assert len(plan.ranges.chunks(hq, BLOCK)) > 1

    def run(attend):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = attend(*leaves)
        return out, torch.autograd.grad((out * weight).sum(), leaves)

    def chunked(q, k, v, ck, cv):
        plan.context = (ck, cv)
        return plan.attend(q, k, v)

    def dense(q, k, v, ck, cv):
        owner = torch.arange(r) // BLOCK
        mask = torch.cat([torch.arange(n)[None, :] < anchors[owner][:, None], owner[:, None] == owner[None, :]], 1)
        keys, values = torch.cat([ck, k]), torch.cat([cv, v])
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=mask,
            enable_gqa=True)[0].transpose(0, 1)

    (got, got_grads), (want, want_grads) = run(chunked), run(dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 7])
def test_training_blocks_compute_what_the_runtime_block_computes(window):
    """A training forward over blocks at several anchors of two packed documents equals, anchor by anchor, the
    runtime's: the block run non-causally over the draft's pages, each layer first writing the context's keys and
    values there; with a window (``head.window`` 7: anchor 11 sees 6 of its 11 context rows), block row j sees the
    context above its own position minus the window in both."""
    frozen = FrozenTarget.load(TINY_TARGET)
    head = _head(frozen, window=window)
    lengths = [13, 9]
    cu = [0, 13, 22]
    aux = torch.randn(cu[-1], 3 * frozen.cfg.hidden_size)
    tokens = torch.randint(0, frozen.cfg.vocab_size, (cu[-1],))
    picks = [torch.tensor([0, 4, 11]), torch.tensor([2, 7])]
    positions = torch.cat([torch.arange(n) for n in lengths])
    starts = torch.tensor([0, 0, 0, 13, 13])
    local = torch.cat(picks)
    blocks = local[:, None] + torch.arange(BLOCK)
    with torch.no_grad():
        trained = head(frozen.embed(tokens[starts + local]), aux, positions, blocks.view(-1),
                       BlockAttention(cu, picks, BLOCK, window=window)).view(len(local), BLOCK, -1)
    engine = Engine.from_pretrained(TINY_TARGET, page_size=4)
    drafter = BlockDrafter(engine, head)
    context = head.project(aux)
    for i, (start, a) in enumerate(zip(starts.tolist(), local.tolist())):
        table = PageTable()
        drafter.allocator.reserve(table, a + BLOCK)
        with torch.no_grad():  # the context's K/V written layer by layer inside the block's forward, as it drafts
            written = None
            if a:
                meta = build_batch([[0] * a], [0], [table.pages], 4, engine.device)
                written = (context[start : start + a], meta.positions, drafter.backend.plan(meta, *drafter.heads))
            meta = build_batch([[int(tokens[start + a])] + [7] * (BLOCK - 1)], [a], [table.pages], 4, engine.device)
            embeds = head.block_embeds(frozen.embed(tokens[start + a : start + a + 1]), BLOCK)
            out = head.run(embeds, None, meta.positions, drafter.backend.plan(meta, *drafter.heads, causal=False),
                           drafter.kv.layers, written)
        drafter.allocator.free(table)
        torch.testing.assert_close(out, trained[i], rtol=1e-4, atol=1e-4)


def test_the_drafters_blocks_are_what_the_objective_trains_at_every_k(monkeypatch):
    """What speculative decoding drafts is what ``block_loss`` scores, anchor by anchor, at every k = 1..B-1.

    The runtime side is the drafter's own path: ``features`` of the aux layers' states, ``forward`` of a prefill's
    feed (the context in the draft's pages), then ``block_logits`` (the first token's embedding and mask vectors after
    it, the rows it reads) for sequences ending at anchors of two documents, in one batch at each k and once with a
    k of its own per sequence. The training side is the objective itself: the lm_head inputs ``block_loss`` scores
    against each label's teacher row (a row's top-1 id is its own index, so it names the label), made logits as its
    loss makes them. The runtime runs a block of 1 + k at k drafts (as vLLM does), so at k < B - 1 the objective
    runs blocks of 1 + k; at k = B - 1 it is the trained block."""
    from mtp_train.runtime.sampling import SamplingParams
    from mtp_train.runtime.sequence import Sequence

    frozen = FrozenTarget.load(TINY_TARGET)
    head = _head(frozen)
    batch = _batch(frozen)
    cu, tokens, aux, h, n = batch.cu_seqlens, batch.tokens, batch.aux, frozen.cfg.hidden_size, batch.num_tokens

    engine = Engine.from_pretrained(TINY_TARGET, page_size=4)
    drafter = BlockDrafter(engine, head)
    anchors = [(0, a) for a in (1, 3, 6, 9, 12)] + [(1, a) for a in (1, 4, 7, 9)]
    seqs = [Sequence(i, tokens[cu[d] : cu[d] + a + 1].tolist(), SamplingParams(), frozenset(), a + 1)
            for i, (d, a) in enumerate(anchors)]
    with torch.no_grad():  # the prefill: the target read t_0..t_{a-1} of each and sampled t_a
        states = drafter.features(torch.zeros(n, h), list(aux.split(h, dim=-1)))
        feeds = [drafter.feed(seq, 0, 0, states[cu[d] : cu[d] + a]) for seq, (d, a) in zip(seqs, anchors)]
        for f in feeds:
            drafter.allocator.reserve(f.seq.draft_pages, len(f.tokens))
        drafter.forward(feeds)

    def drafted(ks: list[int]) -> torch.Tensor:
        """One speculative step's drafts, ``ks[b]`` for sequence b -> ``[S, max(ks), V]``."""
        for seq, k in zip(seqs, ks):
            drafter.allocator.truncate(seq.draft_pages, drafter.valid(seq))
            drafter.allocator.reserve(seq.draft_pages, k + 1)
        with torch.no_grad():
            return drafter.block_logits(list(zip(seqs, ks)), max(ks))

    want = {k: _scored(monkeypatch, head, frozen, batch, k + 1) for k in range(1, BLOCK)}
    mixed = [1 + b % (BLOCK - 1) for b in range(len(seqs))]
    compared = 0
    for ks in [[k] * len(seqs) for k in range(1, BLOCK)] + [mixed]:
        got = drafted(ks)
        for b, ((d, a), k) in enumerate(zip(anchors, ks)):
            for j in range(1, k + 1):
                if (d, a, j) in want[k]:  # (t_{a+j} lies in the document)
                    torch.testing.assert_close(got[b, j - 1], want[k][d, a, j], rtol=1e-4, atol=1e-4,
                                               msg=lambda m: f"k={k}, document {d}, anchor {a}, draft {j}: {m}")
                    compared += 1
    assert compared > 80


def _batch(frozen: FrozenTarget):
    """Two packed documents (14 and 11 tokens) of random tokens and aux states, every token counted; the teacher row
    i's single top-K id is i itself, so that a scored row names its label."""
    from mtp_train.train.data import Batch

    h, v, cu = frozen.cfg.hidden_size, frozen.cfg.vocab_size, [0, 14, 25]
    n = cu[-1]
    torch.manual_seed(2)
    tokens, aux = torch.randint(0, v, (n,)), torch.randn(n, 3 * h)
    return Batch(tokens, torch.randn(n, h), torch.ones(n, dtype=torch.bool), torch.zeros(n, 1),
                 torch.arange(n)[:, None], torch.full((n,), -3.0), cu, aux)


def _scored(monkeypatch, head, frozen: FrozenTarget, batch, size: int, lengths: bool = False
            ) -> dict[tuple[int, int, int], torch.Tensor]:
    """``block_loss`` over blocks of ``size`` (``lengths``: at lengths drawn as ``train.block_lengths: uniform``
    draws them): (document, anchor, block position j) -> the logits ``[V]`` it scores against the target's
    distribution of t_{a+j}."""
    import bisect
    import dataclasses

    from mtp_train.train import blocks
    from mtp_train.train.loss import LossWeights, vocab_terms

    calls, cu = [], batch.cu_seqlens

    def scored(frozen_, x, teacher, exact, lk):
        calls.append((x, teacher[1][:, 0]))
        return vocab_terms(frozen_, x, teacher, exact, lk)

    monkeypatch.setattr(blocks, "vocab_terms", scored)
    monkeypatch.setattr(head, "spec", dataclasses.replace(head.spec, block_size=size))
    with torch.no_grad():
        blocks.block_loss(head, frozen, batch, LossWeights(0.0, 1.0, size - 1, 0.8, "topk", block_lengths=lengths))
    monkeypatch.undo()
    assert len(calls) == size - 1, "one chunk: block positions 1..size-1 in order"
    out = {}
    for j, (x, rows) in enumerate(calls, 1):
        for logits, row in zip(frozen.logits(x), rows.tolist()):
            label = row + 1  # the teacher at row i is the target's distribution of t_{i+1}
            d = bisect.bisect_right(cu, label) - 1
            out[d, label - cu[d] - j, j] = logits
    return out


def test_blocks_of_drawn_lengths_train_what_a_block_of_that_length_computes(monkeypatch):
    """``train.block_lengths: uniform``: a block drawn at length L inside the trained block size scores, at positions
    1..L-1, what a block of L alone scores (and so what the drafter drafts at k = L - 1, by the test above), and
    nothing past L; the lengths come from torch's seeded generator and cover 2..B."""
    frozen = FrozenTarget.load(TINY_TARGET)
    head = _head(frozen)
    batch = _batch(frozen)
    alone = {size: _scored(monkeypatch, head, frozen, batch, size) for size in range(2, BLOCK + 1)}
    anchors = [(d, a) for d, (s, e) in enumerate(zip(batch.cu_seqlens, batch.cu_seqlens[1:])) for a in range(e - s - 1)]
    torch.manual_seed(9)
    drawn = torch.randint(2, BLOCK + 1, (len(anchors),)).tolist()
    torch.manual_seed(9)
    got = _scored(monkeypatch, head, frozen, batch, BLOCK, lengths=True)
    assert set(drawn) == set(range(2, BLOCK + 1))
    want = {(d, a, j): alone[size][d, a, j] for (d, a), size in zip(anchors, drawn) for j in range(1, size)
            if (d, a, j) in alone[size]}
    assert set(got) == set(want) and len(want) > 20
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4, msg=lambda m: f"{key}: {m}")


def test_a_draft_past_the_trained_block_is_refused():
    """k >= head.block_size drafts at block positions never trained: the recipe refuses it when loaded (``--dry-run``
    too, in one line), and the drafter refuses a head trained with fewer positions than the eval asks of it."""
    from conftest import TINY_RECIPE
    from mtp_train.errors import UserError

    proc = run_cli(TINY_RECIPE, "--dry-run", "head.kind=dflash", f"head.block_size={BLOCK}", f"eval.k=[2,{BLOCK}]")
    assert_one_line_user_error(proc, f"eval.k: k = {BLOCK} drafts", f"head.block_size {BLOCK}",
                               f"at most {BLOCK - 1}")
    engine = Engine.from_pretrained(TINY_TARGET, page_size=16, max_seqs=1)
    decoder = SpeculativeDecoder(engine, BlockDrafter(engine, _head(FrozenTarget.load(TINY_TARGET))), BLOCK)
    with pytest.raises(UserError, match=rf"^eval.k: k = {BLOCK} drafts .*head.block_size {BLOCK}"):
        decoder.generate([[0, 5, 300, 301, 302, 6]], GREEDY)


def test_blocks_in_chunks_give_the_loss_and_gradients_of_one_forward():
    """``block_loss`` a few anchors at a time (each chunk over its own documents' context rows, checkpointed: made
    again in backward) gives the loss, per-position metrics and gradients of every block in one forward."""
    import dataclasses

    from mtp_train.train.blocks import block_loss
    from mtp_train.train.data import Batch
    from mtp_train.train.loss import LossWeights

    frozen = FrozenTarget.load(TINY_TARGET)
    head = _head(frozen).train()
    h, v, k = frozen.cfg.hidden_size, frozen.cfg.vocab_size, 8
    cu = [0, 20, 27, 60]
    torch.manual_seed(1)
    n = cu[-1]
    batch = Batch(torch.randint(0, v, (n,)), torch.randn(n, h), torch.rand(n) < 0.7, torch.randn(n, k).log_softmax(-1),
                  torch.randint(0, v, (n, k)), torch.full((n,), -3.0), cu, torch.randn(n, 3 * h))
    weights = LossWeights(0.0, 1.0, BLOCK - 1, 0.8, "topk")
    runs = []
    for rows in (10**6, 4 * BLOCK):  # one chunk; chunks of 4 anchors, some across documents
        head.zero_grad()
        loss, metrics = block_loss(head, frozen, batch, dataclasses.replace(weights, block_rows=rows))
        loss.backward()
        runs.append((loss.detach(), metrics, [p.grad.clone() for p in head.parameters()]))
    (loss, metrics, grads), chunked = runs[0], runs[1:]
    for other_loss, other_metrics, other_grads in chunked:
        torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=1e-6)
        assert [(m.correct, m.count) for m in other_metrics] == [(m.correct, m.count) for m in metrics]
        torch.testing.assert_close(torch.stack([m.loss for m in other_metrics]), torch.stack([m.loss for m in metrics]))
        for g, w in zip(other_grads, grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_the_trained_head_trains_and_keeps_its_block(dflash_run):
    head = load_head(dflash_run.parent / "run" / "heads" / "dflash")
    assert head.spec.kind == "dflash" and head.spec.block_size == BLOCK and head.spec.aux_layers == (1, 2, 3)
    log = (dflash_run.parent / "run" / "train_log.dflash.jsonl").read_text().splitlines()
    assert len(log) == 60
    import json

    first, last = json.loads(log[0]), json.loads(log[-1])
    assert len(last["top1"]) == BLOCK - 1
    assert last["loss"] < first["loss"], "sixty steps lower the loss"
    # Sixty steps learn the answers' frequent tokens at every position, not yet the context's last position: the
    # first position is not ahead of the last here (it is after 150 steps of 4,096 tokens, bench/RESULTS.md).
    assert len(last["val_top1"]) == BLOCK - 1 and min(last["val_top1"]) > 0.05


def test_a_block_is_one_draft_forward_per_step(dflash_run):
    """k drafts cost one forward per step, whatever k: the block's, the context's write folded in (a verify's rows
    are kept until then)."""
    head = load_head(dflash_run.parent / "run" / "heads" / "dflash")
    engine = Engine.from_pretrained(TINY_TARGET, page_size=16, max_seqs=1)
    decoder = SpeculativeDecoder(engine, BlockDrafter(engine, head), 4)
    decoder.generate([[0, 5, 300, 301, 302, 6]], GREEDY)
    assert decoder.timings.draft_forwards == decoder.timings.steps > 0


def test_a_mask_gate_on_inputs_is_refused_for_dflash(dflash_run):
    proc = run_cli("train", dflash_run, "train.mask_gate=input", "train.max_steps=61")
    assert_one_line_user_error(proc, "train.mask_gate")


def test_a_dflash_head_exports_in_vllms_layout(dflash_run, tmp_path):
    """vLLM's DFlashDraftModel: Qwen3 layer names without ``model.``, q/k norms, fc over three layers, no embedding
    or lm_head; the trained mask vector in mask_embedding.pt; dflash_config's 0-based target layers."""
    import json

    from safetensors.torch import load_file

    out = tmp_path / "vllm"
    proc = run_cli("export", dflash_run, "--format", "vllm", "--out", out)
    assert proc.returncode == 0, proc.stderr
    tensors = load_file(out / "model.safetensors")
    h, q, kv, inter, d = 128, 128, 64, 384, 32
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    want = {"fc.weight": (h, 3 * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
            **{f"layers.0.{k}": v for k, v in layer.items()}}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    head = load_head(dflash_run.parent / "run" / "heads" / "dflash")
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == head.spec.mask_token_id == 4095
    torch.testing.assert_close(mask["embedding"], head.mask_embedding.detach())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["head_dim"] == d
    assert config["dflash_config"] == {"mask_token_id": 4095, "target_layer_ids": [0, 1, 2]}
    assert '"num_speculative_tokens": 4' in (out / "README.md").read_text()
    proc = run_cli("export", dflash_run, "--format", "sglang", "--out", tmp_path / "sglang")
    assert_one_line_user_error(proc, "dflash", "--format vllm")
    assert not (tmp_path / "sglang").exists()


def test_a_dflash_head_of_more_than_one_layer_is_refused_for_vllm(tmp_path):
    """vLLM 0.32's DFlash loader normalises every layer's context keys with one k_norm weight row: a head of two layers
    is refused in one line and nothing is written; one layer exports (docs/export.md, "DFlash in vLLM")."""
    from conftest import TINY_RECIPE
    from mtp_train.features.manifest import target_fingerprint
    from mtp_train.train.checkpoint import save_head

    frozen = FrozenTarget.load(TINY_TARGET)
    for layers in (2, 1):
        spec = head_spec("dflash", layers, frozen.cfg, target_fingerprint(TINY_TARGET), aux_layers=(1, 2, 3),
                         block_size=BLOCK, mask_token_id=7)
        run = tmp_path / f"run{layers}"
        save_head(run / "heads" / "dflash", build_head(spec), {})
        out = tmp_path / f"vllm{layers}"
        proc = run_cli("export", TINY_RECIPE, f"output_dir={run}", "head.kind=dflash", f"head.num_layers={layers}",
                       f"head.block_size={BLOCK}", "--format", "vllm", "--out", out)
        if layers == 2:
            assert_one_line_user_error(proc, "dflash head of 2 layers", "vLLM", "k_norm", "head.num_layers=1")
            assert not out.exists() and not (run / "export").exists()
        else:
            assert proc.returncode == 0, proc.stderr
            assert (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_vllm_serves_the_exported_dflash_head_as_this_runtime_does(dflash_run, tmp_path):
    """vLLM's CPU build with method "dflash": its speculative output equals its plain output, and its per-position
    acceptance is this runtime's within 3%."""
    from conftest import vllm_check

    proc = vllm_check(dflash_run, tmp_path / "work", "--k", "2", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: 2/2 k within 3%" in proc.stdout
