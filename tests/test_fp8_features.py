"""FP8 hidden states on disk (``precompute.hidden_dtype: fp8``): e4m3 with a float32 scale per token and layer,
read back by the trainer's numpy path exactly as torch reads it, recorded in the manifest and fingerprinted, about
half of bf16's bytes; bf16 features keep their fingerprint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import assert_one_line_user_error
from mtp_train.features.reader import FeatureReader
from mtp_train.features.space import bytes_per_token
from mtp_train.features.tensors import FP8_MAX, dequantize_fp8, dequantize_fp8_numpy, quantize_fp8
from mtp_train.features.verify import verify
from mtp_train.train.data import load_batch, pack_per_sequence
from precompute_helpers import make_recipe, run_precompute_cli, sgd_rows, write_jsonl


def test_e4m3_rows_keep_their_relative_precision_and_read_back_the_same_in_numpy():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 3, 256, generator=g) * torch.logspace(-3, 2, 64).view(64, 1, 1)
    hidden[5, 1, 7] = 900.0  # an outlier channel, as LLM residual streams have
    hidden[9, 2] = 0.0
    values, scale = quantize_fp8(hidden)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (64, 3) and scale.dtype == torch.float32
    back = dequantize_fp8(values, scale)
    bound = hidden.abs() * 2**-4 + scale.unsqueeze(-1) * 2**-9  # half an e4m3 step, normal or subnormal
    assert ((back - hidden).abs() <= bound).all()
    assert values.float().abs().amax(-1)[scale != 1].eq(FP8_MAX).all(), "every row uses e4m3's whole range"
    assert torch.equal(back[9, 2], torch.zeros(256)) and scale[9, 2] == 1
    numpy = dequantize_fp8_numpy(values.view(torch.uint8).numpy(), scale.numpy())
    assert np.array_equal(numpy.view(np.uint32), back.numpy().view(np.uint32)), "the same float32 bits"


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8")
    data = write_jsonl(tmp / "sgd.jsonl", sgd_rows(40))
    out = {}
    for dtype in ("bf16", "fp8"):
        (tmp / dtype).mkdir()
        recipe = make_recipe(tmp / dtype, data, precompute={"hidden_dtype": dtype})
        proc = run_precompute_cli(recipe)
        assert proc.returncode == 0, proc.stderr
        out[dtype] = (recipe, tmp / dtype / "run" / "features")
    return out


def test_fp8_features_are_recorded_verified_and_half_the_bytes(features):
    (_, bf16), (_, fp8) = features["bf16"], features["fp8"]
    m8, m16 = (json.loads((root / "manifest.json").read_text()) for root in (fp8, bf16))
    assert m8["hidden_dtype"] == "float8_e4m3fn" and m8["settings"]["hidden_dtype"] == "fp8"
    assert m16["hidden_dtype"] == "bfloat16" and "hidden_dtype" not in m16["settings"], "bf16 keeps its fingerprint"
    assert m8["fingerprint"]["settings"] != m16["fingerprint"]["settings"]
    assert verify(fp8)[0] == [] and verify(bf16)[0] == []
    with safe_open(fp8 / m8["shards"][0]["file"], framework="pt") as f:
        assert f.get_slice("hidden").get_dtype() == "F8_E4M3"
        assert f.get_slice("hidden_scale").get_shape() == [m8["shards"][0]["num_tokens"], 2]
    layers, hidden, k = len(m8["layers"]), m8["hidden_size"], m8["topk"]
    for manifest, dtype in ((m8, "fp8"), (m16, "bf16")):
        planned = bytes_per_token(layers, hidden, k, dtype)
        assert planned <= manifest["totals"]["bytes_per_token"] < planned * 1.03, dtype  # + headers, cu_seqlens
    assert m8["totals"]["bytes"] / m16["totals"]["bytes"] < 0.6


def test_fp8_batches_read_back_exactly_and_close_to_bf16(features):
    fp8, bf16 = FeatureReader(features["fp8"][1]), FeatureReader(features["bf16"][1])
    refs = [fp8.train[i] for i in range(8)]
    fast, plain = load_batch(fp8, refs, 4096, torch.float32, aux=(0,)), pack_per_sequence(fp8, refs, 4096, torch.float32)
    assert torch.equal(fast.hidden, plain.hidden) and torch.equal(fast.topk_logprobs, plain.topk_logprobs)
    ref = load_batch(bf16, [bf16.train[i] for i in range(8)], 4096, torch.float32, aux=(0,))
    assert torch.equal(fast.tokens, ref.tokens)
    # Two precompute runs of one target: the same teacher, but a near tie among the top-K may swap its order (the
    # runs batch differently). Every other id matches, and where one differs its logprob ties with the other run's.
    swapped = fast.topk_ids != ref.topk_ids
    assert swapped.float().mean().item() < 0.01
    assert torch.allclose(fast.topk_logprobs[swapped], ref.topk_logprobs[swapped], atol=1e-2)
    for a, b in ((fast.hidden, ref.hidden), (fast.aux, ref.aux)):
        assert 0 < ((a - b).norm() / b.norm()).item() < 0.04  # e4m3's 3 mantissa bits against bf16's 7


def test_another_hidden_dtype_over_existing_features_is_refused_until_overwrite(features):
    recipe, root = features["bf16"]
    assert_one_line_user_error(run_precompute_cli(recipe, "precompute.hidden_dtype=fp8"), "recipe field(s) hidden_dtype",
                               "--overwrite")
    assert json.loads((root / "manifest.json").read_text())["hidden_dtype"] == "bfloat16", "nothing was touched"


class HiddenOnTheHost:
    """Every tensor torch's ops make while active (``TorchDispatchMode``), noting the most rows of any float
    ``[rows, L, H]`` one: a shard's hidden states in full precision, where they are more rows than one batch."""

    def __init__(self, layers: int, hidden: int) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        shape, found = (layers, hidden), self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if (isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
                            and t.dim() == 3 and tuple(t.shape[1:]) == shape):
                        found.most_rows = max(found.most_rows, t.shape[0])
                return out

        self.mode, self.most_rows = Mode(), 0


