"""EAGLE 3.1's options on the eagle3 head (``head.fc_norm``, ``head.norm_output``), as speculators, vLLM 0.32 and
SGLang 0.5.23 define them: a norm of its own on each aux layer's state before ``fc``, and the output after the final
norm fed back to the next chained step. Trained (training-time test), drafted (the runtime's drafter), saved and
loaded, exported under the engines' names and keys, and refused for heads of other kinds."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_RECIPE, TINY_TARGET
from mtp_train.errors import UserError
from mtp_train.heads import build_head, head_spec
from mtp_train.heads.frozen import FrozenTarget
from mtp_train.models.config import ModelConfig
from mtp_train.train.data import Batch
from mtp_train.train.loss import LossWeights

VOCAB, HIDDEN, EPS = 96, 32, 1e-6
CFG = ModelConfig("llama", VOCAB, HIDDEN, 48, 1, 4, 2, 8, EPS, 128)


def _pair(cfg: ModelConfig = CFG, **options: bool):
    """An eagle3 head with ``options`` and one without, holding the same weights (the options' own norms random)."""
    torch.manual_seed(0)
    plain = build_head(head_spec("eagle3", 1, cfg, "fp", aux_layers=(1, 2, 3), draft_vocab=VOCAB))
    head = build_head(head_spec("eagle3", 1, cfg, "fp", aux_layers=(1, 2, 3), draft_vocab=VOCAB, **options))
    with torch.no_grad():
        plain.norm.weight.copy_(1 + 0.3 * torch.randn(cfg.hidden_size))
        missing = head.load_state_dict(plain.state_dict(), strict=False).missing_keys
        for norm in getattr(head, "fc_norm", []):
            norm.weight.copy_(1 + 0.3 * torch.randn(cfg.hidden_size))
    return head.eval(), plain.eval(), missing


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_fc_norm_norms_each_aux_layers_state_on_its_own_before_fc():
    head, plain, missing = _pair(fc_norm=True)
    assert missing == ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]  # its only weights of its own
    aux = torch.randn(7, 3 * HIDDEN) * torch.tensor([0.05, 1.0, 40.0]).repeat_interleave(HIDDEN)
    parts = aux.chunk(3, -1)
    with torch.no_grad():
        want = plain.fc(torch.cat([_rms(p, n.weight) for p, n in zip(parts, head.fc_norm)], -1))
        got = head.project(aux)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, plain.project(aux), atol=1e-2)  # the norms are applied
        one_norm = plain.fc(aux * torch.rsqrt(aux.pow(2).mean(-1, keepdim=True) + EPS))  # norm_before_fc's
        assert not torch.allclose(got, one_norm, atol=1e-2)  # per layer, not one norm over the concatenation
        louder = torch.cat([parts[0], parts[1] * 9.0, parts[2]], -1)  # each layer's scale is normed away
        torch.testing.assert_close(head.project(louder), got, rtol=1e-4, atol=1e-4)
        for norm in head.fc_norm:
            norm.weight.fill_(1.0)  # unit weights: a plain RMSNorm of each layer's state
        plain_rms = [torch.nn.functional.rms_norm(p, (HIDDEN,), eps=EPS) for p in parts]
        torch.testing.assert_close(head.project(aux), plain.fc(torch.cat(plain_rms, -1)), rtol=1e-5, atol=1e-5)


def test_norm_output_feeds_back_the_output_after_the_final_norm_and_keeps_the_logits():
    head, plain, missing = _pair(norm_output=True)
    assert missing == []  # no weights of its own
    out = 5 * torch.randn(6, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(head.feedback_state(out), _rms(out, plain.norm.weight), rtol=1e-5, atol=1e-5)
        assert torch.equal(plain.feedback_state(out), out)
        torch.testing.assert_close(head.draft_logits(out), plain.draft_logits(out))


@pytest.mark.parametrize("norm_output", [False, True])
def test_training_time_test_feeds_back_what_the_drafter_feeds_back(norm_output):
    """``ttt_loss`` calls the head once per unrolled step; step j > 0 reads step j-1's output as the runtime's drafter
    feeds it back: normed for a ``norm_output`` head, raw otherwise."""
    from mtp_train.train.ttt import ttt_loss

    head, _, _ = _pair(fc_norm=True, norm_output=norm_output)
    torch.manual_seed(1)
    frozen = FrozenTarget(CFG, torch.randn(VOCAB, HIDDEN), torch.ones(HIDDEN), torch.randn(VOCAB, HIDDEN))
    n, cu, k = 30, [0, 12, 30], 8
    lp, ids = torch.log_softmax(torch.randn(n, VOCAB), -1).topk(k, -1)
    batch = Batch(torch.randint(0, VOCAB, (n,)), torch.randn(n, HIDDEN), torch.ones(n, dtype=torch.bool), lp, ids,
                  torch.full((n,), -3.0), cu, aux=torch.randn(n, 3 * HIDDEN))
    calls = []

    def forward(embeds, hidden, positions, plan, aux=None):
        out = head(embeds, hidden, positions, plan, aux)
        calls.append((hidden, aux, out))
        return out

    with torch.no_grad():
        ttt_loss(head, frozen, batch, LossWeights(0.0, 1.0, 3, 0.8, "topk"), forward)
        assert len(calls) == 3 and calls[0][0] is None and torch.equal(calls[0][1], batch.aux)
        for (_, _, previous), (hidden, aux, _) in zip(calls, calls[1:]):
            assert aux is None
            want = _rms(previous, head.norm.weight) if norm_output else previous
            torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)


