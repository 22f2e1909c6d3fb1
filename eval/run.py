"""Stage 3: speculative decoding with the trained head (or a draft model) and the release report.

Read top to bottom: load the target into the runtime and the draft beside it -> the prompt sets ->
for each temperature, plain decoding through the runtime (the reference and the timing baseline) ->
for each k, speculative decoding of the same prompts (traces, wall time, lossless check at T = 0) ->
validation through the runtime -> ``report.json``, ``report.md``, ``report.html`` in ``OUTPUT_DIR/eval``.

Conventions: tau counts the tokens emitted per target verification step, bonus token included (plain
decoding has tau = 1); the prefill step's token is not a verification step. The draft cost ratio c is the
mean wall time of one batched draft forward in decode steps over that of one plain decode step (a step in
which every sequence decodes one token), both in this runtime at the same batch size, after a warm-up
(:mod:`mtp_train.eval.timing`); v, the verify cost ratio, is in the same plain decode steps: the plain decode step
with its one-token forward widened to the forward over a step's tokens, both forwards timed alone outside the
speculative loop at the plain run's batch sizes (:mod:`mtp_train.eval.verify_probe`). Trees
(``eval.trees``) sweep beside the chains. Lossless at T = 0 is :mod:`mtp_train.eval.lossless`'s check. The headline
is the lowest-temperature chain with the highest measured speedup.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mtp_train.eval.assemble import EvalContext, assemble_report
from mtp_train.eval.context_probe import context_costs
from mtp_train.eval.loading import baseline_path, draft_vocab, eval_prompts, load_eval, other_drafter
from mtp_train.eval.lossless import LosslessCheck, check_lossless, check_name, summarize
from mtp_train.eval.metrics import LosslessVerdict, PointTiming, RequestTrace, sweep_point
from mtp_train.eval.model_card import card_facts
from mtp_train.eval.prompts import EvalPrompt
from mtp_train.eval.render import keep_previous, write_report
from mtp_train.eval.report import FILES, Comparison, Report, SweepPoint, TreeSetting, load_report
from mtp_train.eval.samples import pick_samples
from mtp_train.eval.training_curve import training_curves
from mtp_train.eval.timing import plain_decode, step_costs, timed_generate, warm_up
from mtp_train.eval.verify_probe import probe_batches, verify_forward_s
from mtp_train.errors import UserError
from mtp_train.heads.conventions import validity_line
from mtp_train.lock import exclusive, rank_lock
from mtp_train.progress import Progress
from mtp_train.recipe import Recipe
from mtp_train.recipe_eval import EvalConfig
from mtp_train.runtime.engine import Engine
from mtp_train.runtime.sampling import SamplingParams
from mtp_train.runtime.sequence import Sequence, Status
from mtp_train.runtime.drafters import Drafter, HeadDrafter
from mtp_train.runtime.speculative import SpeculativeDecoder
from mtp_train.runtime.tree import TreeShape
from mtp_train.runtime.tree_decoder import TreeDecoder
from mtp_train.train.checkpoint import head_identity
from mtp_train.threads import set_threads, warn_if_oversubscribed
from mtp_train.features.manifest import target_fingerprint, text_fingerprint


def _fingerprint(recipe: Recipe, draft_id: str) -> str:
    """What the eval's outcome depends on: its settings, the target, the draft and every comparison draft."""
    compare = {name: _compare_id(recipe, name) for name in recipe.eval.compare}
    return text_fingerprint(json.dumps({"eval": recipe.eval.model_dump(mode="json"), "seed": recipe.seed,
                                        "draft": draft_id, "compare": compare,
                                        "target": target_fingerprint(recipe.target.path),
                                        "dtype": recipe.target.dtype}, sort_keys=True))


def _head_id(root: Path, what: str) -> str:
    """A trained head's identity: its config (training fingerprint, final metrics) and weight file size."""
    if not (root / "model.safetensors").is_file() or not (root / "config.json").is_file():
        raise UserError(f"{what}: no trained head in {root}; run `mtp-train train` first")
    return head_identity(root)


