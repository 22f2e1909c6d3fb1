"""``--dry-run`` runs precompute's template and loss-mask checks on the first rows, with the tokenizer only: a template
the real run would refuse is refused the same way (one line, exit 2) before anything is loaded, written or queued."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, TINY_TARGET, assert_one_line_user_error, run_cli, stand_in_checkpoint
from precompute_helpers import make_recipe, run_precompute_cli, sgd_rows, write_jsonl

TEMPLATES = Path(__file__).resolve().parent / "templates"  # real templates, credited in its README.md
# The assistant header depends on the answer's text, so no placeholder render lines up with the real one.
UNREADABLE = ("{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{{ m.content|length }}:{{ m.content }}"
              "{% else %}<|user|>{{ m.content }}{% endif %}<|eot|>{% endfor %}")


def _recipe(tmp_path: Path, rows: list[dict] | None = None, **data) -> Path:
    file = write_jsonl(tmp_path / "d.jsonl", rows if rows is not None else sgd_rows(3))
    return make_recipe(tmp_path, file, data=data)


def test_a_template_the_run_cannot_read_is_refused_by_the_dry_run_as_by_the_run(tmp_path):
    template = tmp_path / "unreadable.jinja"
    template.write_text(UNREADABLE)
    recipe = _recipe(tmp_path, chat_template=str(template))
    dry = run_cli(recipe, "--dry-run")
    assert_one_line_user_error(dry, "row 0", "data.chat_template")
    real = run_precompute_cli(recipe)
    assert real.returncode == 2 and real.stderr.strip().splitlines()[-1] == dry.stderr.strip()


def test_a_target_without_a_chat_template_is_refused_by_the_dry_run(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(TINY_TARGET, target)
    (target / "chat_template.jinja").unlink()
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    recipe = _recipe(tmp_path)
    assert_one_line_user_error(run_cli(recipe, "--dry-run", f"target.path={target}"), str(target),
                               "no chat template", "data.chat_template")
    # Text rows need no template, and nothing else stands in the way.
    (tmp_path / "text").mkdir()
    text = _recipe(tmp_path / "text", rows=[{"text": "hello there"}] * 3)
    ok = run_cli(text, "--dry-run", f"target.path={target}")
    assert ok.returncode == 0 and "plan:" in ok.stdout, ok.stderr


def test_a_real_template_that_refuses_a_system_message_is_refused_by_the_dry_run(tmp_path):
    path = TEMPLATES / "gemma-2-2b-it.jinja"
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                          {"role": "assistant", "content": "Hello."}]}]
    recipe = _recipe(tmp_path, rows=rows, chat_template=str(path))
    assert_one_line_user_error(run_cli(recipe, "--dry-run"), "row 0", "System role not supported")


def test_an_empty_loss_mask_on_the_first_rows_is_refused_by_the_dry_run(tmp_path):
    template = tmp_path / "empty.jinja"
    original = (TINY_TARGET / "chat_template.jinja").read_text()
    template.write_text(original.replace("{% endgeneration %}", "").replace(
        "{% generation %}", "{% generation %}{% endgeneration %}"))
    recipe = _recipe(tmp_path, chat_template=str(template))
    assert_one_line_user_error(run_cli(recipe, "--dry-run"), "empty loss mask for each of the first 3 rows")
    # Checks of precompute only: a train-only dry run does not read the data.
    assert run_cli("train", recipe, "--dry-run").returncode == 0


def test_slurm_refuses_the_template_before_anything_is_queued(tmp_path):
    """`mtp-train slurm` runs the same checks before rendering or submitting (sbatch need not exist)."""
    template = tmp_path / "unreadable.jinja"
    template.write_text(UNREADABLE)
    recipe = _recipe(tmp_path, chat_template=str(template))
    for extra in ((), ("--dry-run",)):
        proc = run_cli("slurm", recipe, "--cpu", *extra)
        assert_one_line_user_error(proc, "row 0", "data.chat_template")
        assert not list(tmp_path.rglob("*.sbatch"))


def test_the_deepseek_v2_lite_recipe_dry_runs_from_its_shipped_config(tmp_path):
    """The V2-Lite sample's dry run on a stand-in for its checkpoint: the real config.json (recipes/configs/), a weight
    index whose file is empty (the dry run reads no weight) and the tiny target's tokenizer over one chat row. It exits
    0 and prints the memory plan the recipe's comment states, with MLA's latent KV per token (27 layers x (512 + 64)
    x 2 bytes), not a Llama-shaped 2 x heads x head_dim."""
    recipe = REPO / "recipes" / "deepseek-v2-lite.yaml"
    stand_in_checkpoint(tmp_path, REPO / "recipes" / "configs" / "deepseek-v2-lite" / "config.json")
    proc = run_cli(recipe, f"target.path={tmp_path}", f"data.train={tmp_path / 'data.jsonl'}", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    memory = proc.stdout.split("memory per rank")[1].split("disk for")[0].splitlines()[1:]
    assert len(memory) == 3 and all(f"# {line}\n" in recipe.read_text() for line in memory)
    assert "token slots of 31,104 B (MLA latent 512+64 x 27 layers, on every rank)" in memory[0]
    assert all("fits" in line and "DOES NOT FIT" not in line for line in memory), memory


@pytest.fixture
def small_filesystem(tmp_path):
    """A 1 MiB tmpfs (root mounts it; elsewhere the test is skipped, saying so)."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()})")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_the_dry_run_prints_the_features_disk_in_bf16_and_fp8_per_array_task_and_0_online(tmp_path):
    from mtp_train.features.space import size

    recipe = _recipe(tmp_path, rows=sgd_rows(10))
    hidden = json.loads((TINY_TARGET / "config.json").read_text())["hidden_size"]
    rest = 9 + 6 * 8 + 4  # id, mask, log-sum-exp; top-8 and the tail
    bf16, fp8 = 2 * hidden * 2 + rest, 2 * (hidden + 4) + rest  # layers [1, -1]; fp8: a byte each and a scale
    chosen = {}
    for mode in ("bf16", "fp8", "online"):
        override = "precompute.mode=online" if mode == "online" else f"precompute.hidden_dtype={mode}"
        proc = run_cli(recipe, override, "--dry-run")
        assert proc.returncode == 0, proc.stderr
        sizes, chosen[mode] = proc.stdout.split("disk for the features:\n", 1)[1].splitlines()[:2]
        tokens = int(sizes.split()[0].replace(",", ""))
        assert "(10 rows x " in sizes and f"bf16 {bf16:,} B/token = {size(tokens * bf16)}" in sizes, sizes
        assert f"fp8 {fp8:,} B/token = {size(tokens * fp8)}" in sizes, sizes
        assert chosen[mode].endswith(": fits"), chosen[mode]
    assert chosen["bf16"].startswith(f"  precompute.hidden_dtype bf16: {size(tokens * bf16)};"), chosen
    assert chosen["fp8"].startswith(f"  precompute.hidden_dtype fp8: {size(tokens * fp8)};"), chosen
    assert chosen["online"].startswith("  precompute.mode online: 0 B stored"), chosen
    slurm = run_cli("slurm", recipe, "--cpu", "--array-tasks", "4", "--dry-run")
    assert slurm.returncode == 0, slurm.stderr
    assert "MiB per array task of 4;" in slurm.stdout.split("# disk for the features:\n", 1)[1], slurm.stdout


