"""`mtp-train import`: heads in the engines' and peers' layouts read into this runtime's head. Every format this
toolkit writes round-trips: exported, imported (the tensors and the spec equal the head's), exported again (the same
file content). Refusals are one line that names the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (REPO, TINY_RECIPE, TINY_TARGET, assert_one_line_user_error, pause_env, paused_processes,
                      run_cli)
from mtp_train.errors import UserError
from mtp_train.export import export_head
from mtp_train.features.manifest import target_fingerprint
from mtp_train.heads import build_head, head_spec
from mtp_train.importer import import_head
from mtp_train.models.config import ModelConfig
from mtp_train.recipe import load_recipe
from mtp_train.train.checkpoint import head_to_hf, save_head

CFG = ModelConfig.from_hf(json.loads((TINY_TARGET / "config.json").read_text()))
EAGLE3 = {"aux_layers": (2, 3, 4), "draft_vocab": 1024}
CASES = {  # name: (kind, head_spec arguments, formats)
    "eagle3": ("eagle3", EAGLE3, ("vllm", "sglang", "speculators")),
    "eagle3-3.1-window": ("eagle3", {**EAGLE3, "fc_norm": True, "norm_output": True, "window": 64},
                          ("vllm", "sglang", "speculators")),
    "eagle3-speculators": ("eagle3", {"aux_layers": (2, 3, 4), "draft_vocab": CFG.vocab_size, "norm_before_fc": True,
                                      "norm_before_residual": True}, ("vllm", "speculators")),
    "peagle": ("eagle3", {**EAGLE3, "parallel_drafts": 4, "mask_token_id": 7}, ("speculators",)),
    "eagle": ("eagle", {}, ("vllm", "sglang")),
    "dflash": ("dflash", {"aux_layers": (2, 3, 4), "block_size": 5, "mask_token_id": 7, "window": 64}, ("vllm",)),
}


def _head(kind: str, args: dict):
    """A head of random weights (every tensor drawn, so that a swapped or dropped one shows)."""
    torch.manual_seed(0)
    convention = "native" if kind == "eagle3" else "vllm"
    head = build_head(head_spec(kind, 1, CFG, target_fingerprint(TINY_TARGET), convention, **args))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    if kind == "eagle3" and args["draft_vocab"] < CFG.vocab_size:
        head.draft_ids.copy_(torch.randperm(CFG.vocab_size)[: args["draft_vocab"]].sort().values)
    return head


def _recipe(tmp_path: Path, kind: str):
    return load_recipe(TINY_RECIPE, [f"output_dir={tmp_path / 'run'}", f"head.kind={kind}"])


@pytest.mark.parametrize("case", CASES)
def test_every_format_round_trips_through_import(tmp_path, case):
    kind, args, formats = CASES[case]
    head = _head(kind, args)
    recipe = _recipe(tmp_path, kind)
    save_head(recipe.head_dir(), head, {})
    want = head_to_hf(head)
    for fmt in formats:
        exported = export_head(recipe, fmt, tmp_path / f"export-{fmt}")
        imported, record = import_head(exported, TINY_TARGET, CFG, "sglang" if fmt == "sglang" else None)
        assert record["kind"] == kind and record["layout"] == ("speculators" if fmt == "speculators" else fmt)
        got = head_to_hf(imported)
        assert sorted(got) == sorted(want), fmt
        assert all(torch.equal(got[k], want[k]) for k in want), fmt
        for field in ("aux_layers", "draft_vocab", "fc_norm", "feedback", "window", "block_size", "mask_token_id",
                      "parallel_drafts", "norm_before_fc", "norm_before_residual", "hidden_input"):
            assert getattr(imported.spec, field) == getattr(head.spec, field), (fmt, field)
        # exported again in its own format: the same file content
        again = _recipe(tmp_path / fmt, kind)
        save_head(again.head_dir(), imported, {})
        second = export_head(again, fmt, tmp_path / f"again-{fmt}")
        first_tensors, second_tensors = load_file(exported / "model.safetensors"), load_file(second / "model.safetensors")
        assert sorted(first_tensors) == sorted(second_tensors)
        assert all(torch.equal(first_tensors[k], second_tensors[k]) for k in first_tensors), fmt
        configs = [json.loads((d / "config.json").read_text()) for d in (exported, second)]
        for c in configs:
            c.pop("mtp_train")
        assert configs[0] == configs[1], fmt


def _specforge_like(tmp_path: Path) -> Path:
    """An eagle3 head in the layout SpecForge's SGLang export writes (EXPORT.md 3.5): ``midlayer.*``, ``d2t``/``t2d``,
    ``LlamaForCausalLMEagle3``; this toolkit's own SGLang export of a random head (its aux ids, not the defaults,
    under ``eagle_config``). Files SpecForge itself wrote are the slow peer tests'."""
    kind, args, _ = CASES["eagle3"]
    head = _head(kind, args)
    recipe = _recipe(tmp_path, kind)
    save_head(recipe.head_dir(), head, {})
    return export_head(recipe, "sglang", tmp_path / "specforge")


