"""``target_distributions``: a batch of rows with different sampling settings in one batched pass.

Each row equals the one-request ``target_distribution`` of its own settings (bit for bit on the CPU), the work
does not grow with the number of rows (seeds differ between requests, and must not force a loop), and building
the per-row settings makes no host sync on the fake CUDA device.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fake_cuda import fake_cuda
from mtp_train.runtime.sampling import SamplingParams, sample, target_distribution, target_distributions

VOCAB = 300

MIXED = [
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.6, seed=1),
    SamplingParams(temperature=1.3, top_k=7, seed=2),
    SamplingParams(temperature=0.6, top_p=0.9, seed=3),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.5, seed=4),
    SamplingParams(temperature=0.0, top_k=5, top_p=0.3, seed=5),  # greedy whatever its other settings
    SamplingParams(temperature=1.0, top_k=VOCAB, top_p=1.0, seed=6),  # k = V and p = 1: both off
    SamplingParams(temperature=0.7, top_k=1, seed=7, max_new_tokens=3, stop_token_ids=(2,)),
]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    """``[rows, VOCAB]`` float32, with repeated values so that ties meet top-k's and top-p's cuts."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 3).round(decimals=1)


class OpCount(TorchFunctionMode):
    """Counts the torch calls made within, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_row_is_bit_identical_to_its_own_distribution(dtype):
    """Greedy, temperature only, top-k, top-p, both, and settings that are off, each with its own seed: every
    row of the batched result equals ``target_distribution`` of that row alone, exactly."""
    logits = _logits(len(MIXED)).to(dtype)
    batched = target_distributions(logits, MIXED)
    assert batched.shape == (len(MIXED), VOCAB) and batched.dtype == torch.float32
    for n, params in enumerate(MIXED):
        assert torch.equal(batched[n], target_distribution(logits[n : n + 1], params)[0]), (n, params)
    assert torch.equal(batched[0], torch.nn.functional.one_hot(logits[0].float().argmax(), VOCAB).float())
    assert torch.equal(batched[5], torch.nn.functional.one_hot(logits[5].float().argmax(), VOCAB).float())
    assert int((batched[2] > 0).sum()) >= 7 and int((batched[7] > 0).sum()) >= 1, "top-k keeps ties at its cut"


def test_a_row_does_not_depend_on_its_batch():
    """The same row alone, among greedy rows, and among rows of other settings gives the same bits."""
    logits = _logits(len(MIXED), seed=1)
    for n, params in enumerate(MIXED):
        alone = target_distributions(logits[n : n + 1], [params])
        assert torch.equal(alone[0], target_distributions(logits, MIXED)[n]), (n, params)
        same = target_distributions(logits, [params] * len(MIXED))
        assert torch.equal(alone[0], same[n]), (n, params)


def test_rows_that_differ_in_seed_take_one_batched_pass():
    """The number of torch calls does not grow with the number of rows, whether the rows differ only in what
    does not shape the distribution (seed, length, stop tokens) or in temperature, top-k and top-p: one
    softmax for the distribution and at most one for top-p's nucleus. (The former code looped over rows
    whenever two requests' ``SamplingParams`` differed at all, seed included.)"""
    def count(params: list[SamplingParams]) -> Counter[str]:
        logits = _logits(len(params))
        with OpCount() as ops:
            target_distributions(logits, params)
        return ops.calls

    for make in (lambda s: SamplingParams(temperature=0.6, top_p=0.9, seed=s, max_new_tokens=s + 1,
                                          stop_token_ids=(s,)),
                 lambda s: MIXED[s % len(MIXED)]):
        few, many = count([make(s) for s in range(8)]), count([make(s) for s in range(64)])
        assert few == many, (few, many)
        assert many["softmax"] <= 2 and many["sort"] <= 1 and many["topk"] <= 1, many


def test_the_per_row_settings_make_no_host_sync(monkeypatch):
    """On the fake CUDA device, eight rows of distinct seeds and mixed settings: the distributions make no sync
    (the settings reach the device in one pinned, non-blocking copy), and neither does ``sample``."""
    logits = _logits(len(MIXED))
    expected = target_distributions(logits, MIXED)
    with fake_cuda(monkeypatch) as mode:
        on_gpu = logits.to("cuda")
        start = len(mode.syncs)
        probs = target_distributions(on_gpu, MIXED)
        assert mode.syncs[start:] == [] and probs.device.type == "cuda"
        gens = [None if p.greedy else torch.Generator().manual_seed(p.seed) for p in MIXED]
        tokens = sample(on_gpu, MIXED, gens)
        assert mode.syncs[start:] == [] and tokens.device.type == "cuda"
        probs, tokens = probs.cpu(), tokens.cpu()
    assert torch.equal(probs, expected)
    assert torch.equal(tokens, sample(logits, MIXED, [None if p.greedy else torch.Generator().manual_seed(p.seed)
                                                      for p in MIXED])), "a row's draw is a function of its seed"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's kernels, on a real GPU")
def test_on_a_real_gpu_each_row_is_its_own_distribution_within_a_last_bit():
    """CUDA divides by a host scalar as a product with its reciprocal (``target_distribution``) and by a tensor
    with a true division (the batch), so a scaled logit may differ in its last bit: held within float32's
    rounding. Continuous logits, so that no tie sits at a cut."""
    logits = torch.randn(len(MIXED), 32000, generator=torch.Generator().manual_seed(0)).cuda() * 3
    batched = target_distributions(logits, MIXED)
    for n, params in enumerate(MIXED):
        reference = target_distribution(logits[n : n + 1], params)[0]
        torch.testing.assert_close(batched[n], reference, rtol=1e-5, atol=1e-7)
        assert torch.equal(batched[n] > 0, reference > 0), (n, params)