def test_features_that_do_not_fit_their_filesystem_are_refused_before_anything_runs(tmp_path, small_filesystem):
    features = small_filesystem / "features"
    recipe = _recipe(tmp_path, rows=sgd_rows(40))
    override = f"precompute.features_dir={features}"
    assert_one_line_user_error(run_cli(recipe, override, "--dry-run"), f"{features}: the features need ",
                               f"the filesystem of {small_filesystem} has", "precompute.features_dir")
    assert_one_line_user_error(run_cli("slurm", recipe, override, "--cpu", "--dry-run"), f"{features}: the features")
    assert not list(tmp_path.rglob("*.sbatch")) and not features.exists()
    run = run_precompute_cli(recipe, override)  # the run itself refuses before its first shard
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "shards still to write need " in run.stderr.strip().splitlines()[-1]
    assert not list(features.glob("shard-*")) and not list(features.glob(".lock*"))


# --- Every refusal a stage makes from the recipe alone comes from the dry run, and before any stage runs -------------

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
    Refusal("head-kind", (TINY, "head.kind=medusa"), ("head.kind: Input should be",)),
    Refusal("block-size", (TINY, "head.kind=dflash", "head.block_size=1"), ("head.block_size",)),
    Refusal("prompt-set", (TINY, "eval.prompt_sets=[nope]"), ("eval.prompt_sets.0",)),
    Refusal("max-prompts", (TINY, "eval.max_prompts=0"), ("eval.max_prompts",)),
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
    Refusal("trees-sliding-window", (TINY, "target.path={sliding}"),
            ("eval.trees: tree drafting is not wired for sliding-window targets",)),
    Refusal("no-heldout-rows", (TINY, "data.heldout_rows=0"),
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
    Refusal("export-speculators-mtp", ("export", TINY, "--format", "speculators"),
            ("--format speculators:", "is an mtp head; the speculators format holds eagle3")),
    Refusal("export-mtp-llama", ("export", TINY, "--format", "vllm"),
            ("an mtp head on a llama target cannot be exported for vLLM",)),
    Refusal("export-dflash-layers", ("export", TINY, "--format", "vllm", "head.kind=dflash", "head.num_layers=2"),
            ("a dflash head of 2 layers cannot be exported for vLLM", "k_norm", "head.num_layers=1")),
    Refusal("export-mtp-layers", ("export", TINY_DEEPSEEK, "--format", "vllm", "target.path={deepseek_v3}",
                                  "head.num_layers=2"),
            ("an mtp head of 2 layers cannot be exported in the DeepSeek-V3 layout", "head.num_layers=1")),
    Refusal("export-eagle-deepseek", ("export", TINY_DEEPSEEK, "--format", "sglang", "head.kind=eagle"),
            ("SGLang's EAGLE-1 loader builds a Llama decoder layer; a deepseek_v2 target's head",)),
)


