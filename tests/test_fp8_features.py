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
    assert torch.equal(fast.tokens, ref.tokens) and torch.equal(fast.topk_ids, ref.topk_ids)
    for a, b in ((fast.hidden, ref.hidden), (fast.aux, ref.aux)):
        assert 0 < ((a - b).norm() / b.norm()).item() < 0.04  # e4m3's 3 mantissa bits against bf16's 7


def test_another_hidden_dtype_over_existing_features_is_refused_until_overwrite(features):
    recipe, root = features["bf16"]
    assert_one_line_user_error(run_precompute_cli(recipe, "precompute.hidden_dtype=fp8"), "recipe field(s) hidden_dtype",
                               "--overwrite")
    assert json.loads((root / "manifest.json").read_text())["hidden_dtype"] == "bfloat16", "nothing was touched"
