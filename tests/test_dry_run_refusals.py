"""Every refusal a stage makes from the recipe alone (and the target's config.json) comes from ``--dry-run`` too, and
from a full run before any stage starts: one line, exit status 2, no traceback."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, TINY_TARGET, assert_one_line_user_error, run_cli, stand_in_checkpoint

TINY = str(REPO / "recipes" / "tiny.yaml")
TINY_DEEPSEEK = str(REPO / "recipes" / "tiny-deepseek.yaml")


@dataclass(frozen=True)
class Refusal:
    """A recipe a stage refuses from its fields (and the target's config.json) alone: the command line after
    ``mtp-train`` (``{name}`` stands for a stand-in checkpoint of ``stand_ins``) and what its one line holds."""

    id: str
    argv: tuple[str, ...]
    needles: tuple[str, ...]


REFUSALS = (
    # pure field relations: the recipe's validators
    Refusal("dflash-mask-gate", (TINY, "head.kind=dflash", "train.mask_gate=input"),
            ("train.mask_gate: `input` gates a chain head's steps", "dflash", "set train.mask_gate: label")),
    Refusal("compared-dflash-mask-gate", (TINY, "eval.compare=[eagle,dflash]", "train.mask_gate=input"),
            ("train.mask_gate: `input`", "eval.compare")),
    Refusal("eagle3-layers", (TINY, "head.kind=eagle3", "head.num_layers=2"),
            ("head.num_layers: an eagle3 head has one decoder layer", "set head.num_layers: 1")),
    Refusal("eagle31-norms", (TINY, "head.norm_output=true"),
            ("head.norm_output: applies to eagle3 heads only", "set head.kind: eagle3 or head.norm_output: false")),
    Refusal("parallel-drafts-k", (TINY, "head.kind=eagle3", "head.parallel_drafts=2", "train.unroll=1", "eval.k=[3]",
                                  "eval.trees=[]"), ("eval.k: k = 3 drafts past the 2 a P-EAGLE head drafts",)),
    Refusal("window-k", (TINY, "head.window=4", "eval.k=[4]", "eval.trees=[]"),
            ("head.window: 4 tokens do not exceed eval.k (4); set head.window above 4 or null",)),
    Refusal("window-block", (TINY, "head.kind=dflash", "head.window=9", "eval.k=[4]", "eval.trees=[]"),
            ("head.window: 9 tokens do not exceed head.block_size (9)",)),
    Refusal("window-peagle", (TINY, "head.kind=eagle3", "head.parallel_drafts=2", "train.unroll=1", "eval.k=[2]",
                              "eval.trees=[]", "head.window=64"), ("head.window: a P-EAGLE head",)),
    Refusal("dpace-no-dflash", (TINY, "train.dpace_alpha=0.5"), ("train.dpace_alpha: D-PACE weights a dflash head",)),
    Refusal("head-kind", (TINY, "head.kind=medusa"), ("head.kind: Input should be",)),
    Refusal("block-size", (TINY, "head.kind=dflash", "head.block_size=1"), ("head.block_size",)),
    Refusal("prompt-set", (TINY, "eval.prompt_sets=[nope]"), ("eval.prompt_sets.0",)),
    Refusal("max-prompts", (TINY, "eval.max_prompts=0"), ("eval.max_prompts",)),
    Refusal("tau-heldout", (TINY, "train.tau_every=10", "data.heldout_rows=0"),
            ("train.tau_every: the τ probe decodes held-out prompts and data.heldout_rows is 0",)),
    # the heads a run trains, as the target's config.json shapes them
    Refusal("dflash-mla", (TINY_DEEPSEEK, "head.kind=dflash", "head.aux_layers=[1,2,3]"),
            ("head: a dflash head's layers are standard attention; the deepseek_v2 target",)),
    Refusal("eagle3-mla", (TINY_DEEPSEEK, "head.kind=eagle3", "head.aux_layers=[1,2,3]"),
            ("head: an eagle3 head has one decoder layer of a target with standard attention",)),
    Refusal("mask-token-id", (TINY, "head.kind=dflash", "head.mask_token_id=4096"),
            ("head.mask_token_id: 4096 is not an id of the target's vocabulary (0..4095)",)),
    Refusal("aux-layers", (TINY, "head.kind=eagle3", "head.aux_layers=[3,2,1]"),
            ("head.aux_layers: [3, 2, 1] must be three distinct ascending ids in 1..4",)),
    Refusal("aux-default", (TINY, "head.kind=eagle3", "head.aux_layers=null"),
            ("head.aux_layers: the engines' default [2, 2, 1] for a 4-layer target",)),
    Refusal("precompute-aux-default", ("precompute", TINY, "eval.compare=[dflash]", "head.aux_layers=null"),
            ("head.aux_layers: the engines' default [2, 2, 1]",)),
    # the target's engine (precompute, online training, eval)
    Refusal("flashinfer-mla", (TINY_DEEPSEEK, "target.attention_backend=flashinfer"),
            ("target.attention_backend: flashinfer is not wired for MLA (DeepSeek) targets",)),
    Refusal("online-flashinfer-mla", ("train", TINY_DEEPSEEK, "precompute.mode=online",
                                      "target.attention_backend=flashinfer"),
            ("target.attention_backend: flashinfer is not wired for MLA",)),
    # the eval's drafts and prompts
    Refusal("target-mtp", (TINY, "eval.draft=target_mtp"),
            ("eval.draft target_mtp needs a DeepSeek-V3-layout checkpoint", "model_type 'llama'")),
    Refusal("compared-target-mtp", ("eval", TINY, "eval.compare=[target_mtp]"),
            ("eval.draft target_mtp needs a DeepSeek-V3-layout checkpoint",)),
    Refusal("no-heldout-rows", (TINY, "data.heldout_rows=0", "train.tau_every=0"),
            ("eval.prompt_sets: `heldout` needs data.heldout_rows > 0",)),
    Refusal("no-room-for-prompts", ("eval", TINY, "eval.max_new_tokens=2048"),
            ("eval.prompt_sets: no prompt fits the target's 2048 positions with eval.max_new_tokens=2048",)),
    Refusal("tp-mlp-channels", (TINY, "target.path={odd_mlp}", "target.tp=2"),
            ("target.tp: 2 does not divide the target's 383 MLP channels; choose a divisor of 383",)),
    Refusal("draft-model-vocab", ("eval", TINY, "eval.draft_model={other_vocab}"),
            ("draft model vocab 5000 differs from the target's 4096",)),
    # export: the format against the head's kind and the target's family
    Refusal("export-dflash-sglang", ("export", TINY, "--format", "sglang", "head.kind=dflash"),
            ("--format sglang:", "is a dflash head; it exports for vLLM's DFlash loader")),
    Refusal("export-peagle-sglang", ("export", TINY, "--format", "sglang", "head.kind=eagle3", "head.parallel_drafts=4",
                                     "train.unroll=1"), ("--format sglang:", "is a P-EAGLE head", "--format vllm")),
    Refusal("export-speculators-mtp", ("export", TINY, "--format", "speculators"),
            ("--format speculators:", "is an mtp head; the speculators format holds eagle3")),
    Refusal("export-window-eagle", ("export", TINY, "--format", "vllm", "head.kind=eagle", "head.window=64"),
            ("is an eagle head with head.window 64", "runs no sliding window in its eagle drafts")),
    Refusal("export-mtp-llama", ("export", TINY, "--format", "vllm"),
            ("an mtp head on a llama target cannot be exported for vLLM",)),
    Refusal("export-dflash-layers", ("export", TINY, "--format", "vllm", "head.kind=dflash", "head.num_layers=2"),
            ("a dflash head of 2 layers cannot be exported for vLLM", "k_norm", "head.num_layers=1")),
    Refusal("export-mtp-layers", ("export", TINY_DEEPSEEK, "--format", "vllm", "target.path={deepseek_v3}",
                                  "head.num_layers=2"),
            ("an mtp head of 2 layers cannot be exported in the DeepSeek-V3 layout", "head.num_layers=1")),
    Refusal("export-eagle-deepseek", ("export", TINY_DEEPSEEK, "--format", "sglang", "head.kind=eagle"),
            ("SGLang's EAGLE-1 loader builds a Llama decoder layer; a deepseek_v2 target's head",)),
    Refusal("export-eagle3-gemma3", ("export", TINY, "--format", "vllm", "target.path={gemma3}", "head.kind=eagle3"),
            ("eagle3 head on a gemma3_text target is not exported for vLLM", "Gemma3ForCausalLM implements neither")),
)


@pytest.fixture
def stand_ins(tmp_path) -> dict[str, str]:
    """Checkpoints a dry run reads the config of (no weights): the tiny target with another vocabulary (a draft
    model that does not share its tokenizer) and with MLP channels that TP=2 does not divide; the tiny DeepSeek
    target as a DeepSeek-V3 (whose MTP layers the engines serve); a small Gemma 3 with the tiny target's vocabulary."""
    from hf_models import hf_config

    made = {}
    deepseek = REPO / "recipes" / "tiny-deepseek" / "target"
    gemma3 = {**hf_config("gemma3_text").to_dict(), "vocab_size": json.loads((TINY_TARGET / "config.json").read_text())[
        "vocab_size"], "architectures": ["Gemma3ForCausalLM"]}
    for name, base, change in (("other_vocab", TINY_TARGET, {"vocab_size": 5000}),
                               ("odd_mlp", TINY_TARGET, {"intermediate_size": 383}),
                               ("deepseek_v3", deepseek, {"model_type": "deepseek_v3", "scoring_func": "sigmoid",
                                                          "topk_method": "noaux_tc",
                                                          "architectures": ["DeepseekV3ForCausalLM"]}),
                               ("gemma3", None, gemma3)):
        root = tmp_path / name
        root.mkdir()
        config = {**(json.loads((base / "config.json").read_text()) if base else {}), **change}
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
        made[name] = str(stand_in_checkpoint(root, tmp_path / f"{name}.json"))
    return made


def _argv(case: Refusal, stand_ins: dict[str, str], tmp_path: Path, *extra: str) -> list[str]:
    return [a.format(**stand_ins) for a in case.argv] + [f"output_dir={tmp_path / 'run'}", *extra]


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    from mtp_train.cli import main

    capsys.readouterr()
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _assert_refused(status: int, out: str, err: str, case: Refusal) -> None:
    assert status == 2, f"{case.id}: exit status {status}, not refused; stderr: {err[-2000:]}"
    assert "Traceback" not in err and out == "", (out[-2000:], err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtp-train: "), err
    for needle in case.needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.id)
def test_the_dry_run_refuses_what_a_stage_would_refuse_from_the_recipe(case, stand_ins, tmp_path, capsys):
    """Each recipe-only refusal of a stage, made by ``--dry-run``: exit status 2, one line, no traceback."""
    _assert_refused(*_main(_argv(case, stand_ins, tmp_path, "--dry-run"), capsys), case)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.id)
