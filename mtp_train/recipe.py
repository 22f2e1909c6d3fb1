"""The recipe: a strict schema (unknown keys are errors), YAML loading and dotted overrides.

Relative paths in a recipe, including those given as overrides, resolve against the
directory of the recipe file, so a recipe means the same thing from any working directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from mtp_train.errors import UserError
from mtp_train.recipe_eval import EvalConfig
from mtp_train.recipe_head import HeadConfig
from mtp_train.recipe_rules import check_rules
from mtp_train.recipe_types import PROMPT_SETS, RecipePath, Section  # noqa: F401 (PROMPT_SETS: the eval's)


class TargetConfig(Section):
    """The frozen target model."""

    path: RecipePath = Field(
        description="HF-format checkpoint directory: `config.json`, `model.safetensors` or "
        "`model.safetensors.index.json`, and the tokenizer files."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype of the target. `auto` is float32 on CPU and bfloat16 on CUDA."
    )
    tp: PositiveInt = Field(
        1, description="Tensor-parallel ranks for the target. Must divide its attention and KV heads."
    )
    attention_backend: Literal["auto", "torch", "flashinfer"] = Field(
        "auto", description="Attention kernels: `auto` picks flashinfer on CUDA when it is installed (the `gpu` extra), "
        "and torch otherwise."
    )
    trust_remote_code: bool = Field(
        False, description="Allow the tokenizer's custom Python code to run. Off unless you trust the checkpoint."
    )
    kv_cache_gb: PositiveFloat | None = Field(
        None, description="The KV cache per rank, in GiB. Unset: 0.5 on CPU (where it bounds how many sequences "
        "regeneration decodes at once: the sequences whose prompts and answers fit); on CUDA, what "
        "`gpu_memory_fraction` of the GPU leaves once the weights are loaded. In the eval the drafts' K/V pools "
        "share it with the target's in proportion to their layers (a one-layer head on a 32-layer target: 1/33)."
    )
    gpu_memory_fraction: float = Field(
        0.9, gt=0.0, le=1.0, description="On CUDA, with `kv_cache_gb` unset: the share of the GPU's memory that "
        "the weights (the target's and, in the eval, the drafts') and the KV cache may fill together; the rest is "
        "left for activations."
    )


class SamplingConfig(Section):
    """Sampling settings for generating answers."""

    temperature: NonNegativeFloat = Field(0.0, description="0 is greedy.")
    top_k: NonNegativeInt = Field(0, description="Keep the k most likely tokens; 0 turns it off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass to keep; 1 turns it off.")
    max_new_tokens: PositiveInt = Field(256, description="Longest generated answer, in tokens.")
    seed: int = Field(0, description="Base seed; each request derives its own from it.")


class DataConfig(Section):
    """The training dataset."""

    train: list[RecipePath] = Field(
        description="Local JSONL, JSON or Parquet files, or saved HF dataset directories. "
        "A single path may be given as a string."
    )
    format: Literal["auto", "sharegpt", "openai", "prompt_completion", "text"] = Field(
        "auto", description="Row format; `auto` detects it per dataset."
    )
    max_length: PositiveInt = Field(
        2048, description="Sequences longer than this many tokens are truncated, and the count is reported."
    )
    max_rows: PositiveInt | None = Field(None, description="Use only the first N rows; null uses all.")
    heldout_rows: NonNegativeInt = Field(
        64, description="Rows set aside by a seeded draw, never trained on; the eval's `heldout` prompt set."
    )
    chat_template: RecipePath | None = Field(
        None, description="A `.jinja` chat template that replaces the checkpoint's own (precompute, regeneration "
        "and eval prompts). Templates without `{% generation %}` markers work: assistant spans are found by "
        "rendering the conversation.",
    )
    skip_bad_rows: bool = Field(
        False, description="Skip rows that fit no format (they are counted). Otherwise such a row is an error."
    )
    regenerate: bool = Field(
        False, description="Replace the assistant turns with the target's own answers before precompute."
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Sampling used when `regenerate` is on."
    )

    @model_validator(mode="before")
    @classmethod
    def _single_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("train"), str):
            data = {**data, "train": [data["train"]]}
        return data


class PrecomputeConfig(Section):
    """Stage 1: target features on disk."""

    features_dir: RecipePath | None = Field(None, description="Where features go; null means `OUTPUT_DIR/features`.")
    layers: list[int] = Field(
        [-1],
        min_length=1,
        description="Decoder layers whose output hidden states are stored; negative counts from the end. "
        "The last layer is stored before the final norm.",
    )
    topk: NonNegativeInt = Field(32, description="Top-K teacher log-probs stored per token; 0 stores none.")
    shard_tokens: PositiveInt = Field(262144, description="Tokens per shard file.")
    batch_tokens: PositiveInt = Field(16384, description="Tokens per target forward (packed, no padding).")
    hidden_dtype: Literal["bf16", "fp8"] = Field(
        "bf16", description="How hidden states are stored: bf16, or `fp8` (e4m3 with one float32 scale per token "
        "and layer: about half the bytes). Training and the eval's validation read either back as float32.",
    )
    mode: Literal["offline", "online"] = Field(
        "offline", description="`offline`: precompute writes the features to disk and training reads them. `online`: "
        "precompute only plans the shards (and regenerates answers when asked); each training process then runs "
        "the target beside its head and scores the shards its batches need, in memory, with the same data order, "
        "masks and values as offline (rounded as `hidden_dtype` stores them). No features are written.",
    )
    online_cache_gb: NonNegativeFloat = Field(
        0.0, description="`online`: host memory per training process for shards already scored, kept for later "
        "epochs (oldest dropped first). 0 keeps only the shards of the current batches' windows, so every epoch "
        "scores its shards again.",
    )


class TrainConfig(Section):
    """Stage 2: training the head."""

    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="`adamw`; or `muon`: torch's Muon over the head's hidden 2-D matrices, AdamW over the "
        "rest (norms, biases, a draft lm_head), one lr (Muon scaled to AdamW's update RMS). Not under DeepSpeed.")
    lr: PositiveFloat = Field(1e-3, description="Peak learning rate.")
    freeze_lm_head: bool = Field(
        False, description="Keep an eagle3 head's draft lm_head at the target's rows it starts from (speculators' "
        "choice); the other kinds draft through the target's own lm_head, always frozen.")
    weight_decay: NonNegativeFloat = Field(0.0, description="Weight decay (decoupled, every part of the optimizer).")
    warmup_steps: NonNegativeInt = Field(50, description="Linear warmup steps, then `lr_schedule`'s decay.")
    lr_schedule: Literal["cosine", "linear"] = Field(
        "cosine", description="The decay after warmup: `cosine` to 10% of `lr` at the last step, or `linear` to 0 "
        "(speculators' default and transformers' `get_linear_schedule_with_warmup`).")
    epochs: PositiveFloat = Field(1.0, description="Passes over the training features.")
    batch_tokens: PositiveInt = Field(8192, description="Tokens per micro-batch per process.")
    grad_accum: PositiveInt = Field(1, description="Micro-batches per optimizer step.")
    mixed_precision: Literal["auto", "no", "bf16"] = Field(
        "auto", description="`bf16`: bf16 autocast over the head, the frozen lm_head and the loss; `no`: fp32 (with "
        "TF32 matmuls on CUDA); `auto`: bf16 on CUDA, fp32 on CPU.")
    grad_clip: PositiveFloat = Field(1.0, description="Clip the global gradient norm to this value.")
    unroll: PositiveInt = Field(1, description="Unrolled draft steps; step j feeds on the head's own step j-1 output.")
    unroll_decay: float = Field(0.8, gt=0.0, le=1.0, description="Loss weight of unrolled step j is `decay**j`.")
    w_hidden: NonNegativeFloat = Field(0.1, description="Weight of SmoothL1(draft hidden, target hidden).")
    w_logits: NonNegativeFloat = Field(1.0, description="Weight of KL(target || draft), or of the LK loss.")
    loss: Literal["kl", "lk"] = Field(
        "kl", description="`kl`: KL(target || draft); `lk`: the LK loss, lam * KL + (1 - lam) * (1 - alpha) with "
        "alpha = sum min(p, q), the acceptance probability, and lam = exp(-3 alpha) (LK losses, arXiv 2602.23881).")
    teacher: Literal["topk", "exact"] = Field(
        "topk",
        description="Target distribution: stored top-K plus log-sum-exp, or exact `lm_head(final_norm(h))`.",
    )
    loss_tokens: Literal["assistant", "all"] = Field(
        "assistant",
        description="Positions the training loss counts: the masked-in (assistant) tokens, or every token, prompts "
        "included, against the target's own distribution there. Validation always counts assistant tokens.",
    )
    mask_gate: Literal["label", "input"] = Field(
        "label",
        description="Which token's loss mask gates a prediction: `label`, the predicted token's own; `input`, the "
        "token two before it, whose hidden state the first draft step reads (SpecForge's alignment). Chain heads "
        "only: a `dflash` block's predictions are gated by their own labels.",
    )
    anchors: PositiveInt | None = Field(
        None, description="`dflash`: blocks trained per sequence, at anchors drawn uniformly from the positions whose "
        "next token counts. Null: a block at every such position.",
    )
    block_lengths: Literal["full", "uniform"] = Field(
        "uniform", description="`dflash`: `uniform` trains each block at a length drawn uniformly from 2..block_size "
        "(its later positions unseen and uncounted), as the runtime and vLLM draft a block of `1 + k` at k drafts; "
        "`full` trains every block at `head.block_size`, which drafts worse at a k below `block_size - 1` "
        "(bench/RESULTS.md, the ablations at 1M tokens). Validation takes full blocks.")
    dpace_alpha: float | None = Field(
        0.5, ge=0.0, le=1.0, description="`dflash`: D-PACE (arXiv 2605.18810) position weights in place of "
        "`unroll_decay`'s: block position j weighs sum over m >= j of prod over i <= m of ((1 - alpha) q_i + alpha), "
        "q_i the draft's probability of the target's top-1 at position i (no gradient): the derivative of the "
        "expected accepted length, smoothed by alpha (SpecForge's default 0.5). It doubles the first position's "
        "held-out top-1 of a dflash head on the tiny target (bench/RESULTS.md, the ablations at 1M tokens). Null: "
        "`unroll_decay**(j-1)`. Other heads ignore the default; setting it for a recipe without a dflash head is "
        "refused.")
    engine: Literal["ddp", "deepspeed"] = Field("ddp", description="accelerate DDP, or DeepSpeed ZeRO.")
    zero_stage: Literal[1, 2] = Field(1, description="DeepSpeed ZeRO stage when `engine: deepspeed`.")
    save_every: PositiveInt = Field(200, description="Optimizer steps between resumable checkpoints.")
    keep_checkpoints: PositiveInt = Field(2, description="Checkpoints kept; older ones are deleted.")
    val_every: PositiveInt = Field(200, description="Optimizer steps between validation passes.")
    max_steps: PositiveInt | None = Field(None, description="Stop after this many optimizer steps; null runs `epochs`.")
    tau_every: NonNegativeInt = Field(
        0, description="Steps between τ probes: on rank 0 the runtime decodes `tau_prompts` held-out prompts with the "
        "head as it stands (T = 0, the largest `eval.k`), and the log, progress line, wandb and report carry τ and α₁ "
        "against training tokens. Loads the whole target beside the head (the memory plan counts it). 0: none.")
    tau_prompts: PositiveInt = Field(8, description="Held-out prompts of each τ probe, decoded as one batch.")
    tau_tokens: PositiveInt = Field(32, description="New tokens per prompt of each τ probe.")
    wandb_mode: Literal["disabled", "offline", "online"] = Field(
        "offline", description="wandb logging; `offline` needs no network. The WANDB_MODE variable overrides it."
    )
    wandb_project: str = Field("mtp-train", description="wandb project name.")

    @model_validator(mode="after")
    def _some_loss(self) -> TrainConfig:
        if self.w_hidden == 0 and self.w_logits == 0:
            raise ValueError("w_hidden and w_logits are both 0; set at least one above 0")
        if self.optimizer == "muon" and self.engine == "deepspeed":
            raise ValueError("optimizer muon runs under engine ddp only (DeepSpeed ZeRO partitions AdamW's state); "
                             "set train.engine: ddp or train.optimizer: adamw")
        return self


class Recipe(Section):
    """A whole run: precompute, train, eval and report."""

    output_dir: RecipePath = Field(description="Everything the run writes goes under this directory.")
    seed: int = Field(0, description="Seed for data order, initialisation and sampling.")
    threads: PositiveInt | None = Field(
        None, description="CPU threads per process, in every stage (torch's intra-op threads). Null: the cores this "
        "process may use divided by the processes a launcher started on the node (`LOCAL_WORLD_SIZE`, else "
        "`WORLD_SIZE`), at least 1; a single process takes `OMP_NUM_THREADS` when it is set.",
    )
    target: TargetConfig
    data: DataConfig
    precompute: PrecomputeConfig = Field(default_factory=PrecomputeConfig)
    head: HeadConfig = Field(default_factory=HeadConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _rules_across_sections(self) -> Recipe:
        """Relations between sections that a stage would refuse (``recipe_rules``): refused when the recipe is read, so
        that ``--dry-run`` refuses them and no stage runs first."""
        check_rules(self)
        return self

    def head_kinds(self) -> list[str]:
        """The head kinds the train stage trains: ``head.kind`` first (unless the eval's draft is the target's own MTP
        layer), then the head kinds that ``eval.compare`` asks to compare against."""
        first = [self.head.kind] if self.eval.draft == "head" else []
        return first + [k for k in dict.fromkeys(self.eval.compare) if k in HEAD_KINDS and k not in first]

    def eval_head_kinds(self) -> list[str]:
        """The head kinds the eval drafts with: its own head (unless it drafts with a draft model or the target's own
        MTP layer) and the ``eval.compare`` heads (the bigram has no head); an imported one's kind from its config
        (planned as eagle3's, the largest, before it is imported)."""
        own = [self.head.kind] if self.eval.draft_model is None and self.eval.draft == "head" else []
        kinds = []
        for name in self.eval.compare:
            if name.startswith("imported/"):
                try:
                    name = json.loads((self.draft_dir(name) / "config.json").read_text(encoding="utf-8"))["kind"]
                except (OSError, ValueError, KeyError, TypeError):
                    name = "eagle3"
            if name not in ("bigram", "target_mtp"):
                kinds.append(name)
        return own + kinds

    # Every path a run writes, in one place.
    @property
    def features_dir(self) -> Path:
        return self.precompute.features_dir or self.output_dir / "features"

    def head_dir(self, kind: str | None = None) -> Path:
        """The trained head of ``kind`` (the recipe's ``head.kind`` by default)."""
        return self.output_dir / "heads" / (kind or self.head.kind)

    def draft_dir(self, name: str) -> Path:
        """An ``eval.compare`` head's directory: ``imported/NAME`` is ``mtp-train import``'s, a kind is trained."""
        return self.output_dir / name if name.startswith("imported/") else self.head_dir(name)

    @property
    def checkpoints_dir(self) -> Path:
        return self.output_dir / "checkpoints" / self.head.kind

    @property
    def train_log(self) -> Path:
        return self.output_dir / f"train_log.{self.head.kind}.jsonl"

    @property
    def eval_dir(self) -> Path:
        return self.output_dir / "eval"

    def export_dir(self, fmt: str, name: str | None = None) -> Path:
        """``mtp-train export``'s default directory for the trained head, or the head ``name`` (``imported/NAME``)."""
        return self.output_dir / "export" / f"{(name or self.head.kind).replace('/', '-')}-{fmt}"

    @property
    def slurm_dir(self) -> Path:
        return self.output_dir / "slurm"


HEAD_KINDS: tuple[str, ...] = get_args(HeadConfig.model_fields["kind"].annotation)


def _format_error(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; check its spelling against the recipe reference in docs/recipes.md"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and not isinstance(e["input"], (dict, list)):
            msg += f" (got {e['input']!r})"
        parts.append(f"{where}: {msg}" if where else msg)  # (a rule across sections names its fields itself)
    return f"{source}: " + "; ".join(parts)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and a YAML-parsed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not p for p in key.split(".")):
        raise UserError(f"override {text!r}: expected KEY.PATH=VALUE, for example train.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=value`` override set."""
    import copy

    data = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for i, k in enumerate(keys[:-1]):
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise UserError(f"override {text!r}: {'.'.join(keys[: i + 1])} is not a section")
            node = child
        node[keys[-1]] = value
    return data


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a recipe file as a mapping; every failure is a one-line UserError."""
    if not path.is_file():
        raise UserError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{path}: invalid YAML{where}: {e.problem}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        raise UserError(f"{path}: recipe is empty")
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return data


def load_recipe(path: Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file."""
    path = Path(path)
    data = apply_overrides(read_yaml(path), overrides or [])
    try:
        return Recipe.model_validate(data, context={"base_dir": path.resolve().parent})
    except ValidationError as e:
        raise UserError(_format_error(str(path), e)) from None


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe, every default filled in, as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
