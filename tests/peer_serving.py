"""The slow peer tests' check that vLLM serves a head a peer wrote as this runtime runs `mtp-train import`'s head
of it: a tiny target the peers can train for, the rows they train on, and the comparison (bench/vllm_check.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

DRAFT_VOCAB = 512


def peer_target_rows(tmp: Path) -> tuple[Path, Path, int]:
    """The shipped tiny target's tokenizer and template on 8 random layers (the peers' default aux layers of its 4
    layers repeat one, which no engine's eagle3 head takes), a recipe for it whose eval is 4 MT-bench prompts at
    k = 1 and 3, and what a peer trains on, the target's own greedy answers to those prompts (so that the head
    accepts): ``tokens.jsonl`` and a draft vocabulary holding every answer id, ``vocab.safetensors``. Returns the
    target, the recipe and the rows' longest length."""
    from conftest import TINY_TARGET
    from precompute_helpers import make_recipe
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtp_train.eval.run import eval_prompts
    from mtp_train.recipe import load_recipe
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.sampling import SamplingParams

    torch.manual_seed(0)
    target = tmp / "target"
    LlamaForCausalLM(LlamaConfig.from_pretrained(TINY_TARGET, num_hidden_layers=8)).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TINY_TARGET / name, target / name)
    (tmp / "rows.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    recipe = make_recipe(tmp, tmp / "rows.jsonl", target={"path": str(target)}, eval={
        "prompt_sets": ["mt_bench"], "max_prompts": 4, "max_new_tokens": 32, "k": [1, 3], "temperatures": [0.0]})
    engine = Engine.from_pretrained(target, num_pages=256)
    _, prompts, _, _ = eval_prompts(load_recipe(recipe), engine)
    answers = [r.tokens for r in engine.generate(prompts, SamplingParams(max_new_tokens=32))]
    rows = [{"input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a)} for p, a in zip(prompts, answers)]
    (tmp / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    used = sorted({t for a in answers for t in a} | set(range(DRAFT_VOCAB)))[:DRAFT_VOCAB]
    t2d = torch.zeros(engine.cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    save_file({"d2t": torch.tensor(used) - torch.arange(DRAFT_VOCAB), "t2d": t2d}, tmp / "vocab.safetensors")
    return target, recipe, max(len(r["input_ids"]) for r in rows)


def assert_vllm_counts_equal_the_import(recipe: Path, src: Path, work: Path) -> None:
    """`mtp-train import` of ``src``, then ``bench/vllm_check.py --head imported/peer``: vLLM serves ``src`` as the
    peer wrote it, this runtime the imported head; the accepted counts per draft position are equal at k = 1 and 3,
    and not all zero."""
    from conftest import run_cli, vllm_check

    proc = run_cli("import", recipe, src, "--name", "peer")
    assert proc.returncode == 0, proc.stderr
    proc = vllm_check(recipe, work, "--head", "imported/peer", "--k", "1", "3")
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line.split("|") for line in proc.stdout.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(table) == 2
    for cells in table:  # (c) vLLM's accepted per position (of drafts) and this runtime's, cell for cell
        assert cells[6].strip() == cells[7].strip(), cells
    assert int(table[0][6].split("(")[0]) > 0  # the head accepts, so the counts compare something