def _compare_id(recipe: Recipe, name: str) -> str:
    if name == "bigram":  # built from the training features
        manifest = recipe.features_dir / "manifest.json"
        return "bigram:" + (text_fingerprint(manifest.read_text()) if manifest.is_file() else "no features")
    if name == "target_mtp":  # part of the target, whose fingerprint the eval's already holds
        return "target_mtp"
    root = recipe.draft_dir(name)
    if name.startswith("imported/") and not (root / "model.safetensors").is_file():
        raise UserError(f"eval.compare: no {name!r} head in {root}; run `mtp-train import RECIPE SRC_DIR --name "
                        f"{name.removeprefix('imported/')}` first")
    return _head_id(root, "eval.compare")


def _draft_id(recipe: Recipe) -> str:
    if recipe.eval.draft_model is not None:
        return "draft_model:" + target_fingerprint(recipe.eval.draft_model)
    if recipe.eval.draft == "target_mtp":
        return "target_mtp"
    return _head_id(recipe.head_dir(), "head")


def run_eval(recipe: Recipe, baseline: Path | None = None) -> Path:
    """Evaluate, write the report, and return the report directory; skipped when it is complete and matches."""
    out = recipe.eval_dir
    baseline = baseline_path(recipe, baseline)
    draft_id = _draft_id(recipe)
    key = _fingerprint(recipe, draft_id)
    done = out / FILES["json"]
    old = _readable_report(done)
    if old is not None and old.settings.get("fingerprint") == key:
        print(f"eval: {out} is complete and matches the recipe; skipped", file=sys.stderr)
        if baseline is not None:
            write_report(old, out, baseline)
        return out
    with exclusive(rank_lock(out), "eval"):
        return _evaluate(recipe, key, old, baseline)


