"""The eval stage is skipped only when nothing it depends on changed."""

from __future__ import annotations


def test_eval_fingerprint_changes_when_a_comparison_head_is_retrained(tmp_path):
    """The eval is skipped only when nothing it depends on changed, comparison heads included."""
    from conftest import TINY_TARGET
    from mtp_train.eval.run import _fingerprint
    from mtp_train.recipe import Recipe

    for kind in ("mtp", "eagle"):
        root = tmp_path / "run" / "heads" / kind
        root.mkdir(parents=True)
        (root / "config.json").write_text('{"training_fingerprint": "a"}')
        (root / "model.safetensors").write_bytes(b"x" * 8)
    recipe = Recipe.model_validate({"output_dir": str(tmp_path / "run"), "target": {"path": str(TINY_TARGET)},
                                    "data": {"train": [str(tmp_path / "d.jsonl")]},
                                    "eval": {"compare": ["eagle", "bigram"]}})
    before = _fingerprint(recipe, "head:mtp")
    assert _fingerprint(recipe, "head:mtp") == before
    (tmp_path / "run" / "heads" / "eagle" / "config.json").write_text('{"training_fingerprint": "b"}')
    assert _fingerprint(recipe, "head:mtp") != before