def test_the_runtimes_drafter_norms_the_layers_and_feeds_back_the_normed_output():
    from mtp_train.runtime.drafters import HeadDrafter
    from mtp_train.runtime.engine import Engine

    engine = Engine.from_pretrained(TINY_TARGET)
    h, eps = engine.cfg.hidden_size, engine.cfg.rms_norm_eps
    head, plain, _ = _pair(FrozenTarget.load(TINY_TARGET).cfg, fc_norm=True, norm_output=True)
    drafter = HeadDrafter(engine, head)
    captured = [torch.randn(5, h) * s for s in (0.1, 1.0, 30.0)]
    out = 4 * torch.randn(5, h)
    with torch.no_grad():
        want = plain.fc(torch.cat([_rms(c, n.weight, eps) for c, n in zip(captured, head.fc_norm)], -1))
        torch.testing.assert_close(drafter.features(None, captured), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(drafter.feedback(out), _rms(out, head.norm.weight, eps), rtol=1e-5, atol=1e-5)


def _saved(tmp_path, **options: bool):
    """A random eagle3 head with ``options`` saved as the trained head of a tiny-recipe run; the recipe."""
    from mtp_train.features.manifest import target_fingerprint
    from mtp_train.recipe import load_recipe
    from mtp_train.train.checkpoint import save_head

    cfg = FrozenTarget.load(TINY_TARGET).cfg
    torch.manual_seed(0)
    spec = head_spec("eagle3", 1, cfg, target_fingerprint(TINY_TARGET), aux_layers=(1, 2, 3), draft_vocab=1024,
                     **options)
    head = build_head(spec)
    with torch.no_grad():
        for norm in getattr(head, "fc_norm", []):
            norm.weight.copy_(1 + 0.3 * torch.randn(cfg.hidden_size))
    run = tmp_path / "run"
    save_head(run / "heads" / "eagle3", head, {})
    flags = [f"head.{k}={str(v).lower()}" for k, v in options.items()]
    return head, load_recipe(TINY_RECIPE, [f"output_dir={run}", "head.kind=eagle3", *flags])


def test_a_saved_head_loads_with_its_options_and_weights(tmp_path):
    from mtp_train.train.checkpoint import load_head

    head, recipe = _saved(tmp_path, fc_norm=True, norm_output=True)
    loaded = load_head(recipe.head_dir(), head.spec.target)
    assert (loaded.spec.fc_norm, loaded.spec.norm_output) == (True, True)
    aux, out = torch.randn(4, 3 * head.spec.target.hidden_size), torch.randn(4, head.spec.target.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded.project(aux), head.project(aux))
        torch.testing.assert_close(loaded.feedback_state(out), head.feedback_state(out))
    assert "per-layer normed" in loaded.spec.describe() and "after its final norm" in loaded.spec.describe()


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_the_export_writes_the_norms_under_the_engines_names_and_keys(tmp_path, fmt):
    from mtp_train.export import export_head

    head, recipe = _saved(tmp_path, fc_norm=True, norm_output=True)
    out = export_head(recipe, fmt, tmp_path / fmt)
    tensors = load_file(out / "model.safetensors")
    for i, norm in enumerate(head.fc_norm):
        assert torch.equal(tensors[f"fc_norm.{i}.weight"], norm.weight.detach())
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)  # top level in every format
    assert config.get("norm_before_fc", False) is False  # (the one norm over the concatenation: not this head's)


def test_a_head_without_the_options_exports_them_off(tmp_path):
    from mtp_train.export import export_head

    _, recipe = _saved(tmp_path)
    out = export_head(recipe, "speculators", tmp_path / "spec")
    assert not any(k.startswith("fc_norm") for k in load_file(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (False, False)


def test_the_options_are_refused_for_a_recipe_that_trains_no_eagle3_head():
    from mtp_train.recipe import load_recipe

    for name in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"):
        with pytest.raises(UserError, match=rf"head.{name}: applies to eagle3 heads only.*set head.kind: eagle3"):
            load_recipe(TINY_RECIPE, [f"head.{name}=true"])  # head.kind mtp, eval.compare eagle and bigram
    assert load_recipe(TINY_RECIPE, ["head.fc_norm=true", "eval.compare=[eagle3]"]).head.fc_norm  # a compared eagle3
    recipe = load_recipe(TINY_RECIPE, ["head.kind=eagle3", "head.fc_norm=true", "head.norm_output=true"])
    assert (recipe.head.fc_norm, recipe.head.norm_output) == (True, True)


def test_speculators_norms_are_recipe_fields_that_reach_the_trained_head():
    from mtp_train.recipe import load_recipe
    from mtp_train.train.recipe_checks import recipe_head_spec

    recipe = load_recipe(TINY_RECIPE, ["head.kind=eagle3", "head.norm_before_fc=true",
                                       "head.norm_before_residual=true"])
    spec = recipe_head_spec(recipe, CFG, "fp", (1, 2, 3))
    assert (spec.norm_before_fc, spec.norm_before_residual) == (True, True)
    assert "input_norm.weight" in build_head(spec).state_dict()
    with pytest.raises(UserError, match="head.norm_before_fc: .*speculators refuses the two together"):
        load_recipe(TINY_RECIPE, ["head.kind=eagle3", "head.norm_before_fc=true", "head.fc_norm=true"])
    plain = recipe_head_spec(load_recipe(TINY_RECIPE, ["head.kind=eagle3"]), CFG, "fp", (1, 2, 3))
    assert (plain.norm_before_fc, plain.norm_before_residual) == (False, False)
