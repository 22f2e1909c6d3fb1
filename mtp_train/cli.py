"""``mtp-train``: the command line.

Start-up stays light (no torch, no transformers) so that ``--help`` is instant; each
stage imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_USER_ERROR = 2
RECIPE_STAGES = ("precompute", "train", "eval", "report", "export")

USAGE = """\
mtp-train RECIPE.yaml [KEY.PATH=VALUE ...] [--dry-run]     run every stage in order
mtp-train {precompute,train,eval,report,export} RECIPE.yaml [KEY.PATH=VALUE ...] [--dry-run]
mtp-train verify FEATURES_DIR                               check every shard's checksum
mtp-train precompute RECIPE.yaml [--overwrite] [--rank R --world-size W]
mtp-train {eval,report} RECIPE.yaml [--baseline OLD/report.json]
mtp-train export RECIPE.yaml --format {vllm,sglang,speculators} [--out DIR] [--head imported/NAME]
mtp-train import RECIPE.yaml SRC_DIR [KEY.PATH=VALUE ...] [--layout {speculators,vllm,sglang,eagle}] [--name NAME]
mtp-train slurm RECIPE.yaml [KEY.PATH=VALUE ...] [--nodes N --gpus-per-node G --cpu ...] [--dry-run] [--wait]"""

DESCRIPTION = """\
Train speculative-decoding draft heads (DeepSeek-V3 MTP with RMSNorms restored, EAGLE)
and measure them with real speculative decoding.

stages:
  precompute  run the target over the dataset and write features (hidden states, top-K logits)
  train       train the draft head on the features against the frozen embedding and lm_head
  eval        speculative decoding with the head: acceptance, speedup, lossless check
  report      write the JSON, Markdown and HTML release report
  export      write the trained head in a serving engine's format (--format vllm|sglang|speculators)
  import      read a head another trainer wrote (speculators, vLLM, SGLang/SpecForge, EAGLE) for the recipe's
              target, into OUTPUT_DIR/imported/NAME
  verify      check a features directory against its manifest
  slurm       render the sbatch scripts for a recipe and submit them as a chain (slurm --help)

exit status: 0 done, 1 verify found a problem (or a SLURM job failed: slurm --wait), 2 bad input (one line
on stderr), 75 training stopped by SIGUSR1/SIGTERM after a checkpoint (rerun resumes)."""


class OneLineParser(argparse.ArgumentParser):
    """Usage errors are user errors: one line on stderr, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: {message} (see --help)\n")
        sys.exit(EXIT_USER_ERROR)


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", type=Path, metavar="RECIPE.yaml", help="the recipe file")
    p.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="override recipe fields, e.g. train.lr=1e-4")
    p.add_argument("--dry-run", action="store_true", help="print the resolved recipe and the stage plan, then exit")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="mtp-train", usage=USAGE, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # prog: without it a subcommand's usage errors would start with the whole multi-line USAGE
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser, metavar="", prog="mtp-train")
    run = sub.add_parser("run", help=argparse.SUPPRESS)
    _add_recipe_args(run)
    run.add_argument("--overwrite", action="store_true", help="replace outputs made from a different recipe")
    for name in RECIPE_STAGES:
        p = sub.add_parser(name, help=argparse.SUPPRESS)
        _add_recipe_args(p)
        if name == "precompute":
            p.add_argument("--overwrite", action="store_true", help="replace features made from a different recipe")
            p.add_argument("--rank", type=int, help="this worker's rank (default: from SLURM array or torchrun)")
            p.add_argument("--world-size", type=int, help="number of workers sharing the rows")
        if name in ("eval", "report"):
            p.add_argument("--baseline", type=Path, help="an earlier report.json: add deltas and flag regressions")
        if name == "export":
            p.add_argument("--format", dest="export_format", required=True, choices=("vllm", "sglang", "speculators"),
                           help="the serving engine whose format to write")
            p.add_argument("--out", type=Path, help="output directory (default: OUTPUT_DIR/export/KIND-FORMAT)")
            p.add_argument("--head", metavar="imported/NAME", help="export a head `mtp-train import` wrote instead of "
                           "the recipe's trained head")
    imp = sub.add_parser("import", help=argparse.SUPPRESS)
    imp.add_argument("recipe", type=Path, metavar="RECIPE.yaml", help="the recipe (its target and output_dir)")
    imp.add_argument("source", type=Path, metavar="SRC_DIR", help="the head's directory (config.json and weights)")
    imp.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="override recipe fields")
    imp.add_argument("--layout", choices=("speculators", "vllm", "sglang", "eagle"),
                     help="the engine the file was written for, where its config cannot tell")
    imp.add_argument("--name", help="the imported head's name (default: SRC_DIR's)")
    verify = sub.add_parser("verify", help=argparse.SUPPRESS)
    verify.add_argument("features_dir", type=Path, metavar="FEATURES_DIR")
    _add_slurm_parser(sub)
    return parser


