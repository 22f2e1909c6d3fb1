"""The GPU check's probe at real width: Llama-3.3-70B's shapes (recipes/llama3.3-70b.yaml and its config), measured
against what ``mtp_train.memory`` plans for them.

- **A scoring batch**: two decoder layers at the TP-8 slice of one rank (hidden 8,192, 8 query heads and 1 KV head
  of 128, MLP 3,584 channels, vocabulary 128,256), random bf16 weights, scoring ``precompute.batch_tokens`` tokens
  (documents of ``data.max_length``) with the recipe's top-K: ``max_memory_allocated`` above the weights and KV
  against the plan's activation term (per layer and depth-independent: a scoring forward frees each layer's
  transients before the next).
- **A training step** of each head kind (the recipe's ``mtp``, then ``eagle3`` and ``dflash``) at full width over
  ``train.batch_tokens`` tokens, bf16 autocast, AdamW on one process: the peak against the plan's train stage with
  the optimizer unpartitioned (``train.engine=ddp``).
- **A decode step of 256 rows** at T = 0.6, top_p 0.9, a distinct seed per row, through the sliced engine; and the
  sampling alone over a ``[256, 128256]`` batch of logits, batched against row by row.

``--cpu-smoke`` runs the same code at toy sizes (no memory readings on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "llama3.3-70b.yaml"
CONFIG = ROOT / "recipes" / "configs" / "llama-3.3-70b.json"
GIB = 2**30
SMOKE = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 1, "head_dim": 32, "intermediate_size": 256,
         "vocab_size": 2048}
SMOKE_RECIPE = ["target.tp=1", "precompute.batch_tokens=1024", "data.max_length=256", "train.batch_tokens=512", "precompute.topk=8",
                "head.draft_vocab=512"]


def _setup(smoke: bool):
    from mtp_train.models.config import ModelConfig
    from mtp_train.recipe import load_recipe

    recipe = load_recipe(RECIPE, SMOKE_RECIPE if smoke else [])
    cfg = ModelConfig.from_hf(json.loads(CONFIG.read_text()), str(CONFIG))
    if smoke:
        cfg = dataclasses.replace(cfg, **SMOKE)
    device = torch.device("cpu" if smoke else "cuda")
    return recipe, cfg, device


def _random_model(cfg, device: torch.device, dtype: torch.dtype):
    """The runtime's Transformer for ``cfg`` with random weights, made on ``device`` directly."""
    from mtp_train.models.checkpoint import FLOAT32_PARAMS
    from mtp_train.models.rope import RotaryEmbedding
    from mtp_train.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    g = torch.Generator(device).manual_seed(0)
    state = {}
    for name, p in model.state_dict().items():
        t = torch.empty(p.shape, dtype=torch.float32 if name.endswith(FLOAT32_PARAMS) else dtype, device=device)
        state[name] = t.fill_(1.0) if "norm" in name else t.normal_(0, 0.02, generator=g)
    model.load_state_dict(state, strict=True, assign=True)
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope).to(device)
    return model.eval().requires_grad_(False)


def _peak(device: torch.device, fn, above: bool = True) -> tuple[float, object]:
    """GiB allocated at most while ``fn()`` ran (``above``: above what was allocated before it; nan on the CPU), and
    its result."""
    if device.type != "cuda":
        return float("nan"), fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if above else 0
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB, out


