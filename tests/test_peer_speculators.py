"""bench/peers/speculators_run.py: the capture for speculators 0.9.0 stores the residual entering its aux blocks and the
final state before the norm, as transformers computes them, and (slow, with ``make speculators``) speculators trains
on it and writes a head with our draft vocabulary."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
from hf_models import imported_head_decodes_losslessly, peer_inputs

REPO = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
SCRIPT = REPO / "bench" / "peers" / "speculators_run.py"


def _load_runner():
    spec = importlib.util.spec_from_file_location("speculators_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_llama(layers: int = 8, vocab: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def _block_output(model, ids: torch.Tensor, block: int) -> torch.Tensor:
    """The residual after ``block``, from a hook on that block alone."""
    kept = []
    handle = model.model.layers[block].register_forward_hook(lambda _m, _a, out: kept.append(out))
    with torch.no_grad():
        model(input_ids=ids[None])
    handle.remove()
    return (kept[0][0] if isinstance(kept[0], tuple) else kept[0])[0]


def test_capture_is_the_residual_entering_speculators_aux_blocks_then_the_pre_norm_state() -> None:
    runner = _load_runner()
    assert runner.aux_layer_ids(30) == [2, 15, 27] and runner.aux_layer_ids(8) == [2, 4, 5]
    model = _tiny_llama()
    ids = torch.randint(0, 128, (11,))
    states = runner.capture_states(model, ids, [2, 4, 5])
    with torch.no_grad():
        hf = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    assert states.shape == (11, 4, 32)
    # id k is the residual entering block k: transformers' hidden_states[k] for k < L.
    for slot, k in enumerate([2, 4, 5]):
        torch.testing.assert_close(states[:, slot], hf[k][0], rtol=0, atol=0)
    # The last slot is the output of the last block before the final norm; transformers' last entry is after it.
    torch.testing.assert_close(states[:, 3], _block_output(model, ids, 7), rtol=0, atol=0)
    torch.testing.assert_close(model.model.norm(states[:, 3]), hf[8][0], rtol=0, atol=0)
    assert not torch.allclose(states[:, 3], hf[8][0])
    # Id L (the block count) is that same pre-norm state; id 0 is the embedding.
    ends = runner.capture_states(model, ids, [0, 8])
    torch.testing.assert_close(ends[:, 0], hf[0][0], rtol=0, atol=0)
    torch.testing.assert_close(ends[:, 1], states[:, 3], rtol=0, atol=0)


def test_write_features_is_speculators_file_layout(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    runner = _load_runner()
    model = _tiny_llama()
    rows = [{"input_ids": [1, 5, 9, 13, 7], "loss_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [2, 4] * 4, "loss_mask": [1] * 8}]
    size, tokens = runner.write_features(model, rows, tmp_path, [2, 4, 5])
    files = sorted((tmp_path / "hidden_states").iterdir())
    assert [f.name for f in files] == ["hs_0.safetensors", "hs_1.safetensors"]
    assert tokens == 13 and size == sum(f.stat().st_size for f in files)
    record = load_file(files[1])
    assert record["token_ids"].dtype == torch.int64 and record["token_ids"].tolist() == [2, 4] * 4
    assert record["hidden_states"].shape == (8, 4, 32) and record["hidden_states"].dtype == torch.float32
    torch.testing.assert_close(record["hidden_states"], runner.capture_states(model, record["token_ids"], [2, 4, 5]))
    runner.write_token_freq(rows, tmp_path / "token_freq.pt")  # counts of the loss-masked ids only
    assert torch.load(tmp_path / "token_freq.pt") == {9: 1, 13: 1, 7: 1, 2: 4, 4: 4}


def _tiny_target(path: Path) -> None:
    """An 8-block Llama (aux ids [2, 4, 5], distinct) with a word-level tokenizer, which speculators loads."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    _tiny_llama().save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t2", pad_token="t2").save_pretrained(path)


@pytest.mark.slow
@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(), reason="no .venv-speculators (make speculators)")
def test_speculators_run_trains_and_writes_a_head(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    _tiny_target(tmp_path / "target")
    peer_inputs(tmp_path)  # tokens.jsonl, vocab.safetensors (a 64-id draft vocabulary)
    job = {"target": str(tmp_path / "target"), "tokens": str(tmp_path / "tokens.jsonl"),
           "vocab": str(tmp_path / "vocab.safetensors"), "max_length": 32, "ttt_steps": 2, "lr": 1e-3,
           "optimizer": "adamw", "total_steps": 4, "seq_len": 64, "seed": 0, "threads": 1, "out": str(tmp_path / "out")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([str(SPECULATORS_PYTHON), str(SCRIPT), str(tmp_path / "job.json")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    # 4 rows of 32 tokens, 2 per packed step of 64: 2 steps an epoch, so 4 steps take 2 epochs, every step full.
    assert result["steps"] == 4 and result["epochs"] == 2 and result["tokens_trained"] == 4 * 64
    assert result["feature_tokens"] == 4 * 32 and len(result["loss"]) == 4
    assert result["config"]["aux_layer_ids"] == [2, 4, 5] and result["config"]["draft_vocab_size"] == 64
    head = json.loads((tmp_path / "out" / "vllm" / "config.json").read_text())
    assert head["speculators_model_type"] == "eagle3" and head["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert head["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
    with safe_open(tmp_path / "out" / "vllm" / "model.safetensors", "pt") as f:
        ours = load_file(tmp_path / "vocab.safetensors")  # the even ids
        assert torch.equal(f.get_tensor("d2t"), ours["d2t"]) and torch.equal(f.get_tensor("t2d"), ours["t2d"])
        assert f.get_tensor("lm_head.weight").shape == (64, 32) and f.get_tensor("fc.weight").shape == (32, 96)
    # speculators' own file imported (its norms, window and aux ids as written): it drafts here, losslessly
    imported = imported_head_decodes_losslessly(tmp_path / "out" / "vllm", tmp_path / "target")
    assert imported.spec.aux_layers == (2, 4, 5)
    assert (imported.spec.norm_before_fc, imported.spec.norm_before_residual) == (
        bool(head.get("norm_before_fc")), bool(head.get("norm_before_residual")))


@pytest.mark.slow
@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(), reason="no .venv-speculators (make speculators)")
def test_vllm_serves_a_speculators_head_as_this_runtime_runs_its_import(tmp_path: Path) -> None:
    """speculators trains a head on the tiny target's own answers to the eval prompts (so that it accepts) and writes
    its own format; vLLM serves that file as written, this runtime the head `mtp-train import` made of it
    (``bench/vllm_check.py --head imported/NAME``): the same accepted counts at every draft position."""
    from peer_serving import assert_vllm_counts_equal_the_import, peer_target_rows

    target, recipe, length = peer_target_rows(tmp_path)
    job = {"target": str(target), "tokens": str(tmp_path / "tokens.jsonl"),
           "vocab": str(tmp_path / "vocab.safetensors"), "max_length": length, "ttt_steps": 3, "lr": 1e-2,
           "optimizer": "adamw", "total_steps": 40, "seq_len": 2 * length, "seed": 0, "threads": 2,
           "out": str(tmp_path / "speculators")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([str(SPECULATORS_PYTHON), str(SCRIPT), str(tmp_path / "job.json")], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_vllm_counts_equal_the_import(recipe, tmp_path / "speculators" / "vllm", tmp_path / "work")
