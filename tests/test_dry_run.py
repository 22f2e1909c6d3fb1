"""``--dry-run`` runs precompute's template and loss-mask checks on the first rows, with the tokenizer only: a template
the real run would refuse is refused the same way (one line, exit 2) before anything is loaded, written or queued."""

from __future__ import annotations

import json
import shutil
import subprocess
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
    from mtp_train.recipe import load_recipe

    recipe = _recipe(tmp_path, rows=sgd_rows(10))
    hidden = json.loads((TINY_TARGET / "config.json").read_text())["hidden_size"]
    rest = 9 + 6 * 8 + 4  # id, mask, log-sum-exp; top-8 and the tail
    bf16, fp8 = 2 * hidden * 2 + rest, 2 * (hidden + 4) + rest  # layers [1, -1]; fp8: a byte each and a scale
    chosen = {}
    for mode in ("bf16", "fp8", "online"):
        override = "precompute.mode=online" if mode == "online" else f"precompute.hidden_dtype={mode}"
        proc = run_cli(recipe, override, "--dry-run")
        assert proc.returncode == 0, proc.stderr
        sizes, sample, chosen[mode] = proc.stdout.split("disk for the features:\n", 1)[1].splitlines()[:3]
        tokens = int(sizes.split()[0].replace(",", ""))
        most = load_recipe(recipe).data.max_length  # one sample's features, at the longest a row may be
        assert sample.startswith("  one sample: the longest sampled row, ") and sample.endswith(
            f"at data.max_length, {most:,} tokens, bf16 {size(most * bf16)}, fp8 {size(most * fp8)}"), sample
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