def _tiny_recipe_file(tmp_path: Path) -> Path:
    """The tiny recipe, copied with its output in ``tmp_path / "out"`` (the target's path made absolute)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("output_dir: ../runs/tiny", f"output_dir: {tmp_path / 'out'}")
                      .replace("path: tiny/target", f"path: {TINY_TARGET}"))
    return recipe


def _edit(src: Path, config=None, tensors=None) -> Path:
    if config is not None:
        data = json.loads((src / "config.json").read_text())
        config(data)
        (src / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        state = load_file(src / "model.safetensors")
        tensors(state)
        save_file(state, src / "model.safetensors")
    return src


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(intermediate_size=999), "intermediate_size 999 is not the target's"),
    (lambda c: c.update(architectures=["GPT2LMHeadModel"]), "not a draft head this toolkit reads"),
    (lambda c: c.update(speculators_model_type="mtp"), "speculators_model_type 'mtp'"),
])
def test_a_config_it_cannot_map_is_refused_naming_the_key(tmp_path, edit, needle):
    src = _edit(_specforge_like(tmp_path), config=edit)
    with pytest.raises(UserError, match=needle):
        import_head(src, TINY_TARGET, CFG, "sglang")


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.update({"midlayer.self_attn.q_norm.weight": torch.ones(4)}), "'layers.0.self_attn.q_norm.weight'"),
    (lambda t: t.update({"extra.weight": torch.ones(4)}), "'extra.weight' is not part of an eagle3 head"),
    (lambda t: t.pop("lm_head.weight"), "no lm_head.weight"),
    (lambda t: t.update(d2t=t["d2t"].flip(0)), "d2t does not map"),
    (lambda t: t.update(t2d=~t["t2d"]), "t2d does not mark"),
    (lambda t: t.update({"embed_tokens.weight": torch.zeros(CFG.vocab_size, CFG.hidden_size)}),
     "embed_tokens.weight is not the target's embedding"),
])
def test_tensors_it_cannot_map_are_refused_naming_the_key(tmp_path, edit, needle):
    src = _edit(_specforge_like(tmp_path), tensors=edit)
    with pytest.raises(UserError, match=needle):
        import_head(src, TINY_TARGET, CFG, "sglang")


def test_sglang_refuses_a_head_with_norm_before_residual(tmp_path):
    kind, args, _ = CASES["eagle3-speculators"]
    recipe = _recipe(tmp_path, kind)
    save_head(recipe.head_dir(), _head(kind, args), {})
    with pytest.raises(UserError, match="norm_before_residual, which SGLang 0.5.23 does not read"):
        export_head(recipe, "sglang", tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()


def test_a_peagle_head_in_vllms_format_is_refused_for_its_unrecorded_draft_count(tmp_path):
    kind, args, _ = CASES["peagle"]
    recipe = _recipe(tmp_path, kind)
    save_head(recipe.head_dir(), _head(kind, args), {})
    with pytest.raises(UserError, match="num_speculative_tokens"):
        import_head(export_head(recipe, "vllm", tmp_path / "vllm"), TINY_TARGET, CFG)


def test_nested_aux_ids_need_the_engine_named(tmp_path):
    """SGLang's export writes custom aux ids only under eagle_config, which vLLM reads as block inputs and SGLang as
    block outputs: without --layout the import refuses; with it, each engine's reading."""
    src = _specforge_like(tmp_path)
    with pytest.raises(UserError, match="--layout vllm or --layout sglang"):
        import_head(src, TINY_TARGET, CFG)
    assert import_head(src, TINY_TARGET, CFG, "sglang")[0].spec.aux_layers == (2, 3, 4)
    assert import_head(src, TINY_TARGET, CFG, "vllm")[0].spec.aux_layers == (1, 2, 3)


