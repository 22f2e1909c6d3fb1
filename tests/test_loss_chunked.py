"""The chunked vocabulary terms of the loss: the same loss, gradients and top-1 counts as the unchunked formula,
several chunks under a small byte bound, and index tensors on the batch's device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.models.config import ModelConfig
from mtp_train.train import loss as loss_mod
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights, _step_index, head_loss, kl_topk

VOCAB, HIDDEN, K = 96, 32, 8
DOCS = [9, 5, 14, 3, 2, 11, 7]  # short documents run out of rows at later unrolled steps


def _setup(kind: str, seed: int = 0, convention: str = "native") -> tuple[torch.nn.Module, FrozenTarget, Batch]:
    """A tiny head, frozen target and packed batch, fp32 on the CPU."""
    cfg = ModelConfig("llama", VOCAB, HIDDEN, 48, 1, 4, 2, 8, 1e-6, 128)
    torch.manual_seed(seed)
    head = build_head(head_spec(kind, 1, cfg, "fp", convention))
    frozen = FrozenTarget(cfg, torch.randn(VOCAB, HIDDEN), 1 + 0.1 * torch.randn(HIDDEN), torch.randn(VOCAB, HIDDEN))
    n = sum(DOCS)
    cu = [0]
    for d in DOCS:
        cu.append(cu[-1] + d)
    hidden = torch.randn(n, HIDDEN)
    target_logp = torch.log_softmax(frozen.logits(frozen.final_norm(hidden)), -1)
    lp, ids = target_logp.topk(K, -1)
    tail = torch.logsumexp(target_logp.scatter(-1, ids, float("-inf")), -1)
    mask = torch.rand(n) < 0.7
    batch = Batch(torch.randint(0, VOCAB, (n,)), hidden, mask, lp.bfloat16().float(), ids, tail, cu)
    return head, frozen, batch


def _reference_index(cu: list[int], step: int) -> tuple[torch.Tensor, list[int]]:
    rows, step_cu = [], [0]
    for start, stop in zip(cu[:-1], cu[1:]):
        n = max(0, stop - start - 2 - step)
        rows.append(torch.arange(start, start + n))
        step_cu.append(step_cu[-1] + n)
    return torch.cat(rows), step_cu


def _reference_loss(head, frozen, batch: Batch, weights: LossWeights) -> tuple[torch.Tensor, list[int]]:
    """The unchunked loss as it was before chunking: full ``[rows, vocab]`` log-softmax per step."""
    post_norm = head.spec.hidden_input == "post_norm"
    hidden_side = frozen.final_norm(batch.hidden) if post_norm else batch.hidden
    total, corrects = batch.hidden.new_zeros(()), []
    prev_out, prev_cu = None, None
    for j in range(weights.unroll):
        rows, step_cu = _reference_index(batch.cu_seqlens, j)
        if rows.numel() == 0:
            break
        if j == 0:
            hidden_in = hidden_side[rows]
        else:
            keep = torch.cat([torch.arange(a, a + (b2 - a2)) for a, a2, b2 in zip(prev_cu[:-1], step_cu[:-1], step_cu[1:])])
            hidden_in = prev_out[keep]
        starts = torch.tensor(batch.cu_seqlens[:-1]).repeat_interleave(torch.tensor(step_cu[1:]) - torch.tensor(step_cu[:-1]))
        positions = rows - starts + j
        out = head(frozen.embed(batch.tokens[rows + 1 + j]), hidden_in, positions, step_cu)
        # What the next step reads, and what is matched to the target's hidden: an mtp head in the vllm/sglang
        # conventions feeds back its output after shared_head.norm, every other head its raw output.
        fed = head.shared_head.norm(out) if head.spec.feedback == "head_norm" else out
        mask = batch.loss_mask[rows + 2 + j]
        prev_out, prev_cu = fed, step_cu
        if int(mask.sum()) == 0:
            corrects.append(0)
            continue
        target_rows = rows[mask] + 1 + j
        sl1 = F.smooth_l1_loss(fed[mask], hidden_side[target_rows], reduction="none").mean(-1)
        draft_logp = torch.log_softmax(frozen.logits(head.lm_head_input(out[mask])), dim=-1)
        if weights.teacher == "exact":
            target_logp = torch.log_softmax(frozen.logits(frozen.final_norm(batch.hidden[target_rows])), dim=-1)
            kl = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)
            target_top1 = target_logp.argmax(-1)
        else:
            kl = kl_topk(draft_logp, batch.topk_logprobs[target_rows], batch.topk_ids[target_rows],
                         batch.tail_logprob[target_rows])
            target_top1 = batch.topk_ids[target_rows, 0]
        step_loss = weights.w_hidden * sl1.mean() + weights.w_logits * kl.mean()
        total = total + (weights.decay**j) * step_loss
        corrects.append(int((draft_logp.argmax(-1) == target_top1).sum()))
    return total, corrects


def _loss_and_grads(fn, head, frozen, batch, weights):
    head.zero_grad(set_to_none=True)
    total, extra = fn(head, frozen, batch, weights)
    total.backward()
    return total.detach(), extra, {n: p.grad.clone() for n, p in head.named_parameters()}


@pytest.mark.parametrize("chunk_bytes", [None, VOCAB * 4 * 5], ids=["one_chunk", "rows_of_5"])
@pytest.mark.parametrize("unroll", [1, 3])
@pytest.mark.parametrize("teacher", ["topk", "exact"])
@pytest.mark.parametrize("kind, convention", [("mtp", "native"), ("mtp", "vllm"), ("mtp", "sglang"), ("eagle", "native")])
def test_chunked_loss_and_gradients_match_the_unchunked_formula(kind, convention, teacher, unroll, chunk_bytes,
                                                                monkeypatch):
    if chunk_bytes:
        monkeypatch.setattr(loss_mod, "CHUNK_BYTES", chunk_bytes)
    head, frozen, batch = _setup(kind, convention=convention)
    weights = LossWeights(w_hidden=0.5, w_logits=1.0, unroll=unroll, decay=0.8, teacher=teacher)
    ref, ref_correct, ref_grads = _loss_and_grads(_reference_loss, head, frozen, batch, weights)
    got, metrics, grads = _loss_and_grads(head_loss, head, frozen, batch, weights)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert [m.correct for m in metrics] == ref_correct and len(metrics) == unroll
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_small_byte_bound_splits_into_several_chunks_with_the_same_result(monkeypatch):
    head, frozen, batch = _setup("mtp", seed=1)
    weights = LossWeights(w_hidden=1.0, w_logits=1.0, unroll=2, decay=0.9, teacher="exact")
    whole, whole_metrics, whole_grads = _loss_and_grads(head_loss, head, frozen, batch, weights)
    sizes: list[int] = []
    chunk = loss_mod._vocab_chunk

    def counted(frozen, exact, lk, x, *teacher):
        sizes.append(len(x))
        return chunk(frozen, exact, lk, x, *teacher)

    monkeypatch.setattr(loss_mod, "_vocab_chunk", counted)
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", VOCAB * 4 * 3 + 5)  # 3 rows, not a multiple of the row size
    assert loss_mod.chunk_rows(VOCAB) == 3
    split, split_metrics, split_grads = _loss_and_grads(head_loss, head, frozen, batch, weights)
    counted_rows = sum(m.count for m in split_metrics)
    forward_sizes = sizes[: len(sizes) // 2]  # backward recomputes every chunk once more
    assert len(sizes) == 2 * len(forward_sizes) and sum(forward_sizes) == counted_rows
    assert max(sizes) == 3 and len(forward_sizes) >= counted_rows // 3 > 4
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    assert [m.correct for m in split_metrics] == [m.correct for m in whole_metrics]
    for name in whole_grads:
        torch.testing.assert_close(split_grads[name], whole_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", 1)
    assert loss_mod.chunk_rows(128_256) == 1
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", 256 * 2**20)
    assert loss_mod.chunk_rows(128_256) == 523


def test_validation_without_grad_gives_the_same_metrics():
    head, frozen, batch = _setup("eagle", seed=2)
    weights = LossWeights(w_hidden=1.0, w_logits=1.0, unroll=3, decay=0.8, teacher="topk")
    with torch.no_grad():
        total, metrics = head_loss(head, frozen, batch, weights)
        ref, ref_correct = _reference_loss(head, frozen, batch, weights)
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-6)
    assert [m.correct for m in metrics] == ref_correct


@pytest.mark.parametrize("step", [0, 1, 2, 12])
def test_step_index_matches_the_per_document_aranges_and_follows_the_device(step):
    cu = [0, 9, 14, 28, 31, 33, 44]
    rows, step_cu = _step_index(cu, step)
    ref_rows, ref_cu = _reference_index(cu, step)
    assert step_cu == ref_cu and torch.equal(rows, ref_rows) and rows.dtype == torch.int64
    meta_rows, _ = _step_index(cu, step, torch.device("meta"))
    assert meta_rows.device.type == "meta" and meta_rows.shape == ref_rows.shape


def test_head_loss_creates_no_tensor_off_the_batch_device():
    """With the default device set to ``meta``, any tensor made without an explicit device would land there and
    mix with the CPU batch; the loss and its gradients stay on the batch's device."""
    head, frozen, batch = _setup("mtp", seed=3)
    weights = LossWeights(w_hidden=1.0, w_logits=1.0, unroll=3, decay=0.8, teacher="topk")
    with torch.device("meta"):
        total, metrics = head_loss(head, frozen, batch, weights)
        total.backward()
    assert total.device == batch.tokens.device and all(m.loss.device == batch.tokens.device for m in metrics)
    assert all(p.grad.device == batch.tokens.device for p in head.parameters())


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_the_mask_gate_counts_the_label_or_the_token_two_before_it(kind):
    """``train.mask_gate``: ``label`` counts the prediction of t_i where loss_mask[i] is set, ``input`` (SpecForge's
    alignment) where loss_mask[i - 2] is; every unrolled step, both losses. Validation counts labels either way."""
    from mtp_train.train.ttt import ttt_loss

    head, frozen, batch = _setup("mtp", seed=4)
    loss_fn = head_loss
    if kind == "eagle3":
        cfg = frozen.cfg
        head = build_head(head_spec("eagle3", 1, cfg, "x", aux_layers=(0, 0, 0), draft_vocab=VOCAB))
        batch.aux = torch.randn(batch.num_tokens, 3 * HIDDEN)
        loss_fn = ttt_loss
    counts = {}
    for gate in (0, 2):
        weights = LossWeights(w_hidden=1.0, w_logits=1.0, unroll=3, decay=0.8, teacher="topk", gate_offset=gate)
        with torch.no_grad():
            counts[gate] = [m.count for m in loss_fn(head, frozen, batch, weights)[1]]
    for j in range(3):
        rows, _ = _reference_index(batch.cu_seqlens, j)
        assert counts[0][j] == int(batch.loss_mask[rows + 2 + j].sum())
        assert counts[2][j] == int(batch.loss_mask[rows + j].sum())
    assert counts[0] != counts[2]
    from mtp_train.train.objective import validate

    as_label = validate(head, frozen, [batch], LossWeights(1.0, 1.0, 3, 0.8, "topk", gate_offset=0))
    assert validate(head, frozen, [batch], LossWeights(1.0, 1.0, 3, 0.8, "topk", gate_offset=2)) == as_label
