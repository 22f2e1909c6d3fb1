"""An ``eagle3`` head in the layouts vLLM, SGLang and speculators load (``../shared/EXPORT.md`` sections 3 and 4).

Weights: the decoder layer under ``midlayer.`` (speculators: ``layers.0.``) in HF names, with ``hidden_norm`` beside
its ``input_layernorm`` (applied to the embedding); ``fc [H, 3H]``, ``norm``, ``lm_head [N, H]``; and, when the
draft vocabulary is smaller than the target's, ``d2t [N]`` int64 offsets (target id = draft id + d2t[draft id]) and
``t2d [V]`` bool (the target ids it holds). No embedding: every engine shares the target's.

EAGLE 3.1's options keep the names the head trains them under, which are the engines' (speculators' ``Eagle3``
model, vLLM 0.32's ``llama_eagle3.py``, SGLang 0.5.23's): ``fc_norm.{0,1,2}.weight [H]`` with ``fc_norm: true``,
and ``norm_output: true`` (no weights). Both keys sit at the config's top level in every format. A P-EAGLE head's
``mask_hidden [3H]`` keeps vLLM's and speculators' name too.
"""

from __future__ import annotations

import torch

SPECULATORS_VERSION = "0.3.0"


def to_eagle3(tensors: dict[str, torch.Tensor], vocab_size: int, layer: str = "midlayer.") -> dict[str, torch.Tensor]:
    """``head_to_hf`` of an eagle3 head -> the engines' names (``layer``: the decoder layer's prefix)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith("layers.0."):
            out[layer + name.removeprefix("layers.0.")] = tensor
        elif name == "hidden_norm.weight":
            out[layer + name] = tensor
        elif name == "draft_ids":
            if tensor.numel() < vocab_size:
                ids = tensor.long()
                out["d2t"] = ids - torch.arange(ids.numel())
                out["t2d"] = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        else:  # fc.weight, norm.weight, lm_head.weight; fc_norm.{i}.weight (EAGLE 3.1)
            out[name] = tensor
    return out


def eagle3_config(target_config: dict, verifier: str, aux_layers: list[int], default_aux: list[int],
                  draft_vocab: int, fmt: str, fc_norm: bool = False, norm_output: bool = False,
                  parallel_drafts: int = 0, mask_token_id: int = -1, norm_before_fc: bool = False,
                  norm_before_residual: bool = False) -> dict:
    """``config.json`` for ``fmt`` (``vllm``, ``sglang`` or ``speculators``) from the target's (DROPPED_KEYS removed);
    ``verifier``: the target as speculators names it (its path or hub id); ``fc_norm``, ``norm_output``: the head's
    EAGLE 3.1 options, ``norm_before_fc``, ``norm_before_residual`` vLLM's and speculators' two more, written as those
    keys (vLLM and SGLang read them off the config with false as default).
    ``parallel_drafts`` (P-EAGLE): speculators' ``peagle`` type with its ``mask_token_id``, which vLLM serves as
    eagle3 with ``parallel_drafting`` (its ``mask_hidden`` tensor beside the weights); vLLM's own format writes
    ``mask_token_id`` (read as the parallel-drafting token) and ``parallel_drafting: true`` (a note for whoever
    serves it: vLLM takes it from the speculative config, not from here).

    Aux ids are written only when they are not the engines' default, in the numbering each engine reads: vLLM and
    speculators take them as given (the input of block k), SGLang's Llama adds 1 (EXPORT.md 3.4). vLLM's format has
    them at the top level too, which vLLM prefers and SGLang does not read: an importer can tell the two apart.
    """
    layer = {**target_config, "num_hidden_layers": 1, "tie_word_embeddings": False, "torch_dtype": "float32"}
    layer.pop("dtype", None)
    layer.pop("architectures", None)
    custom = list(aux_layers) != list(default_aux)
    if fmt == "speculators":
        verifier_entry = {"name_or_path": verifier, "architectures": target_config.get("architectures", [])}
        peagle = {"mask_token_id": mask_token_id} if parallel_drafts else {}
        return {"speculators_model_type": "peagle" if parallel_drafts else "eagle3",
                "architectures": ["PEagleSpeculator" if parallel_drafts else "Eagle3Speculator"], **peagle,
                "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
                "draft_vocab_size": draft_vocab, "target_hidden_size": None,
                "norm_before_residual": norm_before_residual, "norm_before_fc": norm_before_fc, "fc_norm": fc_norm,
                "norm_output": norm_output,
                "eagle_aux_hidden_state_layer_ids": list(aux_layers),
                "speculators_config": {"algorithm": "peagle" if parallel_drafts else "eagle3",
                                       "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy",
                                                             "speculative_tokens": parallel_drafts or 3}],
                                       "verifier": verifier_entry}}
    eagle = {"use_aux_hidden_state": True}
    top = {}
    if custom:
        eagle["eagle_aux_hidden_state_layer_ids"] = [k - 1 for k in aux_layers] if fmt == "sglang" else list(aux_layers)
        if fmt == "vllm":  # also at the top level, which vLLM prefers and which only vLLM reads: the file says whose
            top["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    parallel = {"mask_token_id": mask_token_id, "parallel_drafting": True} if parallel_drafts else {}
    return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "draft_vocab_size": draft_vocab,
            "norm_before_residual": norm_before_residual, "norm_before_fc": norm_before_fc, "fc_norm": fc_norm,
            "norm_output": norm_output, "eagle_config": eagle, **top,
            **parallel}
