"""bench/peer_parity.py: a rerun starts from scratch unless told to reuse, and reuses only a run whose key still
matches; the goal is read from paired differences per cell and seed, whose standard error holds the seeds' spread."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import peer_parity as pp  # noqa: E402
import peer_runs as pr  # noqa: E402
from peer_table import goal_rows, paired_differences, pooled, verdict  # noqa: E402


def test_a_run_is_kept_only_when_reuse_is_asked_and_its_key_matches(tmp_path: Path) -> None:
    run = tmp_path / "sgd-1x-s0"
    key = {"conversations": "ab", "seed": 0, "code": "c1"}
    assert pr.fresh(run, key, reuse=True)  # nothing there yet
    (run / "ours").mkdir()
    assert not pr.fresh(run, dict(key), reuse=True) and (run / "ours").is_dir()
    assert pr.fresh(run, key, reuse=False) and not (run / "ours").exists()  # the default: from scratch
    (run / "ours").mkdir()
    assert pr.fresh(run, {**key, "code": "c2"}, reuse=True) and not (run / "ours").exists()  # changed code
    assert sorted(p.name for p in run.iterdir()) == ["key.json"]


def test_a_directory_digest_follows_every_file_it_holds(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    before = pr.dir_digest(tmp_path)
    assert pr.dir_digest(tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(b"weightz")  # a new head at the same path
    assert pr.dir_digest(tmp_path) != before


def _counts(drafts: int, accepted: list[int]) -> dict:
    return {"counts": {"drafts": drafts, "accepted_per_position": accepted}, "lossless": True}


def test_counters_pool_over_prompt_sets_and_runs_pair_by_cell_and_seed() -> None:
    assert pooled([{"drafts": 10, "accepted_per_position": [5, 2]},
                   {"drafts": 30, "accepted_per_position": [15, 6]}]).alphas == [0.5, 0.2]
    scores = {
        f"sgd × 1, seed {s}": {
            "ours": {3: {"heldout": _counts(100, [50 + s, 20, 10]), "mt_bench": _counts(100, [40, 10, 5])}},
            "specforge": {3: {"heldout": _counts(100, [40, 20, 10]), "mt_bench": _counts(100, [40, 10, 5 + s])}},
        } for s in range(3)}
    diffs = paired_differences(scores, 3, "specforge")
    assert [round(d, 6) for d in diffs["alpha1"]] == [0.05, 0.055, 0.06]
    assert [round(d, 6) for d in diffs["mal"]] == [0.05, 0.05, 0.05]
    said = dict((line.split(" at")[0], v) for line, v in goal_rows(scores, 3, "specforge"))
    assert said == {"alpha1": "ahead", "mal": "ahead"}


def test_the_verdict_is_level_within_two_standard_errors() -> None:
    mean, se, said = verdict([0.02, -0.01, 0.03, 0.0])
    assert math.isclose(mean, 0.01) and math.isclose(se, math.sqrt(0.001 / 3) / 2) and said == "level"
    assert verdict([-0.05, -0.04, -0.06])[2] == "behind"
    assert verdict([0.1])[1] == math.inf and verdict([0.1])[2] == "level"  # one run: no error, no claim


def test_the_tuned_row_gives_each_trainer_its_own_best_point(tmp_path: Path) -> None:
    import peer_sweep

    recipe = {"train": {"lr": 1e-3, "unroll": 2, "warmup_steps": 10}}
    assert sorted(pp.settings_rows(recipe, tmp_path)) == ["defaults", "matched"]  # no sweep yet
    grid = [{"lr": lr, "ttt": ttt, "ours": {"mal": mal_ours}, "specforge": {"mal": mal_theirs}}
            for lr, ttt, mal_ours, mal_theirs in ((1e-4, 7, 1.2, 1.5), (1e-3, 2, 1.6, 1.4), (3e-3, 7, 1.6, 1.1))]
    tuned = {"ours": peer_sweep.best(grid, "ours"), "specforge": peer_sweep.best(grid, "specforge")}
    assert tuned == {"ours": {"lr": 1e-3, "ttt": 2, "mal": 1.6}, "specforge": {"lr": 1e-4, "ttt": 7, "mal": 1.5}}
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    rows = pp.settings_rows(recipe, tmp_path)
    assert rows["tuned"] == ([],  # ours' best is the recipe's own point: the run is shared with the defaults row
                             {"specforge": {**pr.SPECFORGE, "lr": 1e-4, "ttt_length": 7}})  # speculators not swept
    elsewhere = pp.settings_rows({"train": {"lr": 3e-4, "unroll": 2, "warmup_steps": 10}}, tmp_path)
    assert elsewhere["tuned"][0] == ["train.lr=0.001"]
    (tmp_path / "tuned.json").write_text(json.dumps({**tuned, "ours_base": ["train.optimizer=muon"]}))
    assert pp.settings_rows(recipe, tmp_path)["tuned"][0] == ["train.optimizer=muon"]  # the base the sweep ran at
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    assert rows["defaults"][1] == {"specforge": pr.SPECFORGE, "speculators": pr.SPECULATORS}
    matched = rows["matched"][1]
    assert matched["specforge"]["vocab"] == matched["speculators"]["vocab"] == "ours"
    assert (matched["specforge"]["ttt_length"], matched["speculators"]["ttt_steps"]) == (2, 2)
    assert matched["specforge"]["warmup_steps"] == 10 and "warmup_ratio" not in matched["specforge"]


def test_an_outcome_is_kept_under_its_key_and_reused_only_when_asked(tmp_path: Path) -> None:
    stored, key = tmp_path / "results" / "sgd-1x-s0.json", {"seed": 0, "code": "c1", "rows": {"defaults": []}}
    assert pr.kept(stored, key, reuse=True) is None  # nothing there yet
    pr.keep(stored, key, {"wall_s": 12.0})
    assert pr.kept(stored, dict(key), reuse=True)["wall_s"] == 12.0
    assert pr.kept(stored, key, reuse=False) is None  # the default: from scratch
    assert pr.kept(stored, {**key, "code": "c2"}, reuse=True) is None  # changed code
    assert sorted(p.name for p in stored.parent.iterdir()) == ["sgd-1x-s0.json"]  # no temporary file left


def _cost(tokens_per_s: float, bytes_per_token: float, **extra: float) -> dict:
    return {"steps": 30, "tokens_trained": 30_000, "tokens_per_s": tokens_per_s, "bytes_per_token": bytes_per_token,
            **extra}


def test_the_report_reads_stored_outcomes_and_sets_each_side_of_ours_against_each_peer(capsys) -> None:
    from peer_table import report

    outcomes = {}
    for s in range(3):
        by_trainer = {"ours": {"3": {"heldout": _counts(100, [60 + s, 30, 10])}},
                      "ours-exact": {"3": {"heldout": _counts(100, [40 + s, 20, 10])}},
                      "specforge": {"3": {"heldout": _counts(100, [50, 20, 10])}}}  # k as JSON stores it
        theirs = "cpu y" if s == 2 else "cpu x"  # a peer's run kept from another machine: no cost ratio
        costs = {"ours": _cost(3000 + s, 4800, machine="cpu x"), "ours-exact": _cost(2000 + s, 4610, machine="cpu x"),
                 "specforge": _cost(1000, 9230, bytes_per_token_bf16=4622, machine=theirs)}
        outcomes[f"sgd-1x-s{s}"] = {"run": f"sgd × 1, seed {s}", "wall_s": 600.0, "costs": {"defaults": costs},
                                    "scores": {"defaults": by_trainer}, "machine": sorted({"cpu x", theirs})}
    report(outcomes, {"defaults": ([], {"specforge": {}})}, [3], ["a difference"])
    out = capsys.readouterr().out
    assert "- ahead: alpha1 at k = 3, ours − specforge over 3 runs (cells × seeds): +0.1100" in out
    assert "- behind: alpha1 at k = 3, ours-exact − specforge over 3 runs (cells × seeds): -0.0900" in out
    assert "tokens_per_s, ours-exact ÷ specforge: 2.00 ± 0.00 (2.00–2.00 over 2 runs on one machine each)" in out
    assert "tokens_per_s, ours ÷ specforge: 3.00 ± 0.00 (3.00–3.00 over 2 runs on one machine each)" in out
    assert "bytes/token, ours-exact ÷ specforge: 0.50" in out and "bytes/token, ours-exact ÷ specforge: 1.00" in out
    assert "- a difference" in out and "Wall time of the 3 cells: 0.50 h (every run's, summed), on cpu x; cpu y" in out


def test_a_run_is_kept_as_it_ends_and_only_a_run_not_kept_is_made_again(tmp_path: Path) -> None:
    made: list[str] = []

    def make(name: str) -> tuple[dict, Path]:
        made.append(name)
        return {"steps": 3}, tmp_path / name

    def score(head: Path) -> dict:
        return {3: {"heldout": {"head": head.name}}}

    units, key = tmp_path / "units", {"seed": 0, "trainer": "ours"}
    first = pr.unit(units / "ours.json", key, True, lambda: make("ours"), score)
    assert made == ["ours"] and first["scores"] == {"3": {"heldout": {"head": "ours"}}}  # as kept: k a string
    assert first["cost"]["machine"] == first["machine"] and first["wall_s"] >= 0

    def cut_short() -> tuple[dict, Path]:
        raise KeyboardInterrupt  # the session ends inside the second run

    try:
        pr.unit(units / "specforge.json", {**key, "trainer": "specforge"}, True, cut_short, score)
    except KeyboardInterrupt:
        pass
    assert sorted(p.name for p in units.iterdir()) == ["ours.json"]  # nothing half-written
    assert pr.unit(units / "ours.json", dict(key), True, lambda: make("again"), score) == first  # the next session
    assert made == ["ours"]
    assert pr.unit(units / "ours.json", key, False, lambda: make("again"), score)["scores"]["3"]["heldout"] == {
        "head": "again"} and made == ["ours", "again"]  # without --reuse: made again


def _handover(tokens: str = "t1", vocab: str | None = None) -> dict:
    return {"tokens_sha256": tokens, "mean_len": 100.0, "vocab_sha256": vocab}


def test_a_cell_trains_each_run_once_and_a_rerun_makes_only_the_runs_not_kept(tmp_path: Path, monkeypatch) -> None:
    trained: list[str] = []

    def train_ours(cell: Path, steps: int, overrides: list[str], seed: int, name: str) -> dict:
        trained.append(name)
        return {"steps": steps, "tokens_trained": 3000, "handover": _handover()}

    def train_peer(peer: str, job: dict, cell: Path, name: str) -> dict:
        assert job["total_steps"] == 30 and job["batch_size"] == 1 and job["tokens"] == str(cell / "ours.tokens.jsonl")
        trained.append(name)
        return {"steps": job["total_steps"], "lr": job["lr"]}

    monkeypatch.setattr(pp, "train_ours", train_ours)
    monkeypatch.setattr(pp, "train_peer", train_peer)
    monkeypatch.setattr(pp, "score", lambda cell, job, plain, ks, head: {k: {"heldout": head.name} for k in ks})
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    recipe = {"target": {"path": str(tmp_path / "target")}, "data": {"max_length": 64}}
    rows = {"defaults": ([], {"specforge": {"lr": 1e-4, "vocab": None}}),
            "tuned": ([], {"specforge": {"lr": 3e-3, "vocab": None}})}
    cell, units, key = tmp_path / "sgd-1x-s0", tmp_path / "units", {"seed": 0, "scoring": {}}

    def run(reuse: bool) -> dict:
        return pp.run_cell(cell, key, rows, 30, recipe, 2, lambda: {}, [3], units, reuse)

    first = run(False)
    assert trained == ["ours", pr.ours_name(pp.EXACT), "specforge-defaults", "specforge-tuned"]
    assert first["costs"]["tuned"]["specforge"]["lr"] == 3e-3 and first["costs"]["tuned"]["ours"]["steps"] == 30
    assert first["scores"]["defaults"]["ours-exact"] == {"3": {"heldout": pr.ours_name(pp.EXACT) + "-vllm"}}
    trained.clear()
    assert run(True)["scores"] == first["scores"] and trained == []  # everything kept
    (units / "specforge-tuned.json").unlink()  # the session ended inside this run
    assert run(True)["costs"]["tuned"]["specforge"]["lr"] == 3e-3
    assert trained == ["ours", "specforge-tuned"]  # ours again only for the tokens the peer trains on
    trained.clear()
    monkeypatch.setattr(pr, "CODE", ["tests/test_peer_keys.py"])  # our trainer's code changed: ours retrains,
    monkeypatch.setattr(pp, "code_digest", lambda: "another")    # the peers' runs on the same inputs are kept
    key = {**key, "code": pp.code_digest()}
    assert run(True)["scores"] == first["scores"] and trained == ["ours", pr.ours_name(pp.EXACT)]


def test_a_peers_key_is_its_content_not_our_code_or_its_paths(tmp_path: Path) -> None:
    """A peer's run is kept under its job less its paths, our vocabulary's digest where it takes ours, the target's
    weights, the scoring and its own code; our trainer's code is not in it."""
    (tmp_path / "config.json").write_text("{}")
    recipe = {"target": {"path": str(tmp_path)}, "data": {"max_length": 64}}
    cost = {"steps": 30, "tokens_trained": 3000, "handover": _handover(vocab="v1")}

    def key(cell: str = "a", cost: dict = cost, settings: dict | None = None, scoring: dict | None = None) -> dict:
        settings = settings or {"lr": 1e-3, "ttt_steps": 2, "vocab": None}
        job = pr.peer_job("speculators", tmp_path / cell, "ours", cost, recipe, settings, 2, 0, "speculators")
        assert job["seq_len"] == 3000 // cost["steps"] and job["tokens_sha256"] == cost["handover"]["tokens_sha256"]
        return pr.peer_key("speculators", job, cost, scoring or {"job": {}, "k": [3]})

    assert pr.key_sha(key()) == pr.key_sha(key("b"))  # another cell's directory, the same content
    assert "code" in key() and key()["code"] == pr.peer_code_digest() and key()["vocab_sha256"] is None
    assert key(cost={**cost, "handover": _handover("t2", "v1")}) != key()  # other tokens
    assert key(cost={**cost, "steps": 20}) != key()
    assert key(scoring={"job": {}, "k": [1, 3]}) != key()
    ours = {"lr": 1e-3, "ttt_steps": 2, "vocab": "ours"}
    assert key(settings=ours)["vocab_sha256"] == "v1"
    assert key(settings=ours, cost={**cost, "handover": _handover(vocab="v2")}) != key(settings=ours)