@pytest.fixture
def stand_ins(tmp_path) -> dict[str, str]:
    """Checkpoints a dry run reads the config of (no weights): the tiny target as a Mistral with a sliding window,
    with another vocabulary (a draft model that does not share its tokenizer), and with MLP channels that TP=2 does
    not divide; the tiny DeepSeek target as a DeepSeek-V3 (whose MTP layers the engines serve)."""
    made = {}
    deepseek = REPO / "recipes" / "tiny-deepseek" / "target"
    for name, base, change in (("sliding", TINY_TARGET, {"model_type": "mistral", "sliding_window": 64,
                                                          "architectures": ["MistralForCausalLM"]}),
                               ("other_vocab", TINY_TARGET, {"vocab_size": 5000}),
                               ("odd_mlp", TINY_TARGET, {"intermediate_size": 383}),
                               ("deepseek_v3", deepseek, {"model_type": "deepseek_v3", "scoring_func": "sigmoid",
                                                          "topk_method": "noaux_tc",
                                                          "architectures": ["DeepseekV3ForCausalLM"]})):
        root = tmp_path / name
        root.mkdir()
        config = {**json.loads((base / "config.json").read_text()), **change}
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


# --- The guard: every UserError that stage code builds is either one of the refusals above or says why it is not ---

# Where the stages' refusals live: the stages' modules and what only they run (the heads they build, the runtime that
# scores features and decodes the eval, the features they write and read). Not here: the recipe's own schema and
# validators (refused by load_recipe), the target checkpoint's config and weights (mtp_train/models, hf_checkpoint:
# check_inputs and check_recipe read its config.json before any stage), the input data (mtp_train/data: check_data
# runs precompute's checks on the first rows in the dry run), and the slurm command's own options.
STAGE_SOURCES = ("precompute", "eval", "mtp_train/train", "mtp_train/heads", "mtp_train/export.py",
                 "mtp_train/runtime", "mtp_train/features")

