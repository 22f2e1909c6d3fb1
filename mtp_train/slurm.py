"""``mtp-train slurm``: render the sbatch templates in ``slurm/`` for a recipe, submit them as a chain, wait.

The chain is four jobs, each submitted with ``--dependency=afterok:<previous> --kill-on-invalid-dep=yes``,
so a failure cancels everything after it:

1. ``precompute.sbatch``: a job array; task i of N writes the features of row block i (TP inside the task);
   online (``precompute.mode: online``) it plans them instead, on one CPU task unless it regenerates answers;
2. ``verify.sbatch``: the array's final step: writes ``manifest.json`` if no task did, runs ``mtp-train verify``;
3. ``train.sbatch``: torchrun on every node, requeued after a SIGUSR1 so that it resumes from ``latest``;
4. ``eval.sbatch``: the eval and the report.

Templates carry ``{{NAME}}`` placeholders; rendered scripts go to ``OUTPUT_DIR/slurm/`` and can be
resubmitted by hand. Every SLURM command runs with a timeout.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtp_train.errors import UserError
from mtp_train.io import write_atomic
from mtp_train.host_plan import job_hosts
from mtp_train.recipe import Recipe

TEMPLATES = Path(__file__).resolve().parents[1] / "slurm"
JOBS = ("precompute", "verify", "train", "eval")
SLURM_TIMEOUT = 60  # seconds for one sbatch/scontrol/scancel call
CPU_OVERRIDES = ("target.dtype=float32", 'train.mixed_precision="no"')  # (plain `no` is YAML for false)
# Job states after which a job does nothing more (without accounting, scontrol knows them for MinJobAge).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "SPECIAL_EXIT"}


@dataclass(frozen=True)
class SlurmOptions:
    """Cluster settings for the rendered scripts; the CLI flags of ``mtp-train slurm``."""

    nodes: int = 1  # training nodes
    gpus_per_node: int = 8
    procs_per_node: int | None = None  # training processes per node; default: gpus_per_node (CPU mode: 1)
    array_tasks: int | None = None  # precompute tasks; default: as many as the training GPUs hold TP groups
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    train_time: str = "24:00:00"
    precompute_time: str = "12:00:00"
    eval_time: str = "04:00:00"
    cpu: bool = False  # no GPUs: gloo, fp32, ACCELERATE_USE_CPU=1
    venv: Path | None = None  # `source VENV/bin/activate` in every script
    setup: str | None = None  # shell line(s) run first in every script: module load, conda activate, ...
    srun_args: str = ""  # extra srun flags, e.g. a container image for pyxis
    signal_lead: int = 300  # seconds before the time limit that SIGUSR1 comes (the checkpoint must fit)
    job_name: str | None = None
    extra_sbatch: tuple[str, ...] = field(default_factory=tuple)  # more `#SBATCH` options for every job

    def check(self, recipe: Recipe) -> None:
        for name in ("nodes", "gpus_per_node", "procs_per_node", "array_tasks", "cpus_per_task", "signal_lead"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be at least 1 (got {value})")
        for name in ("partition", "account", "train_time", "precompute_time", "eval_time", "job_name"):
            value = getattr(self, name)
            if value is not None and (not value or re.search(r"\s", value)):
                raise UserError(f"--{name.replace('_', '-')}: {value!r} must be one word")
        for option in self.extra_sbatch:
            if "\n" in option or not option.startswith("--"):
                raise UserError(f"--sbatch: {option!r} must be one sbatch option starting with --")
        if not self.cpu and recipe.target.tp > self.gpus_per_node:
            raise UserError(f"target.tp: {recipe.target.tp} exceeds --gpus-per-node {self.gpus_per_node}; "
                            f"a precompute task runs its TP group on one node")
        if recipe.precompute.mode == "online" and self.train_procs % recipe.target.tp:
            raise UserError(f"target.tp: {recipe.target.tp} does not divide the {self.train_procs} training processes "
                            "per node; online, each node's training processes form whole TP groups")

    @property
    def train_procs(self) -> int:
        return self.procs_per_node or (1 if self.cpu else self.gpus_per_node)

    def tasks(self, recipe: Recipe) -> int:
        if self.array_tasks:
            return self.array_tasks
        if recipe.precompute.mode == "online" and not recipe.data.regenerate:  # it only plans: no target
            return 1
        return 2 if self.cpu else max(1, self.nodes * self.gpus_per_node // recipe.target.tp)


def _sbatch_lines(opts: SlurmOptions, gpus: int, cpus: int | None, memory: int | None = None) -> str:
    lines = [f"--partition={opts.partition}" if opts.partition else None,
             f"--account={opts.account}" if opts.account else None,
             f"--cpus-per-task={cpus}" if cpus else None,
             f"--mem={math.ceil(memory / 2**30)}G" if memory else None,
             f"--gres=gpu:{gpus}" if gpus and not opts.cpu else None,
             *opts.extra_sbatch]
    return "\n".join(f"#SBATCH {line}" for line in lines if line)


def _setup(opts: SlurmOptions, threads: int) -> str:
    lines = []
    if opts.setup:
        lines.append(opts.setup.strip())
    if opts.venv:
        lines.append(f"source {shlex.quote(str(opts.venv))}/bin/activate")
    lines.append("export PYTHONUNBUFFERED=1")
    if opts.cpu:  # gloo and fp32 on CPUs; one BLAS thread per allocated CPU
        lines.append(f"export ACCELERATE_USE_CPU=1 OMP_NUM_THREADS={threads}")
    return "\n".join(lines)


def render(recipe_path: Path, overrides: list[str], recipe: Recipe, opts: SlurmOptions) -> dict[str, str]:
    """The four scripts' text, by job name."""
    opts.check(recipe)
    tp = recipe.target.tp
    plans_only = recipe.precompute.mode == "online" and not recipe.data.regenerate  # no target in precompute
    cpus = opts.cpus_per_task or (max(1, tp) if opts.cpu else None)
    hosts = {} if opts.cpu else job_hosts(recipe, opts.train_procs, opts.cpus_per_task)
    values = {
        "JOB_NAME": opts.job_name or f"mtp-{recipe.output_dir.name}",
        "RECIPE": shlex.quote(str(recipe_path.resolve())),
        "OVERRIDES": " ".join(shlex.quote(o) for o in ([*CPU_OVERRIDES] if opts.cpu else []) + list(overrides)),
        "FEATURES_DIR": shlex.quote(str(recipe.features_dir)),
        "LOG_DIR": str(log_dir(recipe)),
        "TP": str(tp),
        "PRECOMPUTE_TP": "1" if plans_only else str(tp),
        "LAST_TASK": str(opts.tasks(recipe) - 1),
        "NODES": str(opts.nodes),
        "PROCS_PER_NODE": str(opts.train_procs),
        "PRECOMPUTE_TIME": opts.precompute_time,
        "TRAIN_TIME": opts.train_time,
        "EVAL_TIME": opts.eval_time,
        "SIGNAL_LEAD": str(opts.signal_lead),
        "SRUN_ARGS": f" {opts.srun_args.strip()}" if opts.srun_args.strip() else "",
        "SBATCH_PRECOMPUTE": _sbatch_lines(opts, 0 if plans_only else tp, *hosts.get("precompute", (cpus, None))),
        "SBATCH_VERIFY": _sbatch_lines(opts, 0, 1 if opts.cpu else opts.cpus_per_task),
        "SBATCH_TRAIN": _sbatch_lines(opts, opts.gpus_per_node, *hosts.get("train", (
            opts.cpus_per_task or (opts.train_procs if opts.cpu else None), None))),
        "SBATCH_EVAL": _sbatch_lines(opts, tp, *hosts.get("eval", (cpus, None))),
    }
    if " " in values["LOG_DIR"]:
        raise UserError(f"output_dir: {recipe.output_dir} has a space, which #SBATCH --output cannot take")
    scripts = {}
    for job in JOBS:
        template = TEMPLATES / f"{job}.sbatch"
        if not template.is_file():
            raise UserError(f"{template}: template not found (mtp-train slurm runs from a clone of the repository)")
        threads = max(1, (cpus or 1) // (opts.train_procs if job == "train" else 1))
        text = template.read_text().replace("{{SETUP}}", _setup(opts, threads))

        def fill(match: re.Match) -> str:
            if match.group(1) not in values:
                raise UserError(f"{template}: unknown placeholder {match.group(0)}")
            return values[match.group(1)]

        text = re.sub(r"\{\{([A-Z_]+)\}\}", fill, text)
        scripts[job] = re.sub(r"\n{3,}", "\n\n", text.replace("\n\n#SBATCH", "\n#SBATCH"))
    return scripts


def log_dir(recipe: Recipe) -> Path:
    return recipe.slurm_dir / "logs"


def write_scripts(scripts: dict[str, str], recipe: Recipe) -> dict[str, Path]:
    """Write each script atomically (temp file, fsync, rename) into ``OUTPUT_DIR/slurm/``."""
    out = recipe.slurm_dir
    log_dir(recipe).mkdir(parents=True, exist_ok=True)  # SLURM does not create the --output directory
    paths = {}
    for job, text in scripts.items():
        path = out / f"{job}.sbatch"
        write_atomic(path, text, mode=0o755)
        paths[job] = path
    return paths


def sbatch_commands(paths: dict[str, Path]) -> list[list[str]]:
    """The chain's sbatch command lines; ``$PRECOMPUTE`` etc. stand for the ids of the jobs before."""
    commands = []
    for i, job in enumerate(JOBS):
        cmd = ["sbatch", "--parsable"]
        if i:
            cmd += [f"--dependency=afterok:${JOBS[i - 1].upper()}", "--kill-on-invalid-dep=yes"]
        commands.append([*cmd, str(paths[job])])
    return commands


def _slurm(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    if shutil.which(cmd[0]) is None:
        raise UserError(f"{cmd[0]} not found on PATH; run on a SLURM login node, or use --dry-run")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SLURM_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise UserError(f"{' '.join(cmd[:2])}: no answer from SLURM in {SLURM_TIMEOUT}s") from None
    if check and proc.returncode != 0:
        message = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()[-1]
        raise UserError(f"{' '.join(cmd[:2])}: {message}")
    return proc


def submit(paths: dict[str, Path]) -> dict[str, str]:
    """Submit the chain; return the job ids by job name. On a failed submission, cancel the ones before it."""
    ids: dict[str, str] = {}
    for job, cmd in zip(JOBS, sbatch_commands(paths)):
        for name, job_id in ids.items():
            cmd = [c.replace(f"${name.upper()}", job_id) for c in cmd]
        try:
            out = _slurm(cmd).stdout.strip()
        except UserError:
            if ids:
                _slurm(["scancel", *ids.values()], check=False)
            raise
        ids[job] = out.split(";")[0]
    return ids


@dataclass
class JobRecord:
    """One line of ``scontrol show job -o``: a job, or one task of an array."""

    job_id: str
    state: str
    reason: str
    exit_code: str
    task: str | None  # array task id, or a range for tasks not started yet
    stdout: str

    @property
    def label(self) -> str:
        return f"array task {self.task} (job {self.job_id})" if self.task is not None else f"job {self.job_id}"


def job_records(job_id: str) -> list[JobRecord] | None:
    """Every record of a job (all tasks of an array), or None when SLURM no longer knows it."""
    proc = _slurm(["scontrol", "show", "job", "-o", job_id], check=False)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise UserError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
    records = []
    for line in proc.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if not fields.get("JobId"):
            continue
        array = fields.get("ArrayJobId")
        records.append(JobRecord(
            job_id=f"{array}_{fields['ArrayTaskId']}" if array else fields["JobId"],
            state=fields.get("JobState", "UNKNOWN"), reason=fields.get("Reason", ""),
            exit_code=fields.get("ExitCode", ""), task=fields.get("ArrayTaskId") if array else None,
            stdout=fields.get("StdOut", "")))
    return records


def _never_runs(r: JobRecord) -> bool:
    return r.state == "PENDING" and r.reason == "DependencyNeverSatisfied"


def _last_line(path: str) -> str:
    """The log's last line that is the program's own (not srun's or slurmstepd's)."""
    try:
        lines = [line.strip() for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    own = [line for line in lines if not line.startswith(("srun:", "slurmstepd"))]
    return (own or lines or [""])[-1]


@dataclass
class ChainResult:
    ok: bool
    lines: list[str]


def wait_chain(ids: dict[str, str], timeout: float | None = None, poll: float = 1.0) -> ChainResult:
    """Poll until every job of the chain has finished (or will never run); say what happened to each.

    A failed array task is named with its exit code and the last line of its log; the jobs after it
    are reported as cancelled because their dependency can never be satisfied.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        records = {job: job_records(job_id) for job, job_id in ids.items()}
        settled = all(rs is None or all(r.state in FINAL_STATES or _never_runs(r) for r in rs)
                      for rs in records.values())
        if settled:
            break
        if deadline is not None and time.monotonic() > deadline:
            states = ", ".join(f"{job} {'/'.join(sorted({r.state for r in rs or []})) or 'gone'}"
                               for job, rs in records.items())
            raise UserError(f"the chain did not finish in {timeout:.0f}s ({states})")
        time.sleep(poll)
    lines, ok = [], True
    for job, rs in records.items():
        if rs is None:
            ok = False
            lines.append(f"{job}: job {ids[job]} is no longer known to SLURM (finished over MinJobAge ago)")
            continue
        failed = [r for r in rs if r.state != "COMPLETED"]
        if not failed:
            tasks = f", {len(rs)} array tasks" if rs[0].task is not None else ""
            lines.append(f"{job}: job {ids[job]} COMPLETED{tasks}")
            continue
        ok = False
        for r in failed:
            if _never_runs(r) or r.reason == "DependencyNeverSatisfied":
                lines.append(f"{job}: {r.label} {r.state} because an earlier job failed "
                             f"(DependencyNeverSatisfied); it never ran")
            else:
                last = _last_line(r.stdout)
                lines.append(f"{job}: {r.label} {r.state}, exit code {r.exit_code}; log {r.stdout}"
                             + (f": {last}" if last else ""))
    return ChainResult(ok, lines)


def merge_features(root: Path) -> int:
    """The array's final step: write ``manifest.json`` from complete rank manifests when no task did, then check
    every shard's size and header and the rows' coverage (each array task checked its own shards' sha256)."""
    from mtp_train.features.manifest import MERGED
    from mtp_train.features.verify import load_features_manifest, verify
    from mtp_train.precompute.run import merge_manifests

    if (root / MERGED).is_file():
        print(f"merge: {root / MERGED} exists")
    else:
        manifest = load_features_manifest(root)
        if merge_manifests(root, manifest.world_size) is None:
            print(f"merge: {root}: not every one of {manifest.world_size} ranks is complete", file=sys.stderr)
            return 1
        print(f"merge: wrote {root / MERGED}")
    problems, manifest = verify(root, contents=False)
    for problem in problems:
        print(f"merge: {problem}", file=sys.stderr)
    if not problems:  # an online plan stores no shard: its rows' coverage is all there is to check
        print(f"merge: {len(manifest.shards)} " + ("planned shards' rows' coverage: OK (online: nothing stored)" if
              manifest.online else "shards' sizes and headers, and the rows' coverage: OK (their sha256 were "
              "checked by the array tasks that wrote them)"))
    return 1 if problems else 0


def preflight(recipe: Recipe, tasks: int) -> list[str]:
    """Precompute's template and loss-mask checks on the first rows, and the features' disk over ``tasks`` array
    tasks (refused when their filesystem lacks it), before anything is queued, where this node sees the data and the
    target (a login node may not: then the precompute job runs the checks). The disk plan's lines."""
    if all(p.exists() for p in recipe.data.train) and (recipe.target.path / "config.json").is_file():
        from mtp_train.precompute.preflight import check_first_rows

        disk = check_first_rows(recipe, tasks)
        disk.check()
        return disk.lines()
    print("slurm: data.train or target.path is not visible on this node; the chat-template check runs in the "
          "precompute job", file=sys.stderr)
    return []


def run_slurm(recipe_path: Path, overrides: list[str], recipe: Recipe, opts: SlurmOptions, dry_run: bool,
              wait: bool) -> int:
    """``mtp-train slurm``: check the data, render, then print (dry run) or write, submit, and optionally wait."""
    disk = preflight(recipe, opts.tasks(recipe))
    scripts = render(recipe_path, overrides, recipe, opts)
    out = recipe.slurm_dir
    paths = {job: out / f"{job}.sbatch" for job in JOBS}
    if dry_run:
        for job in JOBS:
            print(f"# ---- {paths[job]} ----")
            print(scripts[job], end="" if scripts[job].endswith("\n") else "\n")
        print("# ---- submission (each job waits for the one before; a failure cancels the rest) ----")
        for job, cmd in zip(JOBS, sbatch_commands(paths)):
            words = " ".join(c if c.startswith("--dependency=") else shlex.quote(c) for c in cmd)
            print(f"{job.upper()}=$({words})")
        print("\n".join(f"# {line}" for line in disk), end="\n" if disk else "")
        return 0
    if shutil.which("sbatch") is None:
        raise UserError("sbatch not found on PATH; run on a SLURM login node, or use --dry-run")
    write_scripts(scripts, recipe)
    ids = submit(paths)
    print(f"slurm: scripts in {out}, logs in {log_dir(recipe)}")
    for job in JOBS:
        print(f"{job}: {ids[job]}")
    sys.stdout.flush()
    if not wait:
        return 0
    result = wait_chain(ids)
    for line in result.lines:
        print(f"slurm: {line}", file=sys.stdout if result.ok else sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":  # `python -m mtp_train.slurm merge FEATURES_DIR`, run by verify.sbatch
    if len(sys.argv) != 3 or sys.argv[1] != "merge":
        sys.exit("usage: python -m mtp_train.slurm merge FEATURES_DIR")
    try:
        sys.exit(merge_features(Path(sys.argv[2])))
    except UserError as e:
        print(f"merge: {e}", file=sys.stderr)
        sys.exit(2)
