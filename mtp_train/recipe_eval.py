"""The recipe's ``eval`` section: speculative decoding sweeps (chains and trees) and the report."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveInt, field_validator, model_validator

from mtp_train.recipe_types import PROMPT_SETS, RecipePath, Section


class TreeConfig(Section):
    """One draft tree of the sweep (EAGLE-2's dynamic tree, as SGLang serves it)."""

    topk: PositiveInt = Field(description="Children of each expanded node (SGLang's `--speculative-eagle-topk`).")
    depth: PositiveInt = Field(description="Levels of drafts (SGLang's `--speculative-num-steps`).")
    draft_tokens: PositiveInt = Field(
        description="Tokens verified per step, the root included (SGLang's `--speculative-num-draft-tokens`): the "
        "best of the drafted nodes by cumulative draft probability, at least 2 and at most "
        "1 + topk + (depth - 1) * topk².")

    @model_validator(mode="after")
    def _fits(self) -> TreeConfig:
        most = 1 + self.topk + (self.depth - 1) * self.topk**2
        if not 2 <= self.draft_tokens <= most:
            raise ValueError(f"draft_tokens must be 2..{most} for topk {self.topk} and depth {self.depth}")
        return self


COMPARE_DRAFTS = ("mtp", "eagle", "eagle3", "dflash", "bigram", "target_mtp")
IMPORTED_NAME = re.compile(r"imported/[A-Za-z0-9][A-Za-z0-9._-]*")


class EvalConfig(Section):
    """Stage 3: speculative decoding and the report."""

    k: list[PositiveInt] = Field([1, 2, 3, 4], min_length=1, description="Draft lengths to sweep (chains).")
    trees: list[TreeConfig] = Field(
        [], description="Draft trees to sweep beside the chains, e.g. `[{topk: 4, depth: 4, draft_tokens: 8}]`; the "
        "report's tree table compares each with the chain of k = its depth.")
    temperatures: list[NonNegativeFloat] = Field([0.0, 1.0], min_length=1, description="Temperatures to sweep.")
    prompt_sets: list[Literal[PROMPT_SETS]] = Field(  # type: ignore[valid-type]
        ["heldout"], min_length=1, description="Prompt sets: " + ", ".join(f"`{s}`" for s in PROMPT_SETS) + "."
    )
    max_prompts: PositiveInt = Field(64, description="Prompts used per prompt set.")
    max_new_tokens: PositiveInt = Field(128, description="Tokens generated per prompt.")
    batch_size: PositiveInt = Field(8, description="Requests decoded concurrently (plain and speculative alike).")
    draft: Literal["head", "target_mtp"] = Field(
        "head", description="The draft to evaluate: `head`, the trained head; `target_mtp`, the target checkpoint's "
        "own MTP layer (DeepSeek-V3/R1 layout, `num_nextn_predict_layers` >= 1), with no training (the `train` stage "
        "then trains only the heads `eval.compare` names).",
    )
    draft_model: RecipePath | None = Field(
        None, description="Evaluate draft-target decoding with this HF checkpoint as the draft, instead of the head."
    )
    draft_vocab: PositiveInt | None = Field(
        None, description="Heads draft from the N most frequent assistant tokens of the training features only: "
        "their lm_head is those N rows of the frozen one, so a draft step reads N rows instead of the vocabulary's "
        "(verification, and so the output, is unchanged). Null: the full vocabulary.",
    )
    compare: list[str] = Field(
        [], description="Other drafts decoded on the same prompts for comparison: head kinds (trained by the "
        "`train` stage beside `head.kind`), `bigram`, each token's most frequent successor in the features, "
        "`target_mtp`, the target checkpoint's own MTP layer, and `imported/NAME`, a head another trainer wrote, "
        "read by `mtp-train import` into `OUTPUT_DIR/imported/NAME`.",
    )
    @field_validator("compare")
    @classmethod
    def _drafts(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in COMPARE_DRAFTS and not IMPORTED_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a draft: choose {', '.join(COMPARE_DRAFTS)} or imported/NAME "
                                 "(a head `mtp-train import` wrote)")
        return names

    val_tolerance: NonNegativeFloat = Field(
        0.02, description="Largest relative gap between the runtime's and the trainer's validation loss (and "
        "absolute gap in top-1) before the report flags an implementation mismatch.",
    )
    baseline: RecipePath | None = Field(None, description="A previous `report.json` to compare against.")