def test_a_peer_stops_when_our_run_hands_it_other_inputs_than_its_key_holds(tmp_path: Path, monkeypatch) -> None:
    import pytest

    monkeypatch.setattr(pp, "train_ours", lambda cell, steps, overrides, seed, name: {
        "steps": steps, "tokens_trained": 3000, "handover": _handover("changed")})
    monkeypatch.setattr(pp, "train_peer", lambda *a: pytest.fail("trained on other inputs"))
    recipe = {"target": {"path": str(tmp_path)}, "data": {"max_length": 64}}
    trainers = pp.Trainers(tmp_path, 30, 0, recipe, 2)
    settings = {"lr": 1e-3, "ttt_steps": 2, "vocab": None}
    kept = {"steps": 30, "tokens_trained": 3000, "handover": _handover("t1")}
    job = pr.peer_job("speculators", tmp_path, "ours", kept, recipe, settings, 2, 0, "speculators")
    with pytest.raises(SystemExit, match="other inputs than its kept cost: \\['tokens_sha256'\\]"):
        trainers.peer("speculators", [], settings, job)


def test_a_second_run_on_the_same_work_directory_stops_in_one_line(tmp_path: Path) -> None:
    import pytest

    with pp.held(tmp_path, "peer_parity"):
        with pytest.raises(SystemExit) as stopped:
            with pp.held(tmp_path, "peer_parity"):
                pass
        assert str(stopped.value).startswith(f"peer_parity: bench/peer_parity.py in {tmp_path}: ")
        with pp.held(tmp_path, "peer_sweep"):  # the sweep, run by the comparison in its process
            pass
    with pp.held(tmp_path, "peer_parity"):  # released when the first ended
        pass
    assert list(tmp_path.iterdir()) == []


