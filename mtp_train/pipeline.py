"""The stages of a run, in order, and the plan that ``--dry-run`` prints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtp_train.errors import StageNotBuilt
from mtp_train.hf_checkpoint import check_target, find_checkpoint
from mtp_train.recipe import Recipe


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline: what it reads, what it writes, and how to run it."""

    name: str
    describe: Callable[[Recipe], str]
    run: Callable[..., object] | None  # run(recipe, **options); None: not built yet

    @property
    def built(self) -> bool:
        return self.run is not None


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _precompute(recipe: Recipe, **options) -> None:
    from precompute.run import run_precompute

    run_precompute(recipe, **options)


def _train(recipe: Recipe, **options) -> None:
    from mtp_train.train.trainer import run_train

    for kind in head_kinds(recipe):
        run_train(recipe.model_copy(update={"head": recipe.head.model_copy(update={"kind": kind})}))


def head_kinds(recipe: Recipe) -> list[str]:
    """``head.kind`` first, then the head kinds that ``eval.compare`` asks to compare against."""
    return [recipe.head.kind] + [k for k in dict.fromkeys(recipe.eval.compare) if k not in ("bigram", recipe.head.kind)]


def _eval(recipe: Recipe, baseline: Path | None = None, **options) -> None:
    from eval.run import run_eval

    run_eval(recipe, baseline)


def _report(recipe: Recipe, baseline: Path | None = None, **options) -> None:
    from eval.run import eval_dir, rerender

    if options.get("full_run"):  # the eval stage has just written it
        print(f"mtp-train: done; the report is {_rel(eval_dir(recipe) / 'report.html')} "
              f"(also report.md and report.json)")
        return
    rerender(recipe, baseline)


STAGES: tuple[Stage, ...] = (
    Stage(
        "precompute",
        lambda r: f"target {_rel(r.target.path)} over {len(r.data.train)} data file(s) "
        f"-> features {_rel(r.features_dir)} (layers {r.precompute.layers}, top-{r.precompute.topk})",
        _precompute,
    ),
    Stage(
        "train",
        lambda r: f"{' and '.join(head_kinds(r))} head(s) ({r.head.num_layers} layer(s), unroll {r.train.unroll}) "
        f"-> {_rel(r.output_dir / 'heads')}",
        _train,
    ),
    Stage(
        "eval",
        lambda r: f"speculative decoding on {', '.join(r.eval.prompt_sets)}, k={r.eval.k}, "
        f"T={r.eval.temperatures}" + (f", draft model {_rel(r.eval.draft_model)}" if r.eval.draft_model else "")
        + f" -> {_rel(r.output_dir / 'eval')}",
        _eval,
    ),
    Stage("report", lambda r: f"JSON, Markdown and HTML with plots -> {_rel(r.output_dir / 'eval')}", _report),
)
# Not part of a full run: exporting is asked for explicitly.
EXPORT = Stage("export", lambda r: f"{_rel(r.output_dir / 'heads' / r.head.kind)} -> DeepSeek-V3 MTP tensor names", None)
STAGE_BY_NAME = {s.name: s for s in (*STAGES, EXPORT)}


def check_inputs(recipe: Recipe) -> None:
    """Checks that need the files the recipe names, but no heavy imports."""
    ckpt = find_checkpoint(recipe.target.path)
    check_target(ckpt, recipe.target.tp)


def plan_text(recipe: Recipe, stages: tuple[Stage, ...] = STAGES) -> str:
    lines = ["plan:"]
    for i, stage in enumerate(stages, 1):
        status = "" if stage.built else "  [not built yet]"
        lines.append(f"  {i}. {stage.name:<10} {stage.describe(recipe)}{status}")
    return "\n".join(lines)


def run_stage(stage: Stage, recipe: Recipe, **options) -> None:
    if stage.run is None:
        raise StageNotBuilt(f"stage '{stage.name}' is not built yet; nothing was run or written")
    stage.run(recipe, **options)