def scoring(recipe, cfg, device: torch.device) -> tuple[list[str], object]:
    """The scoring batch on the TP-8 slice; returns the failures and the engine (for the decode timing)."""
    from mtp_train.memory import scoring_activation_bytes
    from mtp_train.runtime.engine import Engine
    from mtp_train.runtime.kv_cache import KVPool

    tp = recipe.target.tp
    sliced = dataclasses.replace(cfg, num_layers=2, num_heads=cfg.num_heads // tp,
                                 num_kv_heads=max(1, cfg.num_kv_heads // tp), intermediate_size=cfg.intermediate_size // tp)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens, length = recipe.precompute.batch_tokens, min(recipe.data.max_length, recipe.precompute.batch_tokens)
    model = _random_model(sliced, device, dtype)
    kv = 4 * tokens * KVPool.bytes_per_token(sliced, dtype, 1)
    engine = Engine(model, kv_bytes=kv, max_batch_tokens=tokens, max_seqs=256, backend="auto")
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist() for _ in range(tokens // length)]
    engine.score(docs[:1], layers=[-1], topk=recipe.precompute.topk)  # kernels loaded, allocator warm
    measured, _ = _peak(device, lambda: engine.score(docs, layers=[-1], topk=recipe.precompute.topk))
    planned = scoring_activation_bytes(cfg, recipe, 2 if dtype == torch.bfloat16 else 4) / GIB
    print(f"| scoring batch: {tokens:,} tokens ({len(docs)} x {length:,}), top-{recipe.precompute.topk}, TP-{tp} "
          f"slice | {measured:.2f} | {planned:.2f} | {measured / planned:.2f} |")
    over = measured > 1.05 * planned
    return ([f"scoring activations {measured:.2f} GiB over the plan's {planned:.2f}"] if over else []), engine


def training(recipe, cfg, device: torch.device, kind: str) -> list[str]:
    """One training step of a ``kind`` head at full width against the plan's train stage (one process, no ZeRO)."""
    from mtp_train.heads import AUX_KINDS, build_head, head_spec
    from mtp_train.heads.eagle3 import aux_layers_for
    from mtp_train.heads.frozen import FrozenTarget
    from mtp_train.memory import memory_plan
    from mtp_train.recipe import load_recipe
    from mtp_train.train.data import Batch
    from mtp_train.train.objective import loss_weights, objective
    from mtp_train.train.vocab import draft_vocab_size

    overrides = (SMOKE_RECIPE if device.type == "cpu" else []) + [f"head.kind={kind}", "train.engine=ddp"]
    recipe = load_recipe(RECIPE, overrides)
    h, tr, n, hidden = recipe.head, recipe.train, recipe.train.batch_tokens, cfg.hidden_size
    aux = tuple(aux_layers_for(h.aux_layers, cfg)) if kind in AUX_KINDS else ()
    spec = head_spec(kind, h.num_layers, cfg, "probe", h.convention, aux,
                     draft_vocab_size(h.draft_vocab, cfg.vocab_size) if kind == "eagle3" else 0, h.block_size,
                     h.mask_id(cfg.vocab_size))
    g = torch.Generator(device).manual_seed(2)
    frozen = FrozenTarget(cfg, *(torch.randn(s, generator=g, device=device).mul_(0.02)
                                 for s in ((cfg.vocab_size, hidden), (hidden,), (cfg.vocab_size, hidden))))
    head = build_head(spec).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    k = recipe.precompute.topk
    length = min(recipe.data.max_length, n)
    batch = Batch(torch.randint(0, cfg.vocab_size, (n,), device=device), torch.randn(n, hidden, device=device),
                  torch.ones(n, dtype=torch.bool, device=device),
                  torch.randn(n, k, device=device).log_softmax(-1) - 0.1, torch.randint(0, cfg.vocab_size, (n, k),
                                                                                         device=device),
                  torch.full((n,), -2.3, device=device), list(range(0, n + 1, length)),
                  torch.randn(n, len(aux) * hidden, device=device) if aux else None)
    weights = loss_weights(recipe)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    def step() -> float:
        with autocast:
            loss, _ = objective(head, frozen, batch, weights)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    step()  # AdamW's moments exist from here on, as in any later step
    start = time.perf_counter()
    measured, _ = _peak(device, step, above=False)  # all this process holds: nothing else is on the GPU
    seconds = time.perf_counter() - start
    planned = next(p for p in memory_plan(cfg, recipe) if p.stage == "train").total / GIB
    print(f"| training step: {kind} head, {n:,} tokens, bf16 autocast, {seconds:.2f}s | {measured:.2f} | "
          f"{planned:.2f} | {measured / planned:.2f} |")
    del head, opt, batch, frozen
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [f"{kind} training step {measured:.2f} GiB over the plan's {planned:.2f}"] if measured > 1.05 * planned else []


def decoding(engine, device: torch.device, rows: int) -> None:
    """A decode step of ``rows`` rows at T = 0.6, top_p 0.9, distinct seeds; and the sampling alone."""
    from mtp_train.runtime.device import synchronize
    from mtp_train.runtime.sampling import SamplingParams, target_distribution, target_distributions

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, engine.cfg.vocab_size, (32,), generator=g).tolist() for _ in range(rows)]
    params = [SamplingParams(temperature=0.6, top_p=0.9, max_new_tokens=9, seed=i, stop_token_ids=()) for i in
              range(rows)]
    times = {}
    for n in (1, 9):
        engine.generate(prompts, [dataclasses.replace(p, max_new_tokens=n) for p in params])  # warm
        synchronize(device)
        start = time.perf_counter()
        engine.generate(prompts, [dataclasses.replace(p, max_new_tokens=n) for p in params])
        synchronize(device)
        times[n] = time.perf_counter() - start
    step_ms = (times[9] - times[1]) / 8 * 1e3
    logits = torch.randn(rows, engine.cfg.vocab_size, device=device) * 3

    def batched():
        return target_distributions(logits, params)

    def per_row():
        return torch.cat([target_distribution(logits[i : i + 1], p) for i, p in enumerate(params)])

    ms = {}
    for name, fn in (("batched", batched), ("row by row", per_row)):
        fn()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        ms[name] = (time.perf_counter() - start) * 1e3
    print(f"\nDecode step, {rows} rows at T = 0.6, top_p 0.9, a seed per row, on the sliced target (2 layers): "
          f"{step_ms:.1f} ms. The sampling distributions of [{rows}, {engine.cfg.vocab_size:,}] logits: batched "
          f"{ms['batched']:.1f} ms, row by row {ms['row by row']:.1f} ms (x{ms['row by row'] / ms['batched']:.1f}).\n")


def run_probe(smoke: bool) -> list[str]:
    recipe, cfg, device = _setup(smoke)
    print(f"Llama-3.3-70B's shapes{' (scaled down: --cpu-smoke)' if smoke else ''}; GiB per process, measured "
          "(max_memory_allocated) against mtp_train.memory's plan.\n\n| what | measured | planned | ratio |\n"
          "|---|---:|---:|---:|")
    failures = []
    for kind in ("mtp", "eagle3", "dflash"):  # first, alone on the GPU: their peaks are all the process holds
        failures += training(recipe, cfg, device, kind)
    scored, engine = scoring(recipe, cfg, device)
    decoding(engine, device, 16 if smoke else 256)
    return failures + scored
