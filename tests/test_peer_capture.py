"""bench/peers: the offline EAGLE-3 capture for SpecForge equals transformers' ``output_hidden_states``, and (slow,
with ``make peers``) SpecForge trains on it and exports a head with our draft vocabulary."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
from hf_models import imported_head_decodes_losslessly, peer_inputs

REPO = Path(__file__).resolve().parents[1]
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"


def _load_capture():
    spec = importlib.util.spec_from_file_location("peer_capture", REPO / "bench" / "peers" / "capture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_llama(layers: int = 6, vocab: int = 128, tied: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def test_capture_is_output_hidden_states_at_specforge_layers(tmp_path: Path) -> None:
    capture = _load_capture()
    model = _tiny_llama()
    assert capture.capture_layers(6) == [1, 2, 2]
    assert capture.capture_layers(30) == [1, 14, 26]
    ids = torch.randint(0, 128, (2, 11))
    aux, last = capture.capture(model, ids, layers=[1, 2, 3])
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    assert aux.shape == (2, 11, 96) and last.shape == (2, 11, 32)
    # Output of block k is hidden_states[k + 1]; the last entry is the final normed state.
    torch.testing.assert_close(aux, torch.cat([states[2], states[3], states[4]], dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(last, states[6], rtol=0, atol=0)
    torch.testing.assert_close(last, model.model.norm(_block_output(model, ids, 5)), rtol=0, atol=0)


def _block_output(model, ids: torch.Tensor, block: int) -> torch.Tensor:
    """The residual after ``block`` (pre-norm), from a hook on that block alone."""
    kept = []
    handle = model.model.layers[block].register_forward_hook(lambda _m, _a, out: kept.append(out))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return kept[0][0] if isinstance(kept[0], tuple) else kept[0]


def test_write_features_is_specforge_offline_layout(tmp_path: Path) -> None:
    capture = _load_capture()
    model = _tiny_llama()
    rows = [{"input_ids": [1, 5, 9, 13, 7], "loss_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [2, 4] * 6, "loss_mask": [1] * 12}]
    size, tokens = capture.write_features(model, rows, tmp_path, max_length=8)
    files = sorted(tmp_path.rglob("*.ckpt"))
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["rows_0-5000/data_0.ckpt", "rows_0-5000/data_1.ckpt"]
    assert tokens == 5 + 8 and size == sum(f.stat().st_size for f in files)
    record = torch.load(files[1], weights_only=True)
    assert record["input_ids"].tolist() == [2, 4] * 4 and record["loss_mask"].dtype == torch.long
    assert record["hidden_state"].shape == (1, 8, 32) and record["aux_hidden_state"].shape == (1, 8, 96)
    aux, last = capture.capture(model, record["input_ids"][None])
    torch.testing.assert_close(record["aux_hidden_state"], aux, rtol=0, atol=0)
    torch.testing.assert_close(record["hidden_state"], last, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(not PEERS_PYTHON.exists(), reason="no .venv-peers (make peers)")
def test_specforge_run_trains_and_exports(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    target = tmp_path / "target"
    _tiny_llama(layers=8, vocab=128).save_pretrained(target)  # aux layers [1, 3, 4]: distinct
    peer_inputs(tmp_path)  # tokens.jsonl, vocab.safetensors (a 64-id draft vocabulary)
    job = {"target": str(target), "tokens": str(tmp_path / "tokens.jsonl"),
           "vocab": str(tmp_path / "vocab.safetensors"),
           "max_length": 32, "ttt_length": 2, "lr": 1e-3, "warmup_steps": 1, "total_steps": 2, "batch_size": 2,
           "seed": 0, "threads": 1, "out": str(tmp_path / "out")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    script = REPO / "bench" / "peers" / "specforge_run.py"
    proc = subprocess.run([str(PEERS_PYTHON), str(script), str(tmp_path / "job.json")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["steps"] == 2 and result["feature_tokens"] == 4 * 32 and result["tokens_trained"] == 2 * 2 * 32
    with safe_open(tmp_path / "out" / "vllm" / "model.safetensors", "pt") as f:
        ours = load_file(tmp_path / "vocab.safetensors")  # the even ids
        assert torch.equal(f.get_tensor("d2t"), ours["d2t"]) and torch.equal(f.get_tensor("t2d"), ours["t2d"])
        assert f.get_tensor("lm_head.weight").shape == (64, 32) and f.get_tensor("fc.weight").dtype == torch.float32
    # SpecForge's own export (SGLang's layout, default aux layers) imported: it drafts here, losslessly
    head = imported_head_decodes_losslessly(tmp_path / "out" / "vllm", target)
    assert head.spec.aux_layers == (2, 4, 5) and torch.equal(head.draft_ids, torch.arange(0, 128, 2))


@pytest.mark.slow
@pytest.mark.skipif(not PEERS_PYTHON.exists(), reason="no .venv-peers (make peers)")
def test_vllm_serves_a_specforge_head_as_this_runtime_runs_its_import(tmp_path: Path) -> None:
    """SpecForge trains a head on the tiny target's own answers to the eval prompts (so that it accepts), and exports
    it; vLLM serves that file as SpecForge wrote it, this runtime the head `mtp-train import` made of it
    (``bench/vllm_check.py --head imported/NAME``): the same accepted counts at every draft position."""
    from peer_serving import assert_vllm_counts_equal_the_import, peer_target_rows

    target, recipe, length = peer_target_rows(tmp_path)
    job = {"target": str(target), "tokens": str(tmp_path / "tokens.jsonl"),
           "vocab": str(tmp_path / "vocab.safetensors"), "max_length": length,
           "ttt_length": 3, "lr": 1e-2, "warmup_steps": 2, "total_steps": 40, "batch_size": 2, "seed": 0,
           "threads": 2, "out": str(tmp_path / "specforge")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([str(PEERS_PYTHON), str(REPO / "bench" / "peers" / "specforge_run.py"),
                           str(tmp_path / "job.json")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_vllm_counts_equal_the_import(recipe, tmp_path / "specforge" / "vllm", tmp_path / "work")
