"""``head.window``: a draft head that attends to its last ``window`` positions only, the same in training (document
causal here; training-time test in tests/test_eagle3.py, dflash blocks in tests/test_dflash.py) as in the runtime's
paged drafting (chains, trees, blocks), which reads the window's keys only; decoding with it stays lossless; the
export, and vLLM serving it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import REPO, TINY_TARGET, assert_one_line_user_error, run_cli, vllm_check
from mtp_train.eval.validation import paged_forward
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.attention import DocumentCausalAttention, causal_ranges, range_attention
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.runtime.attention import TorchAttention
from mtp_train.runtime.batch import TreeMask, build_batch
from mtp_train.runtime.drafters import HeadDrafter, head_drafter
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.speculative import SpeculativeDecoder
from mtp_train.runtime.tree import TreeShape
from mtp_train.train.checkpoint import load_head
from test_speculative import GREEDY, decode, prompts, reference  # noqa: F401
from test_tree import _tree_decode

WINDOW = 16


def _dense(q, k, v, cu, window, shift=0):
    """SDPA per document with a dense sliding mask: row i (position i + shift) sees rows j <= i above i + shift - w."""
    parts = []
    for s, e in zip(cu[:-1], cu[1:]):
        i, j = torch.arange(e - s)[:, None], torch.arange(e - s)[None, :]
        mask = (j <= i) & (j > i + shift - window)
        parts.append(F.scaled_dot_product_attention(q[None, s:e].transpose(1, 2), k[None, s:e].transpose(1, 2),
                                                    v[None, s:e].transpose(1, 2), attn_mask=mask,
                                                    enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(parts)


@pytest.mark.parametrize("shift", [0, 2])
def test_windowed_ranges_equal_a_dense_sliding_mask_forward_and_backward(shift):
    torch.manual_seed(0)
    cu = [0, 23, 30, 61]
    q = torch.randn(61, 4, 8, requires_grad=True)
    k, v = (torch.randn(61, 2, 8, requires_grad=True) for _ in range(2))
    got = range_attention(q, k, v, causal_ranges(cu, 5, shift))
    want = _dense(q, k, v, cu, 5, shift)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _random(kind: str, frozen: FrozenTarget, window: int):
    torch.manual_seed(0)
    aux = (1, 2, 3) if kind == "eagle3" else ()
    head = build_head(head_spec(kind, 1, frozen.cfg, "x", aux_layers=aux, draft_vocab=512, window=window)).eval()
    for p in head.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    return head


@pytest.mark.parametrize("kind, target", [("mtp", TINY_TARGET), ("eagle", TINY_TARGET),
                                          ("mtp", REPO / "recipes" / "tiny-deepseek" / "target")])
def test_the_windowed_training_forward_is_the_runtimes_paged_one(kind, target):
    """Packed documents longer than the window: the trainer's forward and the runtime's paged K/V and attention
    (pages of 4 tokens, the window's keys gathered) agree, and differ from full attention; on the tiny DeepSeek
    target too, whose head's latent attention takes the window in its absorbed form."""
    frozen = FrozenTarget.load(target)
    head = _random(kind, frozen, WINDOW)
    cu = [0, 41, 50, 87]
    positions = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1], cu[1:])])
    embeds = torch.randn(87, frozen.cfg.hidden_size)
    hidden = torch.randn(87, frozen.cfg.hidden_size)
    engine = Engine.from_pretrained(target, page_size=4)
    with torch.no_grad():
        trained = head(embeds, hidden, positions, cu)
        paged = paged_forward(HeadDrafter(engine, head))(embeds, hidden, positions, cu)
        full = head.run(embeds, hidden, positions, DocumentCausalAttention(cu), [(None, None)] * len(head.layers))
    torch.testing.assert_close(paged, trained, rtol=1e-4, atol=1e-4)
    assert (full - trained).abs().max() > 1e-2, "the window changes what rows past it compute"


