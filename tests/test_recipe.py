"""The recipe schema: strict keys, types, values, overrides, path resolution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY_RECIPE, TINY_TARGET
from mtp_train.errors import UserError
from mtp_train.recipe import Recipe, apply_overrides, load_recipe, parse_override

SAMPLE_RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def write_recipe(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def tiny_data() -> dict:
    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["target"]["path"] = str(TINY_TARGET)
    data["data"]["train"] = str(REPO / "data/sgd/sgd_train_sharegpt.jsonl.gz")
    return data


def test_tiny_recipe_fills_defaults_and_resolves_paths_against_its_directory():
    recipe = load_recipe(TINY_RECIPE)
    assert recipe.target.path == TINY_TARGET.resolve()
    assert recipe.output_dir == (REPO / "runs" / "tiny").resolve()
    assert recipe.features_dir == recipe.output_dir / "features"
    assert recipe.data.train == [(REPO / "data/sgd/sgd_train_sharegpt.jsonl.gz").resolve()]
    assert recipe.head.kind == "mtp" and recipe.head.num_layers == 1
    assert recipe.target.trust_remote_code is False


@pytest.mark.parametrize("path", SAMPLE_RECIPES, ids=lambda p: p.name)
def test_sample_recipes_validate(path: Path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)


def test_sample_recipes_cover_8b_and_70b():
    names = {p.name for p in SAMPLE_RECIPES}
    assert {"tiny.yaml", "llama3.1-8b.yaml", "llama3.3-70b.yaml"} <= names
    assert load_recipe(REPO / "recipes/llama3.3-70b.yaml").target.tp == 8


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"train": {"bogus": 1}}, "train.bogus"),
        ({"bogus_section": {}}, "bogus_section"),
        ({"head": {"knd": "mtp"}}, "head.knd"),
    ],
)
def test_unknown_keys_are_errors_naming_the_path(tmp_path, patch, field):
    data = tiny_data()
    for section, values in patch.items():
        data.setdefault(section, {}).update(values)
    with pytest.raises(UserError, match=rf"{field}: unknown key"):
        load_recipe(write_recipe(tmp_path, data))


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=fast", "train.lr"),
        ("target.tp=two", "target.tp"),
        ("precompute.layers=7", "precompute.layers"),
        ("data.skip_bad_rows=maybe", "data.skip_bad_rows"),
        ("head.kind=medusa", "head.kind"),
    ],
)
def test_wrong_types_name_the_field(override, field):
    with pytest.raises(UserError) as e:
        load_recipe(TINY_RECIPE, [override])
    assert str(e.value).startswith(f"{TINY_RECIPE}: {field}:")


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=-1e-4", "train.lr"),
        ("train.lr=0", "train.lr"),
        ("target.tp=0", "target.tp"),
        ("data.sampling.top_p=1.5", "data.sampling.top_p"),
        ("train.unroll_decay=0", "train.unroll_decay"),
        ("eval.k=[]", "eval.k"),
        ("eval.k=[0, 1]", "eval.k.0"),
    ],
)
def test_impossible_values_name_the_field(override, field):
    with pytest.raises(UserError, match=rf": {field}: "):
        load_recipe(TINY_RECIPE, [override])


def test_cross_field_rule_both_loss_weights_zero():
    with pytest.raises(UserError, match="train: w_hidden and w_logits are both 0"):
        load_recipe(TINY_RECIPE, ["train.w_hidden=0", "train.w_logits=0"])


@pytest.mark.parametrize("overrides, field", [
    (["head.kind=dflash", "head.block_size=4", "eval.trees=[]"], "eval.k"),  # tiny's k [1, 2, 3, 4]
    (["head.kind=mtp", "eval.compare=[dflash]", "head.block_size=3", "eval.k=[1,2]"], "eval.trees"),  # depth 4
    (["head.kind=eagle", "eval.compare=[dflash]", "eval.k=[1,9]"], "eval.k"),  # the default blocks of 9
])
def test_a_dflash_draft_longer_than_its_trained_block_is_refused(overrides, field):
    """A dflash head trains block positions 1..block_size-1 only: a draft past them (a chain's k, a tree's depth) is
    refused when the recipe is loaded, for the head and for a dflash comparison alike."""
    with pytest.raises(UserError) as e:
        load_recipe(TINY_RECIPE, overrides)
    message = str(e.value)
    assert message.startswith(f"{TINY_RECIPE}: {field}: ") and "head.block_size" in message
    assert "\n" not in message and "(top level)" not in message


@pytest.mark.parametrize("overrides", [
    ["head.kind=dflash", "head.block_size=5"],  # k up to 4 and depth 4: positions it trained
    ["head.kind=dflash", "head.block_size=3", "eval.draft=target_mtp", "eval.trees=[]"],  # the head drafts nothing
    ["head.kind=dflash", "head.block_size=3", f"eval.draft_model={TINY_TARGET}", "eval.trees=[]"],
    ["head.kind=mtp", "head.block_size=2", "eval.k=[1,5]"],  # no dflash draft: block_size is unused
])
def test_dflash_drafts_within_the_trained_block_or_no_dflash_draft_are_accepted(overrides):
    load_recipe(TINY_RECIPE, overrides)


def test_missing_required_field(tmp_path):
    data = tiny_data()
    del data["target"]["path"]
    with pytest.raises(UserError, match="target.path: required field is missing"):
        load_recipe(write_recipe(tmp_path, data))


def test_overrides_apply_nested_values_and_validate_again():
    recipe = load_recipe(
        TINY_RECIPE,
        ["train.lr=1e-4", "head.kind=eagle", "eval.k=[1,3]", "data.max_rows=100", "precompute.features_dir=feats"],
    )
    assert recipe.train.lr == pytest.approx(1e-4)
    assert recipe.head.kind == "eagle"
    assert recipe.eval.k == [1, 3]
    assert recipe.data.max_rows == 100
    assert recipe.precompute.features_dir == (REPO / "recipes" / "feats").resolve()
    assert recipe.features_dir == (REPO / "recipes" / "feats").resolve()


def test_later_override_wins_and_null_restores_default():
    recipe = load_recipe(TINY_RECIPE, ["train.lr=1e-4", "train.lr=2e-4", "data.max_rows=null"])
    assert recipe.train.lr == pytest.approx(2e-4)
    assert recipe.data.max_rows is None


def test_override_does_not_touch_the_input_mapping():
    data = {"train": {"lr": 1.0}}
    out = apply_overrides(data, ["train.lr=2"])
    assert data == {"train": {"lr": 1.0}} and out == {"train": {"lr": 2}}


@pytest.mark.parametrize("text", ["train.lr", "=3", "train..lr=3", ".lr=1"])
def test_malformed_overrides_are_user_errors(text):
    with pytest.raises(UserError, match="expected KEY.PATH=VALUE"):
        parse_override(text)


def test_override_into_a_scalar_is_a_user_error():
    with pytest.raises(UserError, match="train.lr is not a section"):
        load_recipe(TINY_RECIPE, ["train.lr.x=1"])


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("target:\n  path: x\n  dtype: [unclosed\n")
    with pytest.raises(UserError, match=rf"{path}: invalid YAML at line \d+"):
        load_recipe(path)


@pytest.mark.parametrize("text, message", [("", "recipe is empty"), ("- a\n- b\n", "must be a mapping")])
def test_non_mapping_recipes(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        load_recipe(path)


def test_yaml_is_parsed_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("output_dir: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(UserError, match="invalid YAML"):
        load_recipe(path)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(UserError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_copied_target_resolves_next_to_a_moved_recipe(tmp_path):
    shutil.copytree(TINY_TARGET, tmp_path / "tgt")
    data = tiny_data()
    data["target"]["path"] = "tgt"
    recipe = load_recipe(write_recipe(tmp_path, data))
    assert recipe.target.path == (tmp_path / "tgt").resolve()
    assert json.loads((recipe.target.path / "config.json").read_text())["model_type"] == "llama"
