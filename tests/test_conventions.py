"""Serving conventions (`head.convention`): the three choices per convention, recorded in the head's config, made
alike by the runtime's drafting and the trainer, and stated in the report; acceptance counted as vLLM counts it."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import TINY_TARGET, run_cli, sgd_chat_prompts
from mtp_train.eval.metrics import RequestTrace, engine_counts
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.base import HeadSpec
from mtp_train.heads.conventions import Choices, served_by, validity_line
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.drafters import HeadDrafter
from mtp_train.runtime.speculative import SpeculativeDecoder

CASES = [("mtp", "native"), ("mtp", "vllm"), ("mtp", "sglang"), ("eagle", "native"), ("eagle", "vllm")]


def test_each_convention_sets_what_the_engines_do():
    """EXPORT.md 1.1 and 2: vLLM and SGLang feed DeepSeek MTP the post-norm state and its shared_head.norm output,
    only vLLM zeroes position 0; EAGLE reads the post-norm state and feeds back its raw output everywhere."""
    cfg = Engine.from_pretrained(TINY_TARGET).cfg
    got = {(k, c): head_spec(k, 1, cfg, "fp", c).choices for k in ("mtp", "eagle") for c in ("native", "vllm", "sglang")}
    assert got[("mtp", "native")] == Choices("pre_norm", "output", True)
    assert got[("mtp", "vllm")] == Choices("post_norm", "head_norm", True)
    assert got[("mtp", "sglang")] == Choices("post_norm", "head_norm", False)
    assert {got[("eagle", c)] for c in ("native", "vllm", "sglang")} == {Choices("post_norm", "output", False)}
    assert served_by("eagle", got[("eagle", "native")], "llama") == ["vllm", "sglang"]
    assert served_by("eagle", got[("eagle", "native")], "qwen2") == []
    assert served_by("mtp", got[("mtp", "vllm")], "llama") == []
    assert served_by("mtp", got[("mtp", "vllm")], "deepseek_v3") == ["vllm"]
    assert served_by("mtp", got[("mtp", "native")], "deepseek_v3") == []
    assert "no serving engine loads an MTP layer for a llama target" in validity_line("mtp", got[("mtp", "vllm")], "llama")
    assert "EAGLE loaders build a Llama decoder layer, not a qwen2" in validity_line("eagle", got[("eagle", "vllm")],
                                                                                       "qwen2")


def test_the_config_records_the_choices_and_a_head_saved_before_them_loads_as_native():
    cfg = Engine.from_pretrained(TINY_TARGET).cfg
    spec = head_spec("mtp", 1, cfg, "fp", "sglang")
    data = json.loads(json.dumps(spec.to_json()))
    assert (data["convention"], data["hidden_input"], data["feedback"], data["zero_embed_at_position0"]) == (
        "sglang", "post_norm", "head_norm", False)
    assert HeadSpec.from_json(data, "config.json") == spec
    legacy = {k: v for k, v in head_spec("mtp", 1, cfg, "fp").to_json().items() if k not in ("convention", "feedback")}
    old = HeadSpec.from_json(legacy, "config.json")
    assert (old.convention, old.feedback, old.hidden_input) == ("native", "output", "pre_norm")


@pytest.mark.parametrize("kind, convention", CASES)
def test_the_runtimes_draft_forward_is_the_trainers(kind, convention):
    """One sequence through the drafter's paged forward equals the trainer's document-causal forward, with the
    hidden side, the position-0 embedding and the fed-back state each convention prescribes, written out here."""
    engine = Engine.from_pretrained(TINY_TARGET)
    torch.manual_seed(0)
    head = build_head(head_spec(kind, 1, engine.cfg, "fp", convention)).eval()
    with torch.no_grad():  # non-trivial norm weights, so that normed and raw states differ
        for module in head.modules():
            if hasattr(module, "weight") and module.weight.ndim == 1:
                module.weight.mul_(1 + 0.5 * torch.rand_like(module.weight))
    drafter = HeadDrafter(engine, head)
    prompt = sgd_chat_prompts(1, 1)[0]
    hidden = engine.score([prompt], layers=[-1]).hidden[:, -1].float()  # [T, H], pre-norm
    m = len(prompt) - 1
    scheduler, (seq,) = engine.start([prompt], SamplingParams(max_new_tokens=1), draft_allocator=drafter.allocator)
    drafter.allocator.reserve(seq.draft_pages, m)
    with torch.inference_mode():
        drafter.forward([drafter.feed(seq, 0, 0, drafter.features(hidden[:m], []))])
        logits, fed_back = drafter.carried[seq.request_id]

        post = {"native": kind == "eagle", "vllm": True, "sglang": True}[convention]
        zero = kind == "mtp" and convention in ("native", "vllm")
        side = engine.model.norm(hidden[:m]) if post else hidden[:m]
        embeds = engine.model.tok_embeddings(torch.tensor(prompt[1 : m + 1]))
        positions = torch.arange(m)
        out = head(embeds, side, positions, [0, m])
        if zero:
            assert torch.allclose(head(embeds.masked_fill((positions == 0)[:, None], 0.0), side, positions, [0, m]), out)
        else:  # the embedding at position 0 reaches the output: zeroing it changes it
            assert not torch.allclose(head(embeds * (positions != 0)[:, None], side, positions, [0, m])[-1], out[-1])
        normed = head.shared_head.norm(out[-1]) if kind == "mtp" else out[-1]
        want = normed if kind == "mtp" and convention != "native" else out[-1]
    torch.testing.assert_close(fed_back, want, rtol=1e-4, atol=1e-5)
    if kind == "mtp":
        assert not torch.allclose(out[-1], normed, atol=1e-3)
    torch.testing.assert_close(logits, engine.model.output(normed).float(), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_head_trained_in_vllms_convention_runs_so_in_the_eval(trained_run, tmp_path):
    """An mtp head trained with head.convention=vllm: the runtime's validation agrees with the trainer's, decoding is
    lossless, the head's config and the report say which convention and where it can be served."""
    import shutil

    recipe = yaml.safe_load(trained_run.read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["head"] = {"kind": "mtp", "convention": "vllm"}
    recipe["train"].update(max_steps=20, val_every=20, save_every=20)
    recipe["eval"].update(k=[2], max_prompts=4)
    shutil.copytree(trained_run.parent / "run" / "features", tmp_path / "run" / "features")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    for stage in ("train", "eval"):
        proc = run_cli(stage, path, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "heads" / "mtp" / "config.json").read_text())
    assert (config["convention"], config["hidden_input"], config["feedback"]) == ("vllm", "post_norm", "head_norm")
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["val_mismatch"] is False and report["lossless"] is True
    assert report["head_convention"].startswith("vllm: reads the target's hidden state after its final norm")
    assert "Valid in this runtime only" in report["serving"]