def _windowed(request, kind: str):
    run = request.getfixturevalue("trained_run" if kind == "mtp" else f"{kind}_run")
    head = load_head(run.parent / "run" / "heads" / kind)
    head.spec = dataclasses.replace(head.spec, window=WINDOW)
    return head


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "dflash"])
def test_decoding_with_a_windowed_head_is_lossless(prompts, reference, request, kind):  # noqa: F811
    """Prompts of 30 to 150 tokens, a window of 16: chains (k = 3) give the target's own greedy output."""
    head = _windowed(request, kind)
    out = decode(prompts, lambda e: head_drafter(e, head), 3, 8)
    assert [r.tokens for r in out] == reference
    assert sum(a for r in out for a in r.stats.accepted) > 0, "the windowed head still drafts tokens that are accepted"


def test_a_windowed_draft_holds_the_windows_pages_only(prompts, reference, request):  # noqa: F811
    """Prompts of up to 150 tokens in pages of 4, a window of 16 at k = 3: past the prefill each sequence holds at
    most the pages of its window and a step's drafts, the stand-in page in place of the rest, and gives all back."""
    head = _windowed(request, "mtp")
    engine = Engine.from_pretrained(TINY_TARGET, page_size=4, max_seqs=8)
    decoder = SpeculativeDecoder(engine, head_drafter(engine, head), 3)
    alloc = decoder.drafter.allocator
    held = []

    def count(seqs):
        held.extend(sum(p != alloc.stand_in for p in s.draft_pages.pages) for s in seqs if s.output)

    out = decoder.generate(prompts, GREEDY, on_step=count)
    assert [r.tokens for r in out] == reference
    assert max(len(p) for p in prompts) > 100 and held and max(held) <= (WINDOW + 3 + 1) // 4 + 2
    assert alloc.num_free == alloc.num_pages


def test_a_windowed_tree_of_topk_1_is_the_windowed_chain_step_for_step(prompts, reference, request):  # noqa: F811
    """The tree's nodes see the window of their own positions (not of their slots): a tree of topk 1 drafts what
    the chain drafts, and a wide tree stays lossless."""
    head = _windowed(request, "mtp")
    params = [SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(), seed=i) for i in range(8)]
    chain = decode(prompts[:8], lambda e: head_drafter(e, head), 3, 8, params=params)
    tree = _tree_decode(prompts[:8], lambda e: head_drafter(e, head), TreeShape(1, 3, 4), 8, params=params)
    assert [r.stats.accepted for r in tree] == [r.stats.accepted for r in chain]
    wide = _tree_decode(prompts, lambda e: head_drafter(e, head), TreeShape(4, 4, 8), 8)
    assert [r.tokens for r in wide] == reference


