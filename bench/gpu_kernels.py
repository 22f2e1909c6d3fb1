"""The GPU check's first section: every FlashInfer kernel the runtime plans, loaded (prebuilt, from bench/
flashinfer_aot.py) or compiled, then run once on paged K/V against a dense reference, with the host syncs of each
plan. The steps, on one cache of three sequences whose pages are scattered: a fresh prefill, a decode over the
pages, a causal verify of 4 tokens, DFlash's non-causal block of 4, and a 4-token draft tree (FlashInfer's custom
mask, on fa2). On the CPU (``--cpu-smoke``) the torch backend alone runs the same steps."""

from __future__ import annotations

import time

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 4, 128, 16
LENGTHS = (37, 300, 5)  # prompts: within a page, across many, under one


def _reference(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], q_lens: list[int],
               masks: list[torch.Tensor]) -> torch.Tensor:
    """Dense attention in float32: sequence b's queries ``q [sum q_b, Hq, D]`` over its keys and values
    ``[kv_b, Hkv, D]`` where ``masks[b] [q_b, kv_b]`` allows."""
    out, start = [], 0
    for k, v, n, mask in zip(keys, values, q_lens, masks):
        rep = q.shape[1] // k.shape[1]
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), k.float().repeat_interleave(rep, 1))
        probs = (scores * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v.float().repeat_interleave(rep, 1)))
        start += n
    return torch.cat(out)


def _steps(g: torch.Generator) -> list[tuple[str, list[int], bool, list[torch.Tensor] | None]]:
    """``(name, new tokens per sequence, causal, tree bits or None)`` in order."""
    tree = []
    for _ in LENGTHS:  # each node's ancestors: a random parent among the earlier nodes, and itself
        bits = torch.eye(4, dtype=torch.bool)
        for i in range(1, 4):
            parent = int(torch.randint(0, i, (1,), generator=g))
            bits[i] |= bits[parent]
        tree.append(bits)
    return [("prefill", list(LENGTHS), True, None), ("decode", [1, 1, 1], True, None),
            ("verify", [4, 4, 4], True, None), ("dflash block", [4, 4, 4], False, None),
            ("tree (custom mask)", [4, 4, 4], True, tree)]


def run_kernels(smoke: bool) -> list[str]:
    """Print the kernels' provenance and each step's error against the reference; return the failures."""
    from mtp_train.runtime.attention import select_backend
    from mtp_train.runtime.batch import TreeMask, build_batch

    device = torch.device("cpu" if smoke else "cuda")
    backends = ["torch"] if smoke else ["torch", "flashinfer"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    failures = []
    if "flashinfer" in backends:
        failures += _load(device, dtype)
    g = torch.Generator().manual_seed(0)
    pages_per_seq = -(-(max(LENGTHS) + 13) // PAGE)
    order = torch.randperm(pages_per_seq * len(LENGTHS), generator=g).tolist()  # scattered pages
    tables = [order[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(len(LENGTHS))]
    impls = {name: select_backend(name, device, None, dtype, head_dim=HEAD_DIM) for name in backends}
    shape = (len(order), PAGE, KV_HEADS, HEAD_DIM)
    caches = {name: (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for name in backends}
    keys, values = [[] for _ in LENGTHS], [[] for _ in LENGTHS]
    print("| step | backend | max abs error vs dense fp32 | host syncs in plan | first call (s) |\n|---|---|---:|---:|---:|")
    for name, q_lens, causal, bits in _steps(g):
        cached = [sum(t.shape[0] for t in ks) for ks in keys]
        tree = TreeMask(cached, [b.to(device) for b in bits]) if bits else None
        meta = build_batch([[0] * n for n in q_lens], cached, tables, PAGE, device, tree=tree)
        t = sum(q_lens)
        q, k, v = (torch.randn(t, h, HEAD_DIM, generator=g).to(device, dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
        start = 0
        for b, n in enumerate(q_lens):
            keys[b].append(k[start : start + n].cpu())
            values[b].append(v[start : start + n].cpu())
            start += n
        masks = []
        for b, n in enumerate(q_lens):
            kv = cached[b] + n
            rows = torch.arange(cached[b], kv)[:, None] if causal else torch.full((n, 1), kv - 1)
            mask = torch.arange(kv)[None, :] <= rows
            if bits:
                mask[:, cached[b]:] = bits[b]
            masks.append(mask)
        want = _reference(q.cpu(), [torch.cat(x) for x in keys], [torch.cat(x) for x in values], q_lens, masks)
        for backend, impl in impls.items():
            syncs, seconds, out = _timed_step(impl, meta, causal, q, k, v, caches[backend], device)
            err = (out.float().cpu() - want).abs().max().item()
            print(f"| {name} | {backend} | {err:.4f} | {syncs} | {seconds:.2f} |")
            if err > (0.05 if dtype == torch.bfloat16 else 1e-4):
                failures.append(f"{backend} {name}: max error {err:.4f} against dense attention")
            if syncs:
                failures.append(f"{backend} {name}: {syncs} host sync(s) in plan")
    print()
    return failures


def _timed_step(impl, meta, causal: bool, q, k, v, cache, device: torch.device):
    """One step through a backend: ``(syncs in its plan, seconds of plan and attend, output)``."""
    from mtp_train.runtime.device import synchronize

    synchronize(device)
    start = time.perf_counter()
    if device.type == "cuda":
        from mtp_train.runtime.syncs import cuda_syncs

        with cuda_syncs() as record:
            plan = impl.plan(meta, HEADS, KV_HEADS, HEAD_DIM, causal)
        syncs = record.count
    else:
        plan, syncs = impl.plan(meta, HEADS, KV_HEADS, HEAD_DIM, causal), 0
    out = plan.attend(q, k, v, *cache)
    synchronize(device)
    return syncs, time.perf_counter() - start, out


def _load(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Load or build the modules (``flashinfer_backend.load_kernels``), and say which were prebuilt."""
    from flashinfer.jit.page import gen_page_module
    from flashinfer.prefill import gen_batch_prefill_module
    from flashinfer.utils import determine_attention_backend

    from mtp_train.runtime.flashinfer_backend import load_kernels

    auto = determine_attention_backend(device, 0, False, False, dtype, dtype)
    args = (dtype, dtype, dtype, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False, False)
    specs = [(f"paged prefill, {b}", gen_batch_prefill_module(b, *args)) for b in dict.fromkeys((auto, "fa2"))]
    specs.append(("paged append", gen_page_module()))
    prebuilt = {name: spec.is_aot for name, spec in specs}
    start = time.perf_counter()
    try:
        load_kernels(device, dtype, HEAD_DIM, None)
    except Exception as e:  # noqa: BLE001  (reported, and the check goes on with the torch backend)
        return [f"flashinfer's kernels did not load or build: {type(e).__name__}: {str(e).splitlines()[-1][:300]}"]
    seconds = time.perf_counter() - start
    how = ", ".join(f"{name} ({'prebuilt' if aot else 'compiled here'})" for name, aot in prebuilt.items())
    print(f"FlashInfer modules: {how}; loaded in {seconds:.1f}s (auto picks {auto} on this GPU).\n")
    return []