def test_engine_counts_are_vllms():
    """1 + accepted / drafts over steps that verified drafts; per position, the steps that accepted it."""
    a = RequestTrace("p/1", "c", 5, accepted=[2, 0, 1, 3], emitted=[3, 1, 2, 2], drafted=[3, 3, 3, 3])
    b = RequestTrace("p/2", "c", 5, accepted=[3, 0], emitted=[4, 1], drafted=[3, 0])
    counts = engine_counts([a, b], 3)
    assert (counts.drafts, counts.draft_tokens, counts.accepted) == (5, 15, 9)
    assert counts.accepted_per_position == [4, 3, 2]
    assert counts.mean_acceptance_length == pytest.approx(1 + 9 / 5)
    assert engine_counts([RequestTrace("p/3", "c", 5, [1], [2])], 3) is None  # not recorded
    with pytest.raises(ValueError, match="do not fit"):
        RequestTrace("p/4", "c", 5, accepted=[2], emitted=[3], drafted=[1])


def test_the_last_steps_draft_k_as_vllm_does():
    """Every verification step drafts k, the last ones too (the output is cut after acceptance), so acceptance is
    counted over the same drafts as vLLM's; the output still stops at max_new_tokens."""
    engine = Engine.from_pretrained(TINY_TARGET)
    torch.manual_seed(0)
    drafter = HeadDrafter(engine, build_head(head_spec("eagle", 1, engine.cfg, "fp")))
    params = SamplingParams(max_new_tokens=7, stop_token_ids=())
    results = SpeculativeDecoder(engine, drafter, 3).generate(sgd_chat_prompts(3, 2), params)
    for r in results:
        assert len(r.tokens) == 7
        assert r.stats.drafted == [3] * len(r.stats.accepted)