def test_fp8_precompute_never_holds_a_shards_float_hidden_and_stores_the_same_bytes(tmp_path):
    """In fp8, each scored batch is quantized where it was computed, before it reaches the host: no float
    ``[T, L, H]`` of a shard's T tokens is ever made (only of a batch's), and the shards hold the bytes that
    quantizing the whole shard's float32 hidden states gives (same e4m3 values, same scales)."""
    from safetensors.torch import load_file

    from mtp_train.features.reader import FeatureReader
    from mtp_train.features.tensors import stored_hidden
    from mtp_train.precompute.run import run_precompute
    from mtp_train.recipe import load_recipe
    from mtp_train.runtime.engine import Engine

    data = write_jsonl(tmp_path / "sgd.jsonl", sgd_rows(12))
    recipe = load_recipe(make_recipe(tmp_path, data, precompute={"hidden_dtype": "fp8", "batch_tokens": 256,
                                                                 "shard_tokens": 1200}))
    hidden_size = json.loads((recipe.target.path / "config.json").read_text())["hidden_size"]
    watch = HiddenOnTheHost(2, hidden_size)
    with watch.mode:
        manifest = run_precompute(recipe)
    assert 0 < watch.most_rows <= 256, f"a float hidden of {watch.most_rows} rows on the host (batches: 256 tokens)"
    reader = FeatureReader(recipe.features_dir)
    engine = Engine.from_pretrained(recipe.target.path, max_batch_tokens=256)
    assert max(s.num_tokens for s in manifest.shards) > 256, "each shard spans several batches"
    for entry in manifest.shards:
        seqs = [reader.load(r)["input_ids"].tolist() for r in reader.sequences if r.shard == entry.file]
        full = engine.score(seqs, layers=manifest.layers, topk=manifest.topk).hidden  # float32 [T, L, H]
        before = stored_hidden(full, manifest.hidden_dtype)  # what quantizing the whole shard on the host stored
        stored = load_file(recipe.features_dir / entry.file)
        for name in ("hidden", "hidden_scale"):
            assert torch.equal(stored[name].view(torch.uint8), before[name].view(torch.uint8)), (entry.file, name)


def test_the_fast_dequantizer_gives_the_tables_float32_bits_for_every_e4m3_value_and_scale():
    """All 256 e4m3 bit patterns (NaN and -0 included) times scales from subnormal to infinite, in rows of a
    strided view as the loader passes them: the same float32 bits as the 256-entry table times the scale."""
    from mtp_train.features.tensors import FP8_VALUES

    scales = np.asarray([1.0, 2.0**-149, 1e-30, 0.37, 255.9, 256.0, 1e5, 3e38, np.inf, np.nan, -2.5, 0.0],
                        np.float32)
    values = np.tile(np.arange(256, dtype=np.uint8), (len(scales), 3, 1))  # [S, 3 layers, 256]
    for layer in (slice(None), -1):
        v, s = values[:, layer], np.broadcast_to(scales[:, None], (len(scales), 3))[:, layer]
        with np.errstate(over="ignore", invalid="ignore"):
            want = FP8_VALUES[v] * s[..., None]
        got = dequantize_fp8_numpy(v, np.ascontiguousarray(s))
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_quantizing_a_batch_a_few_rows_at_a_time_gives_the_bytes_of_it_at_once(monkeypatch):
    """On the device a scoring batch is quantized ``QUANTIZE_ROWS`` tokens at a time (its float32 temporaries that
    size): every value and scale is the one the whole batch gets at once."""
    from mtp_train.features import tensors

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(100, 2, 64, generator=g) * torch.rand(100, 2, 1, generator=g) * 30).to(torch.bfloat16)
    x[7] = 0
    whole_values, whole_scale = tensors.quantize_fp8(x)
    monkeypatch.setattr(tensors, "QUANTIZE_ROWS", 16)
    values, scale = tensors.quantize_fp8(x)
    assert torch.equal(values.view(torch.uint8), whole_values.view(torch.uint8)) and torch.equal(scale, whole_scale)
    assert torch.equal(scale[7], torch.ones(2))