# Sites whose refusal the recipe (with the target's config.json, a draft model's, and export's --format) decides:
# each is made by mtp_train.pipeline.check_recipe before any stage runs, and the REFUSALS case named here shows it.
RECIPE_SITES = {
    "eval/loading.py::no_prompt_fits: eval.prompt_sets: no prompt fits the target's {}": "no-room-for-prompts",
    "eval/loading.py::check_recipe: {NO_HELDOUT}": "no-heldout-rows",
    # the same line when the features' manifest holds no held-out row (data.heldout_rows 0 is refused up front)
    "eval/loading.py::heldout_rows: {NO_HELDOUT}": "no-heldout-rows",
    # the schema refuses these first (a Literal, a PositiveInt); the stage keeps them for callers without a recipe
    "eval/prompts.py::load_prompt_set: eval.prompt_sets: unknown prompt set {}; valid s": "prompt-set",
    "eval/prompts.py::load_prompt_set: eval.max_prompts: must be at least 1 (got {})": "max-prompts",
    "mtp_train/heads/base.py::head_spec: head.kind: {} is not a head; choose one of {}": "head-kind",
    "mtp_train/heads/dflash.py::DFlashHead.__init__: head.block_size: {} must be at least 2 (the firs": "block-size",
    # a head as the trainer builds it (pipeline: trainer.check_recipe builds it on the meta device)
    "mtp_train/heads/dflash.py::DFlashHead.__init__: head: a dflash head's layers are standard attent": "dflash-mla",
    "mtp_train/heads/dflash.py::DFlashHead.__init__: head.mask_token_id: {} is not an id of the targe":
        "mask-token-id",
    "mtp_train/heads/eagle3.py::Eagle3Head.__init__: head: an eagle3 head has one decoder layer of a": "eagle3-mla",
    "mtp_train/heads/eagle3.py::aux_layers_for: head.aux_layers: {} must be three distinct ascen": "aux-layers",
    "mtp_train/heads/eagle3.py::default_aux_layers: head.aux_layers: the engines' default {} for a {": "aux-default",
    "mtp_train/train/checkpoint.py::target_mtp_layers: {}: eval.draft target_mtp needs a DeepSeek-V3-la":
        "target-mtp",
    "mtp_train/runtime/attention.py::check_latent: target.attention_backend: flashinfer is not wire":
        "flashinfer-mla",
    "mtp_train/runtime/drafters.py::check_draft_vocab: draft model vocab {} differs from the target's {":
        "draft-model-vocab",
    "mtp_train/runtime/tree_decoder.py::check_trees: eval.trees: tree drafting is not wired for slidi":
        "trees-sliding-window",
    "mtp_train/export.py::check_format: --format {}: {} is a dflash head; it exports for": "export-dflash-sglang",
    "mtp_train/export.py::check_format: --format speculators: {} is an {} head; the spec":
        "export-speculators-mtp",
    "mtp_train/export.py::check_format: {}: an mtp head on a {} target cannot be exporte": "export-mtp-llama",
    "mtp_train/export.py::check_format: {}: {}'s EAGLE-1 loader builds a Llama decoder l": "export-eagle-deepseek",
    "mtp_train/export.py::check_format: {}: a dflash head of {} layers cannot be exporte": "export-dflash-layers",
    "mtp_train/export.py::check_format: {}: an mtp head of {} layers cannot be exported": "export-mtp-layers",
}

