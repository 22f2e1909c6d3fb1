"""The release report: JSON round trip, Markdown and HTML content, plots, baseline comparison, bad input."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from mtp_train.eval.plots import PLOTS
from mtp_train.eval.render import render_html, render_markdown, write_report
from mtp_train.eval.report import Group, Report, Sample, SweepPoint, compare, load_report
from mtp_train.errors import UserError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAKE_PLOTS = {key: PNG_MAGIC for key in PLOTS}  # for tests about text only: rendering plots takes seconds
TAU_SENTENCE = "τ counts tokens emitted per target verification step, bonus token included; plain decoding has τ = 1"


def _groups(tau: float, names: list[str], n: int = 4) -> dict[str, Group]:
    return {
        name: Group(num_prompts=n, tau=tau + 0.1 * i, alpha=[0.8 - 0.05 * i, 0.6], distinct2=0.9, measured_speedup=1.3)
        for i, name in enumerate(names)
    }


def _point(k: int, t: float) -> SweepPoint:
    alpha = [0.82, 0.64, 0.5][:k]
    uncond = [0.82, 0.52, 0.26][:k]
    tau = 1.0 + sum(uncond)
    c = 0.08
    return SweepPoint(
        k=k, temperature=t, tau=tau - 0.1 * t, alpha=alpha, alpha_unconditional=uncond, draft_cost_ratio=c,
        expected_speedup=(tau - 0.1 * t) / (1 + k * c), measured_speedup=1.4 if t == 0 else None,
        distinct2=0.91 + 0.02 * t, lossless=True if t == 0 else None, num_prompts=8, num_steps=120,
        generated_tokens=256, by_category=_groups(tau, ["chat", "code"]),
        by_length=_groups(tau, ["0-127", "128-511", "512+"], n=3),
    )


def make_report(**changes) -> Report:
    sweep = [_point(k, t) for k in (1, 2) for t in (0.0, 0.7)]
    head = sweep[2]  # k=2, T=0
    fields = dict(
        tau=head.tau, alpha=head.alpha, alpha_unconditional=head.alpha_unconditional, k=head.k,
        temperature=head.temperature, lossless=True, lossless_detail=None, draft_cost_ratio=head.draft_cost_ratio,
        expected_speedup=head.expected_speedup, measured_speedup=head.measured_speedup, distinct2=head.distinct2,
        by_category=head.by_category, by_length=head.by_length,
        val_loss=[1.9, 2.6], val_acc=[0.55, 0.38], trainer_val_loss=[1.91, 2.61], trainer_val_acc=[0.55, 0.37],
        val_tolerance=0.05, val_mismatch=False, sweep=sweep, mode="mtp",
        settings={"k": [1, 2], "temperature": [0.0, 0.7], "num_prompts": 8, "max_new_tokens": 32},
        versions={"mtp-train": "0.1.0", "torch": "2.13.0", "python": "3.11"},
        device="cpu (test)", created="2025-01-01T00:00:00Z",
    )
    fields.update(changes)
    return Report(**fields)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """make_report() written once (with real plots) for the tests that only read it."""
    return write_report(make_report(), tmp_path_factory.mktemp("report"))


def test_json_round_trip_and_keys(written: dict[str, Path]):
    assert set(written) == {"json", "md", "html", "card"}
    assert all(p.is_file() for p in written.values())
    assert {p.name for p in written["json"].parent.iterdir()} == {"report.json", "report.md", "report.html",
                                                                   "model_card.md"}

    data = json.loads(written["json"].read_text())
    for key in ("tau", "alpha", "k", "temperature", "lossless", "val_loss", "val_acc", "draft_cost_ratio",
                "expected_speedup", "measured_speedup", "distinct2", "by_category", "settings", "versions"):
        assert key in data, key
    assert load_report(written["json"]) == make_report()


def test_html_is_self_contained_with_every_png_plot(written: dict[str, Path]):
    page = written["html"].read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert page.count("data:image/png;base64,") == len(PLOTS) == len(images) == 6
    for data in images:
        assert base64.b64decode(data).startswith(PNG_MAGIC)
    assert "<script" not in page
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "τ" in page and "chat" in page and "512+" in page


def test_markdown_states_tau_convention_and_tables(written: dict[str, Path]):
    md = written["md"].read_text()
    assert TAU_SENTENCE in md
    for heading in ("α by draft position", "Sweep", "prompt category", "context length", "Validation per unrolled step",
                    "Lossless", "Settings"):
        assert heading in md, heading
    assert "| 128-511 |" in md and "| code |" in md
    assert "MISMATCH" not in md and "REGRESSION" not in md


def test_html_escapes_text():
    report = make_report(by_category=_groups(2.0, ["<script>alert(1)</script>"]), device="gpu & <b>")
    page = render_html(report, FAKE_PLOTS)
    assert "<script>" not in page and "&lt;script&gt;" in page and "gpu &amp; &lt;b&gt;" in page


def test_baseline_regression(tmp_path: Path, written: dict[str, Path]):
    old = written["json"]
    new = make_report()
    new.tau *= 0.8
    new.lossless = False
    new.lossless_detail = "prompt 3 (chat): token 17 differs (speculative 42, plain 7)"
    paths = write_report(new, tmp_path / "new", baseline=old)

    diff = new.baseline
    assert diff is not None and diff.path == str(old)
    assert diff.regressions
    assert any(line.startswith("tau fell from") for line in diff.regressions)
    assert any("lossless" in line for line in diff.regressions)
    assert diff.deltas["tau"] == pytest.approx(-0.2 * make_report().tau)
    assert "tau@k=2,T=0" in diff.deltas and "val_loss[0]" in diff.deltas

    assert "REGRESSION" in paths["md"].read_text()
    assert "REGRESSION" in paths["html"].read_text()
    assert load_report(paths["json"]).baseline == diff


def test_baseline_equal_report_has_no_regressions(tmp_path: Path, written: dict[str, Path]):
    old = written["json"]
    new = make_report()
    paths = write_report(new, tmp_path / "new", baseline=old)
    assert new.baseline is not None and new.baseline.regressions == []
    assert all(d == 0 for d in new.baseline.deltas.values())
    assert "REGRESSION" not in paths["md"].read_text()
    assert "No regressions" in paths["md"].read_text()


def test_an_expected_speedup_with_a_measured_verify_cost_is_not_compared_with_one_without(tmp_path: Path,
                                                                                            written: dict[str, Path]):
    """A baseline from before v was measured took v = 1: its expected speedup is another quantity."""
    new = make_report(verify_cost_ratio=1.6, expected_speedup=make_report().expected_speedup / 1.6)
    write_report(new, tmp_path / "new", baseline=written["json"])
    assert "expected_speedup" not in new.baseline.deltas and not new.baseline.regressions
    assert any("expected speedup not compared" in note for note in new.baseline.notes)


def test_compare_thresholds():
    base = make_report()
    # Within thresholds: tau -1 %, measured speedup -4 %, val loss +1 %.
    ok = make_report(tau=base.tau * 0.99, measured_speedup=base.measured_speedup * 0.96,
                     val_loss=[v * 1.01 for v in base.val_loss])
    assert compare(ok, base, "b.json").regressions == []
    # Beyond: measured speedup -6 %, val loss +3 % at step 1, val acc -5 % at step 0, new mismatch.
    bad = make_report(measured_speedup=base.measured_speedup * 0.94, val_loss=[1.9, 2.6 * 1.03],
                      val_acc=[0.55 * 0.95, 0.38], val_mismatch=True)
    lines = compare(bad, base, "b.json").regressions
    assert any(line.startswith("measured_speedup fell") for line in lines)
    assert any(line.startswith("val_loss[1] rose") for line in lines)
    assert any(line.startswith("val_acc[0] fell") for line in lines)
    assert any("val_mismatch" in line for line in lines)
    assert len(lines) == 4


def test_corrupt_baseline_is_a_user_error_naming_the_file(tmp_path: Path):
    bad = tmp_path / "old.json"
    bad.write_text("{not json")
    with pytest.raises(UserError) as exc:
        write_report(make_report(), tmp_path / "out", baseline=bad)
    msg = str(exc.value)
    assert str(bad) in msg and "\n" not in msg
    assert not (tmp_path / "out").exists()  # nothing partial written

    with pytest.raises(UserError, match="missing.json"):
        load_report(tmp_path / "missing.json")


def test_schema_mismatch_names_the_first_bad_field(tmp_path: Path, written: dict[str, Path]):
    data = json.loads(written["json"].read_text())
    path = tmp_path / "report.json"
    data["tau"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as exc:
        load_report(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: field 'tau': ") and "\n" not in msg

    del data["tau"]
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="field 'schema_version'"):
        load_report(path)


def test_val_mismatch_is_flagged():
    report = make_report(trainer_val_loss=[1.5, 2.0], val_mismatch=True)
    assert "**MISMATCH" in render_markdown(report)
    assert 'class="flag">MISMATCH' in render_html(report, FAKE_PLOTS)


def test_lossless_is_na_without_a_temperature_zero_point():
    sweep = [_point(k, 0.7) for k in (1, 2)]
    report = make_report(sweep=sweep, lossless=None, temperature=0.7)
    md = render_markdown(report)
    assert "| lossless (every T=0 sweep point) | n/a (no T=0 sweep point) |" in md
    assert "Lossless: n/a. No sweep point ran at temperature 0" in md
    assert "NOT LOSSLESS" not in md and "Lossless: yes" not in md
    assert not compare(report, make_report(), "old").regressions  # n/a is not "went from true to false"


def test_text_samples_section_marks_identity_with_plain_decoding():
    samples = [Sample(prompt_set="mt_bench", category="writing", prompt="[user] Write a haiku.", reply="Leaves fall",
                      identical_to_plain=True),
               Sample(prompt_set="spec_bench", category="qa", prompt="[user] Why?", reply="Because | so",
                      identical_to_plain=False)]
    report = make_report(samples=samples)
    md = render_markdown(report)
    section = md.split("## Text samples (chain k=2, T=0)")[1].split("\n## ")[0]
    assert "1. mt_bench / writing: identical to plain decoding" in section
    assert "2. spec_bench / qa: DIFFERS from plain decoding" in section
    assert "```text\nPROMPT\n[user] Write a haiku.\n\nREPLY\nLeaves fall\n```" in section
    assert "REPLY\nBecause | so" in render_html(report, FAKE_PLOTS).replace("&#x27;", "'")
    assert load_report_round_trip(report).samples == samples
    assert "Text samples" not in render_markdown(make_report())


def load_report_round_trip(report: Report) -> Report:
    return Report.model_validate_json(report.model_dump_json())


def test_a_report_written_before_the_lossless_check_and_c_terms_still_loads(written: dict[str, Path], tmp_path: Path):
    data = json.loads(written["json"].read_text())
    for key in ("lossless_check", "near_tie_nats", "greedy_violations", "num_divergences", "divergences"):
        data.pop(key)
    for point in data["sweep"]:
        for key in ("cost", "greedy_violations", "divergences"):
            point.pop(key)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    old = load_report(path)
    assert old.lossless_check is None and old.divergences == [] and old.sweep[0].cost is None
    md = render_markdown(old)
    assert "Check: token identity, at temperature 0" in md and "Lossless: yes." in md
    assert "This report does not record the terms of c." in md
    assert "not recorded (the expected speedup takes v = 1)" in md


def _with_drafts() -> Report:
    """make_report() with an eagle head and the bigram decoded beside it, and a draft tree."""
    from mtp_train.eval.report import Comparison, TreeSetting

    others = [Comparison(name=name, sweep=[_point(k, t).model_copy(update={"tau": 1.2 + 0.1 * k})
                                           for k in (1, 2) for t in (0.0, 0.7)]) for name in ("eagle", "bigram")]
    tree = _point(2, 0.0).model_copy(update={"measured_speedup": 1.9, "tree": TreeSetting(topk=4, depth=2,
                                                                                           draft_tokens=8)})
    return make_report(comparisons=others, tree_sweep=[tree], by_prompt_set=_groups(1.8, ["heldout", "spec_bench"]))


def test_every_plot_shows_every_draft_with_one_panel_per_temperature():
    from mtp_train.eval.plots import figures

    report = _with_drafts()
    for point in [*report.sweep, *(p for c in report.comparisons for p in c.sweep)]:
        point.by_prompt_set = _groups(1.8, ["heldout", "spec_bench"])
    figs = figures(report)
    assert list(figs) == list(PLOTS)

    def labels(fig) -> list[str]:
        return [t.get_text() for legend in fig.legends for t in legend.get_texts()]

    for key in ("alpha", "tau_by_k", "speedup_by_k"):
        titles = [ax.get_title() for ax in figs[key].axes]
        assert len(titles) == 2 and titles[0].endswith("T=0") and titles[1].endswith("T=0.7"), (key, titles)
    assert labels(figs["alpha"]) == [f"{d} {w}" for d in ("mtp", "eagle", "bigram")
                                     for w in ("conditional", "unconditional")]
    assert all(ax.get_xlabel() == "draft position j (k=2)" for ax in figs["alpha"].axes), "the deepest k"
    assert labels(figs["speedup_by_k"]) == [f"{d} {w}" for d in ("mtp", "eagle", "bigram")
                                            for w in ("measured", "expected")]
    assert labels(figs["tau_by_k"]) == ["mtp τ", "eagle τ", "bigram τ"], "no engine MAL recorded here"
    sets, cats = figs["tau_by_group"].axes
    assert [t.get_text() for t in sets.get_xticklabels()] == ["heldout", "spec_bench"]
    assert [t.get_text() for t in cats.get_xticklabels()] == ["chat", "code"]
    assert len(sets.patches) == len(cats.patches) == 6 and labels(figs["tau_by_group"]) == ["mtp", "eagle", "bigram"]
    assert labels(figs["tau_by_length"]) == ["mtp", "eagle", "bigram"]


def test_the_model_card_block_opens_both_pages_and_its_file():
    from mtp_train.eval.model_card import card_markdown

    report = _with_drafts()
    report.card = {"target": "`tiny` (llama, 4 layers)", "head": "mtp, 1 decoder layer(s)", "data": "`sgd.jsonl`"}
    report.serving = "Valid in this runtime only."
    card = card_markdown(report)
    greedy = sorted((p for p in report.sweep if p.temperature == 0), key=lambda p: p.k)
    assert card.startswith("## Model card\n\n- **Target**: `tiny` (llama, 4 layers)\n- **Head**: mtp")
    assert "- **Data and steps**: `sgd.jsonl`" in card
    assert f"(tokens per target step, bonus included, T = 0): {greedy[0].tau:.2f} / {greedy[1].tau:.2f} at k = 1 / 2" in card
    assert "- **α₁**: 0.820 (k = 1, T = 0)" in card
    assert "- **Best measured speedup**: 1.90× (tree (top-4, depth 2, 8 tokens), T = 0, batch ?, cpu (test))" in card
    assert "- **Lossless**: yes" in card and "- **Valid for**: Valid in this runtime only." in card
    md = render_markdown(report)
    assert md.split("\n", 2)[2].startswith(card)
    page = render_html(report, FAKE_PLOTS)
    assert page.index("<h2>Model card</h2>") < page.index("<h2>Headline") and '<pre class="card">## Model card' in page