def test_the_import_command_writes_a_head_this_runtime_loads(tmp_path):
    from mtp_train.train.checkpoint import load_trained_head

    src = _specforge_like(tmp_path)
    recipe = _tiny_recipe_file(tmp_path)
    proc = run_cli("import", recipe, src, "--layout", "sglang", "--name", "specforge")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out" / "imported" / "specforge"
    head = load_trained_head(out, TINY_TARGET, CFG)
    assert json.loads((out / "config.json").read_text())["imported"]["layout"] == "sglang"
    assert head.spec.kind == "eagle3" and head.spec.draft_vocab == 1024
    proc = run_cli("import", recipe, tmp_path / "nowhere")
    assert_one_line_user_error(proc, "config.json: not found")
    # `export --head imported/NAME` writes the imported head in another engine's format: speculators' layer names,
    # the same weights, and a model card that says where the head came from
    assert run_cli("export", recipe, "--format", "speculators", "--head", "imported/specforge").returncode == 0
    converted = tmp_path / "out" / "export" / "imported-specforge-speculators"
    written, peer = load_file(converted / "model.safetensors"), load_file(src / "model.safetensors")
    assert written.keys() == {k.replace("midlayer.", "layers.0.") for k in peer}
    assert all(torch.equal(written[k.replace("midlayer.", "layers.0.")], v) for k, v in peer.items())
    assert f"imported from `{src.resolve()}` (sglang layout)" in (converted / "README.md").read_text()
    proc = run_cli("export", recipe, "--format", "vllm", "--head", "imported/nobody")
    assert_one_line_user_error(proc, "no head imported there", "mtp-train import")


def test_an_imported_head_is_evaluated_beside_the_runs_own(trained_run, tmp_path):
    """``eval.compare: [imported/NAME]``: the head drafts on the same prompts, every point lossless, in the report's
    comparisons as the run's own head is; a name not imported is a one-line error."""
    import shutil

    import yaml

    from mtp_train.eval.report import load_report

    run = tmp_path / "run"
    shutil.copytree(trained_run.parent / "run", run, ignore=shutil.ignore_patterns("eval", "checkpoints"))
    recipe = yaml.safe_load(trained_run.read_text())
    recipe["output_dir"] = str(run)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    kind, args, _ = CASES["eagle"]
    peer = _recipe(tmp_path / "peer", kind)
    save_head(peer.head_dir(), _head(kind, args), {})
    src = export_head(peer, "vllm", tmp_path / "peer-vllm")
    assert run_cli("import", path, src, "--name", "peer").returncode == 0
    settings = ["eval.prompt_sets=[mt_bench]", "eval.max_prompts=2", "eval.max_new_tokens=8", "eval.k=[1,2]",
                "eval.trees=[]", "eval.temperatures=[0]"]
    missing = run_cli("eval", path, *settings, "eval.compare=[imported/nobody]", timeout=600)
    assert_one_line_user_error(missing, "no 'imported/nobody' head", "mtp-train import")
    proc = run_cli("eval", path, *settings, "eval.compare=[imported/peer]", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = load_report(run / "eval" / "report.json")
    (comparison,) = report.comparisons
    assert comparison.name == "imported/peer" and [p.k for p in comparison.sweep] == [1, 2]
    assert all(p.lossless for p in comparison.sweep) and all(p.num_prompts == 2 for p in comparison.sweep)


def test_a_second_import_or_export_of_the_same_name_refuses_and_the_first_finishes_whole(tmp_path):
    """Two writers of one ``imported/NAME`` (or one export directory) at once: the second refuses in one line while
    the first holds the name (paused there by the test hook), and the first then writes the whole head."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    src = _specforge_like(tmp_path)
    recipe = _tiny_recipe_file(tmp_path)
    commands = {"import": ["import", recipe, src, "--layout", "sglang", "--name", "x"],
                "export": ["export", recipe, "head.kind=eagle3", "--format", "vllm", "--out", tmp_path / "exp"]}
    for what, args in commands.items():
        if what == "export":  # the imported head as the recipe's trained one
            shutil.copytree(tmp_path / "out" / "imported" / "x", tmp_path / "out" / "heads" / "eagle3")
        cmd = [sys.executable, "-m", "mtp_train.cli", *map(str, args)]
        first = subprocess.Popen(cmd, cwd=REPO, env=pause_env("hold", 0, tmp_path / f"paused-{what}"),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        (pid,) = paused_processes(tmp_path / f"paused-{what}", 1, first)
        assert_one_line_user_error(run_cli(*args), "is being written by")
        os.kill(pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0, first.communicate()[1][-2000:]
    head = load_file(tmp_path / "out" / "imported" / "x" / "model.safetensors")
    assert torch.equal(head["draft_ids"], load_file(tmp_path / "out" / "heads" / "eagle3" / "model.safetensors")
                       ["draft_ids"])
    assert (tmp_path / "exp" / "config.json").is_file() and (tmp_path / "exp" / "model.safetensors").is_file()