def _add_slurm_parser(sub) -> None:
    p = sub.add_parser("slurm", help=argparse.SUPPRESS, description="Render slurm/*.sbatch for the recipe into "
                       "OUTPUT_DIR/slurm/ and submit precompute (array) -> verify -> train -> eval, each with "
                       "--dependency=afterok on the one before. Prints the job ids.")
    _add_recipe_args(p)
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, default=1, help="training nodes (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    g.add_argument("--procs-per-node", type=int, help="training processes per node (default: GPUs per node; "
                   "1 with --cpu)")
    g.add_argument("--array-tasks", type=int, help="precompute array tasks (default: nodes x GPUs / target.tp; "
                   "2 with --cpu)")
    g.add_argument("--partition", help="#SBATCH --partition")
    g.add_argument("--account", help="#SBATCH --account")
    g.add_argument("--cpus-per-task", type=int, help="#SBATCH --cpus-per-task")
    g.add_argument("--time", dest="train_time", default="24:00:00", help="training time limit (default 24:00:00)")
    g.add_argument("--precompute-time", default="12:00:00", help="time limit per array task (default 12:00:00)")
    g.add_argument("--eval-time", default="04:00:00", help="eval time limit (default 04:00:00)")
    g.add_argument("--signal-lead", type=int, default=300, help="seconds before the time limit that the training "
                   "job is told to checkpoint and requeue (default 300)")
    g.add_argument("--sbatch", dest="extra_sbatch", action="append", default=[], metavar="OPTION",
                   help="another #SBATCH option for every job, e.g. --sbatch=--qos=high (repeatable)")
    g.add_argument("--job-name", help="job name prefix (default: mtp-OUTPUT_DIR's name)")
    e = p.add_argument_group("environment")
    e.add_argument("--cpu", action="store_true", help="no GPUs: gloo, fp32, ACCELERATE_USE_CPU=1")
    e.add_argument("--venv", help="virtual environment to activate in every job (default: the one running this; "
                   "'none' for none)")
    e.add_argument("--setup", help="shell line(s) run first in every job, e.g. 'module load cuda/12.4'")
    e.add_argument("--srun-args", default="", help="extra srun flags, e.g. '--container-image=IMAGE'")
    p.add_argument("--wait", action="store_true", help="wait for the chain; exit 1 and name the failed job or "
                   "array task if one fails")