def _evaluate(recipe: Recipe, key: str, old: Report | None, baseline: Path | None) -> Path:
    """Run the eval's decoding and write its report (another eval's report, ``old``, is kept beside it)."""
    out, done = recipe.eval_dir, recipe.eval_dir / FILES["json"]
    # Everything the eval reads is loaded (and checked) here, before the first decoding step.
    start = time.perf_counter()
    set_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    engine, drafter, head_validation, others = load_eval(recipe)
    mode = drafter.name  # draft_target, mtp or eagle
    leader = engine.tp.is_leader  # under TP every rank decodes; the leader drafts, decides and writes
    prompts, token_ids, skipped, tokenizer = eval_prompts(recipe, engine)
    e = recipe.eval
    if leader:
        print(f"eval: {mode}, {len(prompts)} prompts from {', '.join(e.prompt_sets)}, k={e.k}, T={e.temperatures}, "
              f"batch {e.batch_size}", file=sys.stderr)
    warn_if_oversubscribed("eval", leader)
    plain = _plain_runs(recipe, engine, prompts, token_ids)
    checks: list[LosslessCheck] = []  # one per T = 0 sweep point of every draft
    replies: dict[tuple[int, float], list[list[int]]] = {}  # (k, T) -> the head's output tokens per prompt
    sweep, trees = _sweep(engine, drafter, prompts, token_ids, plain, e, checks, replies)
    comparisons = _comparisons(recipe, engine, drafter, others, prompts, token_ids, plain, checks)
    verdict = summarize(checks, check_name(engine))
    validation = head_validation() if head_validation else None  # collective: every rank scores
    if not leader:  # the leader alone holds the head's numbers and writes the report
        torch.distributed.barrier()
        return out
    context = EvalContext(mode=mode, fingerprint=key, num_prompts=len(prompts), skipped=skipped,
                          lossless=verdict.pop("lossless"), lossless_detail=verdict.pop("lossless_detail"),
                          validation=validation)
    report = assemble_report(recipe, sweep, context)
    report.tree_sweep, report.comparisons = trees, comparisons
    for name, value in verdict.items():
        setattr(report, name, value)
    spec = None
    if isinstance(drafter, HeadDrafter):
        spec = drafter.head.spec
        report.head_convention = f"{spec.convention}: {spec.describe()}"
        report.serving = validity_line(spec.kind, spec.choices, engine.cfg.family)
    params = sum(p.numel() for p in drafter.head.parameters()) if spec is not None else None
    report.card = card_facts(recipe, engine.cfg, spec, params, target_fingerprint(recipe.target.path))
    report.training = training_curves(recipe)
    reference = [r.tokens for r in plain[report.temperature][1]]
    report.samples = pick_samples(prompts, replies[report.k, report.temperature], reference, tokenizer,
                                  compared=report.temperature == 0)
    if done.is_file():  # another eval's report (other settings, or unreadable): keep it beside this one
        kept = keep_previous(out, old.created if old is not None else None)
        print(f"eval: the previous report (other settings) is kept in {kept}", file=sys.stderr)
    paths = write_report(report, out, baseline)
    print(f"eval: report -> {paths['html']} ({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    if engine.tp.size > 1:
        torch.distributed.barrier()
    return out


def _readable_report(path: Path) -> Report | None:
    """The report at ``path``, or ``None`` when there is none or it cannot be read."""
    if not path.is_file():
        return None
    try:
        return load_report(path)
    except UserError:
        return None


def rerender(recipe: Recipe, baseline: Path | None = None) -> Path:
    """``mtp-train report``: write report.md/html again from report.json, with a baseline if given."""
    path = recipe.eval_dir / FILES["json"]
    if not path.is_file():
        raise UserError(f"{path} not found; run `mtp-train eval` first")
    paths = write_report(load_report(path), path.parent, baseline_path(recipe, baseline))
    print(f"report: {paths['html']}", file=sys.stderr)
    return path.parent


# -- decoding ----------------------------------------------------------------------------------------------

def _plain_runs(recipe: Recipe, engine: Engine, prompts: list[EvalPrompt], token_ids: list[list[int]]) -> dict:
    """Plain decoding of every prompt at each temperature: ``{T: (params, results, timing)}``, after a warm-up."""
    e = recipe.eval
    # Warm-up: the first forwards of a process pay one-off costs (allocations, kernel selection) that would
    # otherwise be charged to the plain baseline alone and inflate every measured speedup.
    # (Each draft gets its own warm-up before its sweep, in _sweep.)
    warm = token_ids[: e.batch_size]
    plain_decode(engine, warm, [SamplingParams(max_new_tokens=4)] * len(warm))
    plain = {}
    for temperature in e.temperatures:
        params = [SamplingParams(temperature=temperature, max_new_tokens=e.max_new_tokens,
                                 seed=recipe.seed * 1_000_003 + i) for i in range(len(prompts))]
        progress = Progress(f"eval: plain T={temperature:g}", len(prompts), "prompts", enabled=engine.tp.is_leader)
        plain[temperature] = (params, *plain_decode(engine, token_ids, params, lambda s: _advance(progress, s)))
        progress.close()
    return plain


def _comparisons(recipe: Recipe, engine: Engine, drafter: Drafter, others: dict[str, Any], prompts, token_ids,
                 plain: dict, checks: list[LosslessCheck]) -> list[Comparison]:
    """The sweep of every other draft (``eval.compare``) on the same prompts; the heads among them draft from this
    head's vocabulary (``eval.draft_vocab``'s where this draft is no head or an eagle3 head with its own)."""
    comparisons = []
    own = isinstance(drafter, HeadDrafter) and not drafter.own_vocab  # (an eagle3 head's vocabulary is its own)
    vocab = drafter.vocab if own else draft_vocab(recipe, engine.cfg.vocab_size)
    for name in recipe.eval.compare:
        other = other_drafter(engine, name, others[name], vocab)
        points, trees = _sweep(engine, other, prompts, token_ids, plain, recipe.eval, checks)
        comparisons.append(Comparison(name=name, sweep=points, tree_sweep=trees))
    return comparisons


def _sweep(engine: Engine, drafter: Drafter, prompts, token_ids, plain: dict, e: EvalConfig,
           checks: list[LosslessCheck], replies: dict | None = None) -> tuple[list[SweepPoint], list[SweepPoint]]:
    """Speculative decoding at every k (chains) and every tree of ``e``, at each temperature of ``plain`` (its
    params, results, timing), after an untimed warm-up of this draft. Each temperature-0 point adds its lossless
    check to ``checks``; with ``replies``, each chain's output tokens are kept there under ``(k, T)``. Each chain's
    length buckets get the draft's c at their context (:mod:`mtp_train.eval.context_probe`)."""
    shapes = [TreeShape(t.topk, t.depth, t.draft_tokens) for t in e.trees]
    warm_up(engine, drafter, token_ids, max(e.k), list(plain), shapes)
    widths = [(1, False)] + [(k + 1, False) for k in e.k] + [(s.draft_tokens, True) for s in shapes]
    batches = probe_batches([timing.decode_batches for _, _, timing in plain.values()])  # as the batch shrank
    verify = verify_forward_s(engine, _contexts(token_ids, next(iter(plain.values()))[1], e.batch_size),
                              list(dict.fromkeys(widths)), drafter.capture, batches or None)
    decode = verify[1, False]
    chains, trees = [], []
    for temperature, (params, reference, timing) in plain.items():
        for k in e.k:
            decoder = SpeculativeDecoder(engine, drafter, k)
            point, tokens = _point(engine, decoder, f"k={k}", prompts, token_ids, params, reference, timing, checks,
                                   (verify[k + 1, False], decode))
            chains.append(point)
            if replies is not None:
                replies[k, temperature] = tokens
        for shape in shapes:
            decoder = TreeDecoder(engine, drafter, shape)
            point, _ = _point(engine, decoder, f"tree {shape.describe()}", prompts, token_ids, params, reference,
                              timing, checks, (verify[shape.draft_tokens, True], decode))
            point.tree = TreeSetting(topk=shape.topk, depth=shape.depth, draft_tokens=shape.draft_tokens)
            trees.append(point)
    costs = context_costs(engine, drafter, max(e.k), token_ids)
    for point in chains:
        for bucket, group in point.by_length.items():
            group.draft_cost_ratio = None if bucket not in costs else round(costs[bucket], 4)
    return chains, trees


def _contexts(token_ids: list[list[int]], results, batch: int) -> list[list[int]]:
    """The verify probe's contexts: the first ``batch`` prompts, each with the first half of its plain reply."""
    return [ids + r.tokens[: len(r.tokens) // 2] for ids, r in zip(token_ids[:batch], results)]


def _point(engine: Engine, decoder: SpeculativeDecoder, label: str, prompts, token_ids, params, reference,
           timing, checks: list[LosslessCheck], probe: tuple[float, float]) -> tuple[SweepPoint, list[list[int]]]:
    """One timed speculative run of every prompt with ``decoder`` at ``params``' temperature: its sweep point (and
    at T = 0 its lossless check, added to ``checks``) and its output tokens. ``probe``: the seconds of the verify
    forward of this step's width and of a one-token forward by batch size, timed together (``step_costs`` weighs
    them by the plain run's decode steps and puts v in plain decode steps)."""
    drafter, k, temperature = decoder.drafter, decoder.k, params[0].temperature
    progress = Progress(f"eval: {drafter.name} {label} T={temperature:g}", len(prompts), "prompts",
                        enabled=engine.tp.is_leader, summary=False)  # the line below sums it up
    results, spec_s = timed_generate(decoder, token_ids, params, lambda seqs: _advance(progress, seqs))
    progress.close()
    check = None
    if temperature == 0:
        check = check_lossless(engine, f"{drafter.name}, {label}", [p.prompt_id for p in prompts], token_ids,
                               reference, results, decoder.greedy_violations)
        checks.append(check)
    c, v, cost = step_costs(decoder.timings, timing, probe, spec_s)
    verdict = LosslessVerdict() if check is None else LosslessVerdict(
        check.lossless, check.greedy_violations, len(check.divergences))
    point = sweep_point(k, temperature, request_traces(prompts, token_ids, results),
                        PointTiming(c, timing.wall_s / spec_s, v, cost), verdict, forwards=drafter.forwards_per_step)
    if engine.tp.is_leader:
        print(f"eval: {drafter.name} {label} T={temperature:g}: tau {point.tau:.3f}, alpha "
              f"{[round(a, 3) for a in point.alpha]}, c {c:.3f} ({cost.draft_forward_ms:.3f} ms / "
              f"{cost.plain_decode_step_ms:.3f} ms), v {'n/a' if v is None else f'{v:.3f}'}, "
              f"expected x{point.expected_speedup:.2f}, measured x{point.measured_speedup:.2f}"
              + ("" if check is None else f", lossless {check.lossless}"), file=sys.stderr)
    return point, [r.tokens for r in results]


def _advance(progress: Progress, seqs: list[Sequence]) -> None:
    """Bring ``progress`` to the prompts finished and the tokens generated so far."""
    finished = sum(s.status is Status.FINISHED for s in seqs)
    progress.update(finished - progress.done, sum(len(s.output) for s in seqs) - progress.tokens)


def request_traces(prompts, token_ids, results) -> list[RequestTrace]:
    return [RequestTrace(p.prompt_id, p.category, len(ids), r.stats.accepted, r.stats.emitted, r.tokens,
                         r.stats.drafted)
            for p, ids, r in zip(prompts, token_ids, results)]
