"""Host syncs per decode step, counted on the fake CUDA device (``fake_cuda.FakeCudaMode.syncs``).

Each sync stalls a real GPU's queue until the host has caught up, so a speculative step must cost a fixed few
whatever the batch and k: the budget is ``SYNC_BUDGET`` per speculative step and per plain decode step. Sampling
stays on the device, and a MoE layer's decode makes no sync per expert.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import REPO, TINY_TARGET, sgd_chat_prompts
from fake_cuda import fake_cuda
from mtp_train.models.checkpoint import load_transformer
from mtp_train.runtime.drafters import DraftModelDrafter, HeadDrafter
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.speculative import SpeculativeDecoder

SYNC_BUDGET = 3
DEEPSEEK_TARGET = REPO / "recipes" / "tiny-deepseek" / "target"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return sgd_chat_prompts(8, 4)


def _params(temperature: float, n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_new_tokens=6, stop_token_ids=(), seed=s) for s in range(n)]


def _counted(monkeypatch, obj, name: str, mode, counts: list[tuple[int, list[str]]]) -> None:
    """Wrap ``obj.name`` so that each call appends the syncs it made to ``counts``."""
    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        before = len(mode.syncs)
        out = original(*args, **kwargs)
        counts.append((len(mode.syncs) - before, mode.syncs[before:]))
        return out

    monkeypatch.setattr(obj, name, wrapped)


def _random_head(engine: Engine):
    from mtp_train.heads import build_head, head_spec

    torch.manual_seed(0)
    return build_head(head_spec("mtp", 1, engine.cfg, "random"))


def _worst(counts: list[tuple[int, list[str]]]) -> tuple[int, Counter]:
    n, reasons = max(counts, key=lambda c: c[0])
    return n, Counter(reasons)


@pytest.mark.parametrize("draft", ["mtp", "draft_target"])
@pytest.mark.parametrize("batch,k,temperature", [(1, 1, 0.0), (1, 4, 0.0), (8, 1, 0.0), (8, 4, 0.0), (8, 4, 1.0)])
def test_a_speculative_step_makes_at_most_three_host_syncs(monkeypatch, prompts, draft, batch, k, temperature):
    with fake_cuda(monkeypatch) as mode:
        engine = Engine.from_pretrained(TINY_TARGET, device="cuda", page_size=16, max_seqs=batch)
        drafter = (HeadDrafter(engine, _random_head(engine)) if draft == "mtp" else
                   DraftModelDrafter(engine, load_transformer(TINY_TARGET, device="cuda")))
        decoder = SpeculativeDecoder(engine, drafter, k)
        spec: list[tuple[int, list[str]]] = []
        plain: list[tuple[int, list[str]]] = []
        _counted(monkeypatch, decoder, "_spec_step", mode, spec)
        _counted(monkeypatch, decoder, "_plain_step", mode, plain)
        decoder.generate(prompts[:batch], _params(temperature, batch))
    assert spec, "the run made speculative steps"
    worst, reasons = _worst(spec)
    assert worst <= SYNC_BUDGET, f"{worst} syncs in a speculative step: {dict(reasons)}"
    worst, reasons = _worst(plain)
    assert worst <= SYNC_BUDGET, f"{worst} syncs in a prefill step of the speculative run: {dict(reasons)}"


@pytest.mark.parametrize("target", [TINY_TARGET, DEEPSEEK_TARGET], ids=["llama", "deepseek"])
@pytest.mark.parametrize("batch,temperature", [(1, 0.0), (8, 0.0), (8, 1.0)])
def test_a_plain_decode_step_makes_at_most_three_host_syncs(monkeypatch, prompts, target, batch, temperature):
    with fake_cuda(monkeypatch) as mode:
        engine = Engine.from_pretrained(target, device="cuda", page_size=16, max_seqs=batch)
        steps: list[tuple[int, list[str]]] = []
        _counted(monkeypatch, engine, "step", mode, steps)
        engine.generate(prompts[:batch], _params(temperature, batch))
    worst, reasons = _worst(steps[1:])  # after the prefill
    assert worst <= SYNC_BUDGET, f"{worst} syncs in a decode step: {dict(reasons)}"


def test_the_counter_sees_each_kind_of_sync(monkeypatch):
    """The harness itself: reads, pageable copies and data-dependent shapes count; pinned non-blocking copies and
    device-side work do not."""
    with fake_cuda(monkeypatch) as mode:
        x = torch.arange(6.0, device="cuda")
        y = (x * 2).softmax(0).cumsum(0)
        assert mode.syncs == []
        pinned = torch.ones(3).pin_memory()
        z = pinned.to("cuda", non_blocking=True)
        assert mode.syncs == [] and z.device.type == "cuda"
        float(y[-1]), y.tolist(), y.cpu(), torch.ones(3).to("cuda"), x[torch.tensor([0, 1])], x[x > 2]
        torch.cuda.synchronize()
    assert len(mode.syncs) == 7, mode.syncs