@pytest.mark.parametrize("case", ["prefill", "verify", "block", "tree"])
def test_the_runtimes_window_reads_what_a_dense_mask_reads(case):
    """The torch backend's windowed attention against SDPA over every cached key with a dense mask, two sequences
    on scattered pages of 4: a causal prefill and verify, a non-causal block, and a tree of 2 levels of 3 nodes,
    whose positions (depths) are not its slots, so the window is taken from positions."""
    torch.manual_seed(0)
    window, size, heads, kv_heads, dim = 6, 4, 4, 2, 8
    cached, new = {"prefill": ([0, 0], [19, 11]), "verify": ([17, 9], [4, 4]), "block": ([17, 9], [5, 5]),
                   "tree": ([17, 9], [6, 6])}[case]
    lens = [c + n for c, n in zip(cached, new)]
    order = torch.randperm(16).tolist()
    pages = [order[:6], order[6:12]]
    positions = tree = None
    if case == "tree":  # level 1 at the context's next position, level 2 after it; each sees its parent and itself
        positions = torch.tensor([c + d for c in cached for d in (0, 0, 0, 1, 1, 1)])
        bits = torch.zeros(6, 6, dtype=torch.bool)
        for i in range(6):
            bits[i, i] = True
            if i >= 3:
                bits[i, i - 3] = True
        tree = TreeMask(cached, [bits, bits])
    meta = build_batch([[0] * n for n in new], cached, pages, size, torch.device("cpu"), positions, tree)
    k_cache, v_cache = torch.randn(16, size, kv_heads, dim), torch.randn(16, size, kv_heads, dim)
    q, k, v = torch.randn(sum(new), heads, dim), torch.randn(sum(new), kv_heads, dim), torch.randn(sum(new), kv_heads, dim)
    plan = TorchAttention(window).plan(meta, heads, kv_heads, dim, causal=case != "block")
    got = plan.attend(q, k, v, k_cache, v_cache)
    row = 0
    for b, (c, n, kv_len) in enumerate(zip(cached, new, lens)):
        slots = torch.tensor([pages[b][j // size] * size + j % size for j in range(kv_len)])
        keys, values = k_cache.view(-1, kv_heads, dim)[slots], v_cache.view(-1, kv_heads, dim)[slots]
        key_pos = torch.arange(kv_len)
        q_pos = meta.positions[row : row + n]
        seen = key_pos[None, :] > q_pos[:, None] - window
        if case == "tree":
            seen &= key_pos[None, :] < c
            seen[:, c:] = tree.bits[b]
        elif case != "block":
            seen &= key_pos[None, :] <= (c + torch.arange(n))[:, None]
        want = F.scaled_dot_product_attention(q[None, row : row + n].transpose(1, 2), keys[None].transpose(1, 2),
                                              values[None].transpose(1, 2), attn_mask=seen,
                                              enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(got[row : row + n], want, rtol=1e-5, atol=1e-5)
        row += n


def _windowed_run(run, tmp):
    """A copy of a tiny run (features and head) whose head and recipe take ``head.window`` WINDOW."""
    shutil.copytree(run.parent / "run", tmp / "run")
    recipe = yaml.safe_load(run.read_text())
    recipe["output_dir"] = str(tmp / "run")
    recipe["head"]["window"] = WINDOW
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    config = tmp / "run" / "heads" / recipe["head"]["kind"] / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "window": WINDOW}))
    return tmp / "recipe.yaml"


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_the_export_writes_the_window_where_each_engine_reads_it(eagle3_run, dflash_run, trained_run, tmp_path, fmt):
    recipe = _windowed_run(eagle3_run, tmp_path / "eagle3")
    assert run_cli("export", recipe, "--format", fmt, "--out", tmp_path / fmt).returncode == 0
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    assert (layer["layer_types"], layer["sliding_window"]) == (["sliding_attention"], WINDOW)
    if fmt == "sglang":
        assert f"--speculative-draft-window-size {WINDOW}" in (tmp_path / fmt / "README.md").read_text()
    if fmt == "vllm":
        recipe = _windowed_run(dflash_run, tmp_path / "dflash")
        assert run_cli("export", recipe, "--format", "vllm", "--out", tmp_path / "d").returncode == 0
        config = json.loads((tmp_path / "d" / "config.json").read_text())
        assert config["dflash_config"]["use_swa"] is True and config["dflash_config"]["swa_window_size"] == WINDOW
        assert "layer_types" not in config  # (vLLM would take a sliding layer of its types as causal)
    recipe = _windowed_run(trained_run, tmp_path / "mtp")
    assert_one_line_user_error(run_cli("export", recipe, "--format", "sglang", "--out", tmp_path / "m"),
                               "head.window 16", "runs no sliding window in its mtp drafts")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_vllm_serves_the_exported_windowed_head_as_this_runtime_does(request, tmp_path, kind):
    """The window as vLLM 0.32 runs it (eagle3: a sliding Llama layer; dflash: a non-causal sliding layer) accepts
    what this runtime's does, prompts longer than the window."""
    recipe = _windowed_run(request.getfixturevalue(f"{kind}_run"), tmp_path)
    proc = vllm_check(recipe, tmp_path / "work", "--k", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS: 1/1 k within 3%" in proc.stdout