FEATURES = "the features precompute wrote (manifest, index, shards) or their online plan"
HEAD = "a trained head or checkpoint the train stage wrote"
REPORT = "a report.json an eval wrote (or --baseline names)"
DATA = "the data's rows through the tokenizer (the dry run's check_data makes precompute's on the first rows)"
PROMPTS = "the prompt sets' files and the tokenizer's chat template"
KV = "the sequences' lengths against the KV cache, which is sized on the machine that runs the stage"
# Sites whose refusal needs more than the recipe: what an earlier stage wrote, the data, the machine, the launch.
NOT_RECIPE = {
    "precompute/directory.py::prepare_directory: {}: existing features were made with different {": FEATURES,
    "precompute/preflight.py::check_data_files: data.train: {} not found": DATA,
    "precompute/preflight.py::check_rows: data.train: no usable rows": DATA,
    "precompute/preflight.py::mask_counts: {}: the chat template gave an empty loss mask fo": DATA,
    "precompute/readback.py::ShardReadBack.check: rank {}'s shards do not read back as written ({}": "the shards "
        "just written, read back from the filesystem",
    "precompute/run.py::drop_merged: {}: features made with {} are complete here; rer": FEATURES,
    "precompute/run.py::resolve_worker: --rank {} is outside --world-size {}": "the launch: --rank and "
        "--world-size, or the SLURM array's or torchrun's variables",
    "precompute/shards.py::plan_shards: {}: holds rows that no longer match the plan; re": FEATURES,
    "eval/loading.py::baseline_path: {} {}; give the report.json of an earlier eval": REPORT,
    "eval/loading.py::heldout_rows: {} not found; the `heldout` prompt set needs `mt": FEATURES,
    "eval/loading.py::load_other: eval.compare: no trained {} head in {}; run `mtp": HEAD,
    "eval/prompts.py::load_prompt_set: prompt set {}: {} not found (valid sets are {})": PROMPTS,
    "eval/prompts.py::load_prompt_set: prompt set {}: no prompts": PROMPTS,
    "eval/prompts.py::render_prompt: {}: has no chat template to render prompts with": PROMPTS,
    "eval/prompts.py::render_prompt: {}: chat template failed on a prompt: {}": PROMPTS,
    "eval/prompts.py::_read_jsonl: prompt set {}: {} cannot be read: {}": PROMPTS,
    "eval/prompts.py::_field: {}: record {} has no usable {}": PROMPTS,
    "eval/prompts.py::_question_set.build: {}: record {} has a non-string first turn": PROMPTS,
    "eval/prompts.py::_heldout: prompt set 'heldout': needs the training rows an": FEATURES,
    "eval/prompts.py::_heldout: prompt set 'heldout': {} held-out row id(s) are": FEATURES,
    "eval/prompts.py::_heldout: prompt set 'heldout': none of the held-out rows": DATA,
    "eval/report.py::load_report: {}: report not found": REPORT,
    "eval/report.py::load_report: {}: is a directory; expected a report.json file": REPORT,
    "eval/report.py::load_report: {}: not a report (not UTF-8 text)": REPORT,
    "eval/report.py::load_report: {}: cannot read the report: {}": REPORT,
    "eval/report.py::load_report: {}: not valid JSON (line {}): {}": REPORT,
    "eval/report.py::load_report: {}: not a report (expected a JSON object, got {}": REPORT,
    "eval/report.py::load_report: {}: not a report (a JSON object without the fiel": REPORT,
    "eval/report.py::load_report: {}: field 'schema_version': report schema {}, th": REPORT,
    "eval/report.py::load_report: {}": REPORT,
    "eval/run.py::_head_id: {}: no trained head in {}; run `mtp-train train`": HEAD,
    "eval/run.py::rerender: {} not found; run `mtp-train eval` first": REPORT,
    "mtp_train/train/checkpoint.py::_corrupt: {}: checkpoint is corrupt or incomplete ({}); de": HEAD,
    "mtp_train/train/checkpoint.py::load_checkpoint: {}: not a checkpoint name ({}); write the name o": HEAD,
    "mtp_train/train/checkpoint.py::load_checkpoint: {}: names {}, which is not a checkpoint director": HEAD,
    "mtp_train/train/checkpoint.py::load_optimizer_shard: {}: the checkpoint's optimizer state is split ov": HEAD,
    "mtp_train/train/checkpoint.py::load_optimizer_shard: {}: the checkpoint was written by DeepSpeed ZeRO": HEAD,
    "mtp_train/train/checkpoint.py::head_from_hf: {}: head tensor {} is missing": HEAD,
    "mtp_train/train/checkpoint.py::head_from_hf: {}: tensors do not fit the head's config ({})": HEAD,
    "mtp_train/train/checkpoint.py::load_head: {}: head was built for hidden size {} and vocab": HEAD,
    "mtp_train/train/checkpoint.py::load_head: {}: cannot be read ({}); train the head again wi": HEAD,
    "mtp_train/train/checkpoint.py::load_trained_head: {}: the head was trained for a different target": HEAD,
    "mtp_train/train/checkpoint.py::load_target_mtp: {}: MTP layer {} asked for, the checkpoint has {": "the "
        "caller's layer index (the eval asks for layer 0, which target_mtp_layers has found up front)",
    "mtp_train/train/checkpoint.py::load_target_mtp: {}: config.json says {} MTP layer(s), but no ten": "the "
        "target's weights (which tensors the checkpoint holds)",
    "mtp_train/train/trainer.py::TrainInputs.read: {}: the last stored layer must be the target's l": FEATURES,
    "mtp_train/train/trainer.py::Trainer.setup: {}: too few training sequences for {} process(es": FEATURES
        + ", against the processes launched",
    "mtp_train/train/vocab.py::aux_indices: {}: the features hold the outputs of layers {};": FEATURES,
    "mtp_train/heads/base.py::HeadSpec.from_json: {}: not a head config (no {} field)": HEAD,
    "mtp_train/heads/base.py::HeadSpec.from_json: {}: not a head config ({})": HEAD,
    "mtp_train/heads/base.py::HeadSpec.from_json: {}: hidden_input {} / feedback {} are not conven": HEAD,
    "mtp_train/heads/base.py::load_head_config: {} not found; a head checkpoint needs config.jso": HEAD,
    "mtp_train/heads/base.py::load_head_config: {}: invalid JSON ({}); train the head again with": HEAD,
    "mtp_train/heads/base.py::load_head_config: {}: not UTF-8 text; train the head again with `m": HEAD,
    "mtp_train/export.py::export_head: --format {}: choose one of {}": "a caller's format (the CLI's --format "
        "choices refuse another first)",
    "mtp_train/export.py::export_head: {}: no trained {} head; run `mtp-train train` fi": HEAD,
    "mtp_train/export.py::_check_servable: {}/config.json: the head was trained in other co": HEAD + " (the "
        "conventions its config.json records)",
    "mtp_train/runtime/attention.py::backend_name: target.attention_backend: flashinfer needs a CUD": "the machine "
        "(a CUDA device)",
    "mtp_train/runtime/attention.py::backend_name: target.attention_backend: flashinfer could not b": "the machine "
        "(nvcc, or prebuilt kernels)",
    "mtp_train/runtime/drafters.py::BlockDrafter.block_logits: eval.k: k = {} drafts past what the dflash head": HEAD
        + " (its block_size; the recipe's eval.k against head.block_size is a recipe validator)",
    "mtp_train/runtime/engine.py::kv_budget: target.gpu_memory_fraction: {} of {} GiB leaves": "the machine (the "
        "GPU's memory and the weights loaded on it)",
    "mtp_train/runtime/engine.py::Engine._score: sequence {} ({} tokens) does not fit the KV cach": KV,
    "mtp_train/runtime/scheduler.py::Scheduler.add: request {}: {} tokens (prompt plus max_new_token": KV,
    "mtp_train/runtime/speculative.py::SpeculativeDecoder.generate: request {}: too long for the KV cache with a dra":
        KV,
    "mtp_train/features/index.py::load_index: {}: missing (the features' per-sequence index);": FEATURES,
    "mtp_train/features/index.py::load_index: {}: unreadable index ({}); rerun precompute with": FEATURES,
    "mtp_train/features/index.py::load_index: {}: not a features index (no {}); rerun precompu": FEATURES,
    "mtp_train/features/index.py::load_index: {}: its shards do not match the manifest's; reru": FEATURES,
    "mtp_train/features/index.py::load_index: {}: its sequences' tokens do not add up to the m": FEATURES,
    "mtp_train/features/manifest.py::union: {}: fingerprint differs from {}'s; these ranks r": FEATURES,
    "mtp_train/features/manifest.py::load_manifest: {}: not a features manifest ({}); rerun precompu": FEATURES,
    "mtp_train/features/manifest.py::load_manifest: {}: not a features manifest (not a JSON object);": FEATURES,
    "mtp_train/features/manifest.py::load_manifest: {}: features format {} is not this toolkit's for": FEATURES,
    "mtp_train/features/manifest.py::load_manifest: {}: not a features manifest (field {}: {}); reru": FEATURES,
    "mtp_train/features/online.py::open_features: {}: the features were {}, and the recipe says pr": FEATURES,
    "mtp_train/features/online.py::OnlineFeatures.__init__: {}: not a complete online plan; rerun `mtp-train":
        FEATURES,
    "mtp_train/features/online.py::OnlineFeatures.__init__: {}: features were planned for a different target":
        FEATURES,
    "mtp_train/features/planned_rows.py::DataRows.__init__: data.train: {} not found": DATA,
    "mtp_train/features/planned_rows.py::DataRows.__init__: {}: cannot detect the row format from columns {}": DATA,
    "mtp_train/features/planned_rows.py::DataRows.contents: data.train: row {} of the online plan is gone or": DATA,
    "mtp_train/features/planned_rows.py::PlannedRows.__init__: {}: the plan was made from other {} than the rec":
        FEATURES,
    "mtp_train/features/planned_rows.py::PlannedRows.encode_checked: {}: {} encode to other lengths than the plan rec":
        FEATURES,
    "mtp_train/features/reader.py::FeatureReader.__init__: {}: features are incomplete; rerun precompute to": FEATURES,
    "mtp_train/features/reader.py::FeatureReader.__init__: {}: these features are planned for online traini": FEATURES,
    "mtp_train/features/reader.py::FeatureReader.__init__: {}: features were computed from a different targ":
        FEATURES,
    "mtp_train/features/reader.py::FeatureReader._file: {}: {} is {}, other shards have {}": FEATURES,
    "mtp_train/features/reader.py::damaged: {}: {}; check the features with `mtp-train verif": FEATURES,
    "mtp_train/features/space.py::require_space: {}: {} need {}, but the filesystem of {} has {}": "the filesystem's "
        "free space (the dry run's check_data measures it when precompute is planned)",
    "mtp_train/features/verify.py::load_features_manifest: {}: features directory not found": FEATURES,
    "mtp_train/features/verify.py::load_features_manifest: {}: no manifest.json or manifest.rank-*.json; ru":
        FEATURES,
}


