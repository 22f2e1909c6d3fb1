"""Draft heads; importing this package registers every kind."""

from mtp_train.heads import dflash, eagle, eagle3, mtp  # noqa: F401  (registration)
from mtp_train.heads.base import AUX_KINDS, HEADS, DraftHead, HeadSpec, build_head, head_spec, load_head_config

__all__ = ["AUX_KINDS", "HEADS", "DraftHead", "HeadSpec", "build_head", "head_spec", "load_head_config"]
