"""The recipe's ``head`` section: the draft head to train, its kind and the options each kind takes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt

from mtp_train.recipe_types import RecipePath, Section


class HeadConfig(Section):
    """The draft head to train."""

    kind: Literal["mtp", "eagle", "eagle3", "dflash"] = Field(
        "mtp", description="`mtp`: DeepSeek-V3 layout with the RMSNorms restored. `eagle`: the EAGLE-1 baseline. "
        "`eagle3`: EAGLE-3, over three target layers, with a draft vocabulary of its own, trained with training-time "
        "test (`train.unroll` steps). `dflash`: a DFlash block drafter over the same layers, drafting k tokens in one "
        "forward (`head.block_size`).",
    )
    num_layers: PositiveInt = Field(1, description="Decoder layers in the head (an `eagle3` head has 1).")
    block_size: int = Field(
        9, ge=2, description="`dflash`: positions of a training block, its first token and `block_size - 1` masks; it "
        "drafts up to `block_size - 1` tokens (the runtime and vLLM run a block of `1 + k` at k drafts): a longer "
        "`eval.k` or `eval.trees` depth is refused.",
    )
    mask_token_id: NonNegativeInt | None = Field(
        None, description="`dflash`: the token id an engine writes in the mask positions (the head trains a mask "
        "vector of its own, exported as `mask_embedding.pt`, started from this id's embedding). `eagle3` with "
        "`parallel_drafts` (P-EAGLE): the id whose frozen embedding its mask positions read (vLLM's `pard_token`). "
        "Null: the last id.",
    )
    parallel_drafts: int | None = Field(
        None, ge=2, description="`eagle3`: P-EAGLE, drafting up to this many tokens in one forward (vLLM's "
        "`parallel_drafting`): the last verified position's row, then `parallel_drafts - 1` mask positions "
        "(`mask_token_id`'s embedding and a trained `mask_hidden` in place of the target's states), each attending "
        "causally to the context and the masks before it. Trained with `train.unroll: 1` (no chain is served) plus "
        "the mask positions' loss, weighted `train.unroll_decay**j`; `eval.k` and tree depths past it are refused. "
        "Null: a chain drafter.",
    )
    aux_layers: list[int] | None = Field(
        None, description="`eagle3`, `dflash`: the three target layers it reads, as vLLM and SGLang number them (id k: "
        "the input "
        "of decoder block k, i.e. the output of layer k - 1; L: the last layer's output). Null: the engines' default "
        "`[2, L//2, L-3]`. Precompute stores these layers.",
    )
    draft_vocab: PositiveInt | None = Field(
        32000, description="`eagle3`: rows of its own lm_head, the N most frequent assistant tokens of the training "
        "features (mapped to target ids by `d2t`). Null, or at least the target's vocabulary: the full vocabulary.",
    )
    fc_norm: bool = Field(
        False, description="`eagle3`: EAGLE 3.1's per-layer input norm: an RMSNorm of its own on each aux layer's state "
        "before `fc` (`fc(concat(norm_a(h_a), norm_b(h_b), norm_c(h_c)))`), exported as `fc_norm.{0,1,2}.weight` with "
        "`fc_norm: true`, as speculators, vLLM and SGLang read it.",
    )
    norm_output: bool = Field(
        False, description="`eagle3`: EAGLE 3.1's post-norm feedback: a chained step (training-time test and drafting) "
        "reads the previous step's output after the head's final `norm` instead of before it; the logits are "
        "unchanged. Exported as `norm_output: true`; adds no weights.",
    )
    norm_before_fc: bool = Field(
        False, description="`eagle3`: one RMSNorm over the concatenated aux states before `fc` (before any `fc_norm`), "
        "exported as `input_norm` with `norm_before_fc: true`, as speculators (its default) and vLLM read it.",
    )
    norm_before_residual: bool = Field(
        False, description="`eagle3`: the decoder layer's residual is the hidden input after `hidden_norm` instead of "
        "before it (speculators' default, vLLM's `norm_before_residual`); adds no weights. SGLang 0.5.23 has no such "
        "setting, so its export is refused.",
    )
    window: int | None = Field(
        None, ge=2, description="Tokens of context the head's attention sees (a sliding window, as "
        "vLLM's `sliding_window`): a query at position p attends to keys at positions above p - window only, in "
        "training (training-time test and dflash blocks included), in the runtime's drafting (chains, trees and "
        "blocks; its KV pages below the window are given back) and in the export, so that a draft's cost stays flat "
        "as prompts grow. It must exceed the drafts (`eval.k`, tree depths, `train.unroll`, a dflash block). Null: "
        "full attention.",
    )
    init_from: RecipePath | None = Field(
        None, description="Fine-tune a head instead of starting one: a head directory this toolkit wrote (a trained "
        "run's `heads/KIND`, or `mtp-train import`'s `imported/NAME`, e.g. a SpecForge or speculators head). Its "
        "weights, draft vocabulary, aux layers and options are the start; each `head` field the recipe sets must be "
        "the head's, the others are taken from it, and an eagle3 or dflash head's aux layers must be those the "
        "recipe's features hold (`head.aux_layers`).",
    )
    init: Literal["random", "target_last_layer"] = Field(
        "random", description="Initialise the head's decoder layer randomly or from the target's last layer. "
        "Applies to `mtp` heads only: an `eagle` head always starts random, because its output feeds the lm_head "
        "with no final norm, and a copied last layer writes pre-norm-scale values into it (it diverges).",
    )
    convention: Literal["native", "vllm", "sglang"] = Field(
        "native", description="Serving convention the head is trained in, followed by the trainer, the runtime's "
        "drafting and the eval, and written into its `config.json`: which target hidden state it reads (before or "
        "after the final norm), which state a chained step feeds back, and whether the embedding is zeroed at "
        "position 0. `native`: `mtp` reads the pre-norm state and feeds back its raw output, zeroing position 0. "
        "`vllm`/`sglang`: as vLLM's/SGLang's DeepSeek MTP (post-norm state, `shared_head.norm` output fed back; "
        "only vLLM zeroes position 0). `eagle` heads are the same under all three (post-norm state, raw output).",
    )

    def mask_id(self, vocab_size: int) -> int:
        """``mask_token_id``, or the last id of a ``vocab_size``-id vocabulary when it is null."""
        return vocab_size - 1 if self.mask_token_id is None else self.mask_token_id