def _message_template(node: ast.expr) -> str:
    """A message as its source spells it: literal text kept, an f-string's fields as ``{}``, a name as ``{NAME}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message_template(node.left) + _message_template(node.right)
    return f"{{{node.id}}}" if isinstance(node, ast.Name) else "{}"


def user_error_sites() -> list[str]:
    """Every ``UserError(...)`` built in ``STAGE_SOURCES``, as ``path::function: message`` (its first 48
    characters): a key that survives moved lines and names what a reader looks for."""
    sites = []
    for source in STAGE_SOURCES:
        root = REPO / source
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            scopes: list[str] = []

            def visit(node: ast.AST) -> None:
                named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                if named:
                    scopes.append(node.name)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "UserError":
                    message = _message_template(node.args[0]) if node.args else ""
                    where = ".".join(scopes) or "<module>"
                    sites.append(f"{path.relative_to(REPO)}::{where}: {message[:48].rstrip()}")
                for child in ast.iter_child_nodes(node):
                    visit(child)
                if named:
                    scopes.pop()

            visit(ast.parse(path.read_text(encoding="utf-8")))
    return sites


def test_every_refusal_in_stage_code_is_one_the_dry_run_makes_or_says_why_not():
    """The guard. A refusal a stage makes from the recipe alone belongs in ``mtp_train.pipeline.check_recipe`` (or a
    recipe validator), so that ``--dry-run`` and the start of every run make it before any stage runs; but nothing can
    tell from the code whether a new check reads only the recipe. So every ``UserError`` that stage code builds
    (``STAGE_SOURCES``; found by parsing the sources, keyed by file, function and the start of its message) must be
    classified here: in ``RECIPE_SITES``, naming the ``REFUSALS`` case that shows the dry run (and the run, before its
    first stage) refusing it, or in ``NOT_RECIPE``, with what else it depends on (what an earlier stage wrote, the data,
    the machine, the launch). A new site fails this test until its author decides which, in review's sight; an entry
    whose site is gone or reworded fails it too, so the lists stay true. It cannot catch a recipe-only check written
    as another exception or in a module outside ``STAGE_SOURCES``."""
    sites = user_error_sites()
    twins = sorted({s for s in sites if sites.count(s) > 1})
    assert not twins, f"sites that share a key (make their messages differ in the first 48 characters): {twins}"
    assert not RECIPE_SITES.keys() & NOT_RECIPE.keys()
    new = sorted(set(sites) - RECIPE_SITES.keys() - NOT_RECIPE.keys())
    assert not new, (
        "UserError sites in stage code that the dry-run tests do not know:\n  " + "\n  ".join(new) + "\nIf the recipe "
        "(with the target's config.json) alone decides one, make the stage's check callable before anything runs "
        "(a validator in mtp_train/recipe.py for a relation between fields, else the stage's check_recipe, which "
        "mtp_train.pipeline.check_recipe calls), add a REFUSALS case and map the site to it in RECIPE_SITES; "
        "otherwise add it to NOT_RECIPE with what it depends on besides the recipe.")
    gone = sorted((RECIPE_SITES.keys() | NOT_RECIPE.keys()) - set(sites))
    assert not gone, "entries whose UserError is no longer in stage code (moved, reworded or removed):\n  " + \
        "\n  ".join(gone)
    cases = {case.id for case in REFUSALS}
    assert set(RECIPE_SITES.values()) <= cases, set(RECIPE_SITES.values()) - cases