def test_the_tuned_row_runs_at_every_seed_and_speculators_only_at_its_scales() -> None:
    import argparse

    args = argparse.Namespace(untuned_seeds=[0], speculators_scales=[1])
    rows = {"tuned": (["train.lr=0.003"], {"specforge": {"lr": 3e-3}, "speculators": {"lr": 1e-2}}),
            "defaults": ([], {"specforge": {"lr": 1e-4}, "speculators": {"lr": 1e-3}})}
    assert pp.cell_rows(rows, 1, 0, args) == rows
    assert pp.cell_rows(rows, 1, 2, args) == {"tuned": rows["tuned"]}
    assert pp.cell_rows(rows, 4, 0, args) == {"tuned": (["train.lr=0.003"], {"specforge": {"lr": 3e-3}}),
                                              "defaults": ([], {"specforge": {"lr": 1e-4}})}


def test_the_sweep_prints_the_grid_as_far_as_its_runs_are_kept(tmp_path: Path, capsys) -> None:
    import argparse

    import peer_sweep

    args = argparse.Namespace(lr=[1e-3, 3e-3], ttt=[2], peers=["specforge"], results=tmp_path, work=tmp_path,
                              threads=2)
    (tmp_path / "config.json").write_text("{}")
    recipe = {"target": {"path": str(tmp_path)}, "data": {"max_length": 64}}
    key = {"code": "c1", "steps": 30, "recipe": recipe, "scoring": {"sets": {}}, "ours_base": ["train.optimizer=muon"]}
    (ours_path, ours_key), peers = peer_sweep.point_runs(key, 1e-3, 2, ["specforge"], tmp_path)
    assert ours_path == tmp_path / "sweep" / f"{pr.ours_name(key['ours_base'])}-lr0.001-ttt2.json"
    assert ours_key["overrides"] == ["train.optimizer=muon", "train.lr=0.001", "train.unroll=2"]
    path, settings = peers["specforge"]
    assert path == tmp_path / "sweep" / "specforge-lr0.001-ttt2.json"
    assert settings == {**pr.SPECFORGE, "lr": 1e-3, "ttt_length": 2}
    cost = {"steps": 30, "tokens_trained": 3000, "handover": _handover()}
    pr.keep(ours_path, ours_key, {"cost": cost, "scores": {"3": {"validation": _counts(100, [30, 10, 0])}}})
    job = pr.peer_job("specforge", tmp_path / "sweep-sgd-1x-s0", pr.ours_name(ours_key["overrides"]), cost, recipe,
                      settings, 2, 0, path.stem)
    peer_key = pr.peer_key("specforge", job, cost, {"job": key["scoring"], "k": [3]})
    pr.keep(path, peer_key, {"scores": {"3": {"validation": _counts(100, [20, 0, 0])}}})
    peer_sweep.print_kept(key, args)
    assert capsys.readouterr().out.splitlines()[-2:] == ["| 0.001 | 2 | 1.400 | 1.200 | yes |",
                                                          "| 0.003 | 2 | – | – | – |"]
    pr.keep(path, {**peer_key, "code": "c0"}, {"scores": {}})  # made by other code: not shown
    peer_sweep.print_kept(key, args)
    assert capsys.readouterr().out.splitlines()[-2] == "| 0.001 | 2 | 1.400 | – | yes |"