def test_the_run_refuses_it_before_any_stage_starts(case, stand_ins, tmp_path, capsys, monkeypatch):
    """The same command without ``--dry-run`` refuses it the same way before its first stage runs (each stage is
    replaced by one that fails the test)."""
    import dataclasses

    from mtp_train import pipeline

    def ran(*args, **kwargs):
        raise AssertionError("a stage ran before the recipe was refused")

    stages = {name: dataclasses.replace(stage, run=ran) for name, stage in pipeline.STAGE_BY_NAME.items()}
    monkeypatch.setattr(pipeline, "STAGE_BY_NAME", stages)
    monkeypatch.setattr(pipeline, "STAGES", tuple(stages[s.name] for s in pipeline.STAGES))
    _assert_refused(*_main(_argv(case, stand_ins, tmp_path), capsys), case)
    assert not (tmp_path / "run").exists()


def test_the_cli_refuses_a_dflash_head_gated_on_inputs_in_one_line(tmp_path):
    """The issue's command, as a user runs it: refused by the dry run, before anything is written."""
    proc = run_cli(TINY, "head.kind=dflash", "train.mask_gate=input", f"output_dir={tmp_path / 'run'}", "--dry-run")
    assert_one_line_user_error(proc, "train.mask_gate", "dflash")
    assert not (tmp_path / "run").exists()