def _dispatch(args: argparse.Namespace) -> int:
    from mtp_train.pipeline import (STAGE_BY_NAME, STAGES, check_data, check_inputs, check_memory, check_recipe,
                                    memory_text, plan_text)
    from mtp_train.recipe import load_recipe, recipe_to_yaml

    if args.command == "verify":
        return _verify(args.features_dir)
    if args.command == "import":
        return _import(args)

    recipe = load_recipe(args.recipe, args.overrides)
    check_inputs(recipe)
    if args.command == "slurm":
        check_recipe(recipe, STAGES)  # what a job would refuse from the recipe: refused before any is queued
        if not args.cpu:  # the jobs would refuse at their start on the GPUs: refuse before queueing them
            check_memory(recipe, STAGES)
        return _slurm(args, recipe)
    stages = STAGES if args.command == "run" else (STAGE_BY_NAME[args.command],)
    # Every refusal a planned stage makes from the recipe alone, before the first stage runs (and in a dry run).
    # (an imported head's format checks read its own config, when the export loads it)
    check_recipe(recipe, stages, None if getattr(args, "head", None) else getattr(args, "export_format", None))
    if args.dry_run:
        disk = check_data(recipe, stages)
        check_memory(recipe, stages)
        print("# resolved recipe")
        print(recipe_to_yaml(recipe), end="")
        print(plan_text(recipe, stages))
        print(memory_text(recipe))
        print("\n".join(disk), end="\n" if disk else "")
        return 0
    for stage in stages:
        options = {}
        if stage.name == "precompute":
            options["overwrite"] = args.overwrite
            if args.command == "precompute":
                options.update(rank=args.rank, world=args.world_size)
        if stage.name == "export":
            options.update(fmt=args.export_format, out=args.out, name=args.head)
        if stage.name in ("eval", "report"):
            options["baseline"] = getattr(args, "baseline", None)
            options["full_run"] = args.command == "run"
        stage.run(recipe, **options)
    return 0


def _slurm(args: argparse.Namespace, recipe) -> int:
    from mtp_train.slurm import SlurmOptions, run_slurm

    if args.venv is None:  # the environment running this command, when it is a virtual environment
        venv = Path(sys.prefix) if sys.prefix != sys.base_prefix else None
    else:
        venv = None if args.venv == "none" else Path(args.venv).resolve()
    opts = SlurmOptions(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, procs_per_node=args.procs_per_node,
        array_tasks=args.array_tasks, partition=args.partition, account=args.account,
        cpus_per_task=args.cpus_per_task, train_time=args.train_time, precompute_time=args.precompute_time,
        eval_time=args.eval_time, cpu=args.cpu, venv=venv, setup=args.setup, srun_args=args.srun_args,
        signal_lead=args.signal_lead, job_name=args.job_name, extra_sbatch=tuple(args.extra_sbatch),
    )
    return run_slurm(args.recipe, args.overrides, recipe, opts, args.dry_run, args.wait)


def _import(args: argparse.Namespace) -> int:
    from mtp_train.importer import import_recipe_head
    from mtp_train.recipe import load_recipe

    out = import_recipe_head(load_recipe(args.recipe, args.overrides), args.source, args.layout, args.name)
    print(f"import: {out}")
    return 0


def _verify(root: Path) -> int:
    from mtp_train.features.verify import verify

    problems, manifest = verify(root)
    for problem in problems:
        print(f"mtp-train: verify: {problem}", file=sys.stderr)
    totals = manifest.totals()
    stored = ("planned for online training, nothing stored" if manifest.online
              else f"{totals['bytes_per_token']} bytes/token")
    print(
        f"verify: {root}: {len(manifest.shards)} shards, {totals['sequences']:,} sequences, {totals['tokens']:,} "
        f"tokens, {stored}, ranks {sorted(manifest.ranks)} of {manifest.world_size}: "
        + ("OK" if not problems else f"{len(problems)} problem(s)")
    )
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    positionals = [a for a in argv if not a.startswith("-")]
    if positionals and positionals[0] not in (*RECIPE_STAGES, "verify", "slurm", "import"):
        argv.insert(0, "run")
    parser = build_parser()
    # Overrides may follow flags (`RECIPE --dry-run a.b=c`), which argparse's
    # positional list does not allow; collect them from the leftovers.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        print("mtp-train: give a recipe, e.g. `mtp-train recipes/tiny.yaml` (see --help)", file=sys.stderr)
        return EXIT_USER_ERROR

    from mtp_train.errors import UserError

    try:
        return _dispatch(args)
    except UserError as e:
        print(f"mtp-train: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("mtp-train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
