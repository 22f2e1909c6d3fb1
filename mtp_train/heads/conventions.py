"""Serving conventions: the three choices that decide whether a served head sees what it was trained on.

- ``hidden_input``: which target hidden state the head reads, ``pre_norm`` (before the target's final norm) or
  ``post_norm`` (after it);
- ``feedback``: which state a chained draft step feeds back as the next step's hidden input, the head's raw
  decoder ``output`` or its output after the head's final norm (``head_norm``, DeepSeek's ``shared_head.norm``);
- ``zero_embed_at_position0``: whether the token embedding is zeroed at position 0.

``head.convention`` picks them, per head kind, as the engines do (``../shared/EXPORT.md`` sections 1.1 and 2):

| kind | convention | hidden_input | feedback | zero at 0 | served by |
|---|---|---|---|---|---|
| mtp | native | pre_norm | output | yes | this runtime |
| mtp | vllm | post_norm | head_norm | yes | vLLM's DeepSeek MTP (DeepSeek-V3-family targets), this runtime |
| mtp | sglang | post_norm | head_norm | no | SGLang's DeepSeek NextN (DeepSeek-V3-family targets), this runtime |
| eagle | any | post_norm | output | no | vLLM and SGLang EAGLE (Llama targets), this runtime |
| eagle3 | any | pre_norm (three layers) | output (`head.norm_output`: head_norm) | no | vLLM and SGLang EAGLE-3 (Llama targets), this runtime |
| dflash | any | pre_norm (aux layers, context) | (no chain) | no | vLLM DFlash (Llama, Qwen3 targets), this runtime |

The trainer, the runtime's drafting and the eval read the choices from the head's ``config.json``, never from
the convention's name, so a head is always run as it was trained. An eagle3 head's feedback is EAGLE 3.1's
``norm_output`` (``head_norm`` where it is on), which the engines read off its config: they serve either.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

CONVENTIONS = ("native", "vllm", "sglang")


@dataclass(frozen=True)
class Choices:
    """What a head reads, feeds back and zeroes (see the module's table)."""

    hidden_input: str  # "pre_norm" | "post_norm"
    feedback: str  # "output" | "head_norm"
    zero_embed_at_position0: bool

    @property
    def fed(self) -> str:
        """What a chained step feeds back, in words."""
        return "its decoder output" if self.feedback == "output" else "its output after its final norm"

    def describe(self) -> str:
        side = "before" if self.hidden_input == "pre_norm" else "after"
        zero = "zeroed" if self.zero_embed_at_position0 else "kept"
        return (f"reads the target's hidden state {side} its final norm, feeds back {self.fed}, embedding at position 0 "
                f"{zero}")


_TABLE: dict[tuple[str, str], Choices] = {
    ("mtp", "native"): Choices("pre_norm", "output", True),
    ("mtp", "vllm"): Choices("post_norm", "head_norm", True),
    ("mtp", "sglang"): Choices("post_norm", "head_norm", False),
    **{("eagle", c): Choices("post_norm", "output", False) for c in CONVENTIONS},
    # eagle3 reads three layers' pre-norm residual states (not the last layer's hidden) and feeds back its output
    **{("eagle3", c): Choices("pre_norm", "output", False) for c in CONVENTIONS},
    # dflash reads aux layers' pre-norm states as context; it feeds nothing back (one block forward, no chain)
    **{("dflash", c): Choices("pre_norm", "output", False) for c in CONVENTIONS},
}

ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "speculators": "speculators (vLLM)"}


def choices(kind: str, convention: str) -> Choices:
    """The choices of ``convention`` for a head of ``kind``."""
    return _TABLE[kind, convention]


# The target families whose heads of each kind an engine's loader builds as trained. Llama only for eagle: the family
# whose export has been served and checked in vLLM (Mistral's sliding window and Qwen's biases and norms are not what
# vLLM's EagleLlamaForCausalLM builds); DeepSeek-V3 only for mtp: vLLM and SGLang turn only DeepSeek-V3-family
# configs into their MTP model (EXPORT.md 1.1), which reads the DeepSeek layout.
LOADER_FAMILIES = {"eagle": ("llama",), "eagle3": ("llama",), "mtp": ("deepseek_v3",), "dflash": ("llama", "qwen3")}
# Target families whose model class in vLLM 0.32 captures no hidden states for a draft (it implements neither
# SupportsEagle nor SupportsEagle3, which its EAGLE, EAGLE-3 and DFlash proposers need), whatever the head's layer.
NO_DRAFT_HOOKS = {"gemma3_text": "vLLM 0.32's Gemma3ForCausalLM implements neither SupportsEagle nor SupportsEagle3, "
                                 "so vLLM runs no EAGLE, EAGLE-3 or DFlash draft on a Gemma 3 target"}


def served_by(kind: str, head: Choices, target_family: str) -> list[str]:
    """The engines that serve this head as it was trained: ``vllm``/``sglang`` where the engine's convention for the
    kind equals the head's choices and the engine has a loader for the kind on this target family."""
    if target_family not in LOADER_FAMILIES[kind]:
        return []
    engines = ("vllm",) if kind == "dflash" else ("vllm", "sglang")  # (SGLang's DFlash is not exported for here)
    return [engine for engine in engines if _engine_choices(kind, engine, head) == head]


def _engine_choices(kind: str, engine: str, head: Choices) -> Choices:
    """What ``engine`` runs a head of ``kind`` with: its convention's choices, whose feedback for eagle3 is the head's
    own (the engines read EAGLE 3.1's ``norm_output`` off its config)."""
    want = choices(kind, engine)
    return replace(want, feedback=head.feedback) if kind == "eagle3" else want


def validity_line(kind: str, head: Choices, target_family: str) -> str:
    """One sentence for the report: where this head can be served unchanged."""
    engines = [ENGINE_NAMES[e] for e in served_by(kind, head, target_family)]
    if engines:
        return f"Valid in {' and '.join(engines)} (`mtp-train export --format ...`) and in this runtime."
    if target_family in LOADER_FAMILIES[kind]:
        return "Valid in this runtime only: its conventions differ from every engine's (train it with head.convention)."
    if target_family in NO_DRAFT_HOOKS and kind != "mtp":
        return f"Valid in this runtime only: {NO_DRAFT_HOOKS[target_family]}."
    if kind == "mtp":
        return (f"Valid in this runtime only: no serving engine loads an MTP layer for a {target_family} target "
                "(vLLM and SGLang serve DeepSeek-layout MTP layers for DeepSeek-V3-family targets).")
    return (f"Valid in this runtime only: vLLM's and SGLang's EAGLE loaders build a Llama decoder layer, not a "
            f"{target_family} target's.")
