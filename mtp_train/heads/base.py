"""Draft heads: a small interface, a registry, and the config every head checkpoint carries.

A head reads, at position i of a document, the target's hidden state h_i and the embedding of
token t_{i+1}, and predicts t_{i+2}. It outputs a hidden state (which the next unrolled step
consumes as its own h) and the input of the frozen lm_head.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from mtp_train.errors import UserError
from mtp_train.heads.attention import DocumentCausalAttention
from mtp_train.heads.conventions import Choices, choices
from mtp_train.models.config import ModelConfig
from mtp_train.models.rope import RotaryEmbedding
from mtp_train.models.tp import TensorParallel
from mtp_train.models.transformer import DecoderLayer

HEADS: dict[str, type[DraftHead]] = {}
AUX_KINDS = ("eagle3", "dflash")  # kinds that read the target's states at ``aux_layers`` (precompute stores them)


@dataclass(frozen=True)
class HeadSpec:
    """Everything needed to rebuild a head, saved as its ``config.json``.

    ``target`` holds the target's shapes, RoPE settings and maximum positions, which the head's
    decoder layer inherits. ``hidden_input`` says which side of the target's final norm the head
    consumes (and predicts); ``feedback`` which state a chained step feeds back (``output``, or
    ``head_norm``: after the head's final norm); ``zero_embed_at_position0`` zeroes the token embedding
    at a document's first position, as vLLM's DeepSeek MTP forward does. ``convention`` names the
    serving convention these three came from (:mod:`mtp_train.heads.conventions`); heads saved before
    it existed load as ``native`` with ``output`` feedback, which is what they were trained with.
    """

    kind: str
    num_layers: int
    target: ModelConfig
    target_fingerprint: str
    hidden_input: str
    zero_embed_at_position0: bool
    feedback: str = "output"
    convention: str = "native"
    moe: bool = False  # the decoder layer has the target's experts (DeepSeek: the layer type at index L, as its MTP)
    aux_layers: tuple[int, ...] = ()  # eagle3, dflash: the target layers whose inputs it reads (EXPORT.md 3.4)
    draft_vocab: int = 0  # eagle3: rows of its own lm_head (0: the head uses the frozen lm_head)
    block_size: int = 0  # dflash: positions of a trained block, its first token and block_size - 1 masks
    mask_token_id: int = -1  # dflash, P-EAGLE: the id an engine writes in the mask positions
    fc_norm: bool = False  # eagle3 (EAGLE 3.1): an RMSNorm per aux layer's state before fc
    parallel_drafts: int = 0  # eagle3 (P-EAGLE): tokens drafted in one forward, the last row and masks (0: a chain)
    window: int = 0  # head.window: a query at position p sees keys at positions above p - window only (0: all)
    norm_before_fc: bool = False  # eagle3 (vLLM, speculators): one RMSNorm over the aux concatenation before fc
    norm_before_residual: bool = False  # eagle3 (vLLM, speculators): the residual is the hidden input after hidden_norm

    @property
    def norm_output(self) -> bool:
        """EAGLE 3.1's ``norm_output``: an eagle3 head whose chained step reads the output after its final norm
        (``feedback: head_norm``)."""
        return self.kind == "eagle3" and self.feedback == "head_norm"

    @property
    def choices(self) -> Choices:
        return Choices(self.hidden_input, self.feedback, self.zero_embed_at_position0)

    def describe(self) -> str:
        """What the head reads, feeds back and drafts from, in words (reports and model cards)."""
        window = f"; attends to the last {self.window:,} positions only" if self.window else ""
        return self._reads() + window

    def _reads(self) -> str:
        if self.kind == "dflash":
            return (f"reads fc of the target's states entering layers {list(self.aux_layers)} as context, drafts up "
                    f"to {self.block_size - 1} tokens in one non-causal forward over a block")
        if self.kind != "eagle3":
            return self.choices.describe()
        drafting = (f"drafts up to {self.parallel_drafts} tokens in one forward (P-EAGLE)" if self.parallel_drafts
                    else f"feeds back {self.choices.fed}")
        normed = "per-layer normed " if self.fc_norm else "normed " if self.norm_before_fc else ""
        return (f"reads fc of the target's {normed}states entering layers "
                f"{list(self.aux_layers)}, {drafting}, drafts from {self.draft_vocab:,} of the "
                f"{self.target.vocab_size:,} ids")

    def to_json(self) -> dict:
        return {"architectures": [HEADS[self.kind].__name__], "head_kind": self.kind, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict, source: str) -> HeadSpec:
        try:
            spec = cls(data["kind"], int(data["num_layers"]), ModelConfig.from_json(data["target"]), data["target_fingerprint"],
                       data["hidden_input"], bool(data["zero_embed_at_position0"]), data.get("feedback", "output"),
                       data.get("convention", "native"), bool(data.get("moe", False)),
                       tuple(int(i) for i in data.get("aux_layers", ())), int(data.get("draft_vocab", 0)),
                       int(data.get("block_size", 0)), int(data.get("mask_token_id", -1)),
                       bool(data.get("fc_norm", False)), int(data.get("parallel_drafts", 0)),
                       int(data.get("window", 0)), bool(data.get("norm_before_fc", False)),
                       bool(data.get("norm_before_residual", False)))
        except KeyError as e:
            raise UserError(f"{source}: not a head config (no {e.args[0]!r} field)") from None
        except (TypeError, ValueError) as e:
            raise UserError(f"{source}: not a head config ({str(e)[:160]})") from None
        if spec.hidden_input not in ("pre_norm", "post_norm") or spec.feedback not in ("output", "head_norm"):
            raise UserError(f"{source}: hidden_input {spec.hidden_input!r} / feedback {spec.feedback!r} are not "
                            "conventions this toolkit knows; train the head again")
        return spec


class DraftHead(nn.Module):
    """Base of every head: decoder layer(s) of the target's family over packed documents."""

    kind: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        HEADS[cls.kind] = cls

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        self.spec = spec
        cfg = self.layer_config()
        self.layers = nn.ModuleList(DecoderLayer(cfg, TensorParallel(), spec.moe) for _ in range(spec.num_layers))
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope)

    def layer_config(self) -> ModelConfig:
        """The config the head's decoder layers are built from: the target's (a Llama layer for a Gemma 3 target:
        ``ModelConfig.plain_layer``), unless a kind's layer differs."""
        return self.spec.target.plain_layer()

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` embeddings of t_{i+1} and hidden inputs h_i -> the decoder's input ``[T, H]``."""
        raise NotImplementedError

    def lm_head_input(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output hidden ``[T, H]`` -> what the frozen lm_head is applied to."""
        raise NotImplementedError

    def feedback_state(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output hidden ``[T, H]`` -> the hidden input of the next chained step (``spec.feedback``),
        which training matches to the target's hidden on the side the head reads."""
        return self.lm_head_input(out) if self.spec.feedback == "head_norm" else out

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cu_seqlens: list[int]
    ) -> torch.Tensor:
        """One draft step over packed documents (training): ``[T, H]`` inputs -> output hidden ``[T, H]``."""
        return self.run(embeds, hidden, positions, DocumentCausalAttention(cu_seqlens, self.spec.window),
                        [(None, None)] * len(self.layers))

    def run(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, plan, kv: list) -> torch.Tensor:
        """The forward shared by the trainer and the runtime: ``plan`` is the attention (document-causal in
        training, a paged KV step in the runtime) and ``kv`` the per-layer caches. ``[T, H]`` -> ``[T, H]``."""
        if self.spec.zero_embed_at_position0:
            embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = self.fuse(embeds, hidden)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        for layer, cache in zip(self.layers, kv, strict=True):
            x = layer(x, cos_sin, plan, cache)
        return x


def head_spec(kind: str, num_layers: int, target: ModelConfig, fingerprint: str,
              convention: str = "native", aux_layers: tuple[int, ...] = (), draft_vocab: int = 0,
              block_size: int = 0, mask_token_id: int = -1, fc_norm: bool = False,
              norm_output: bool = False, parallel_drafts: int = 0, window: int = 0, norm_before_fc: bool = False,
              norm_before_residual: bool = False) -> HeadSpec:
    """``aux_layers``: an eagle3 or dflash head's; ``draft_vocab``, ``fc_norm``, ``norm_output``,
    ``parallel_drafts``, ``norm_before_fc`` and ``norm_before_residual`` an eagle3 head's (``norm_output``: its feedback is ``head_norm``); ``block_size`` a dflash
    head's, ``mask_token_id`` a dflash or P-EAGLE head's (each ignored by the other kinds); ``window`` any head's
    (``head.window``, 0: full attention)."""
    if kind not in HEADS:
        raise UserError(f"head.kind: {kind!r} is not a head; choose one of {sorted(HEADS)}")
    c = choices(kind, convention)
    eagle3, dflash, aux = kind == "eagle3", kind == "dflash", kind in AUX_KINDS
    # A DeepSeek head's layer is of the type the target would have at index L (its own MTP layer's): with experts
    # past the dense first layers, so that the DeepSeek layout's loaders build it as trained.
    feedback = "head_norm" if eagle3 and norm_output else c.feedback
    return HeadSpec(kind, num_layers, target, fingerprint, c.hidden_input, c.zero_embed_at_position0, feedback,
                    convention, target.is_moe_layer(target.num_layers) and not aux,
                    tuple(aux_layers) if aux else (), draft_vocab if eagle3 else 0,
                    block_size if dflash else 0, mask_token_id if dflash or (eagle3 and parallel_drafts) else -1,
                    fc_norm and eagle3, parallel_drafts if eagle3 else 0, window, norm_before_fc and eagle3,
                    norm_before_residual and eagle3)


def build_head(spec: HeadSpec) -> DraftHead:
    return HEADS[spec.kind](spec)


def load_head_config(root: Path) -> HeadSpec:
    path = root / "config.json"
    if not path.is_file():
        raise UserError(f"{path} not found; a head checkpoint needs config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON ({e.msg}); train the head again with `mtp-train train`") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; train the head again with `mtp-train train`") from None
    return HeadSpec.from_json(data, str(path))
