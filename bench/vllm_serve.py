"""One vLLM run for bench/vllm_check.py, inside vLLM's own virtualenv (`make vllm` makes .venv-vllm).

    .venv-vllm/bin/python bench/vllm_serve.py JOB.json RESULT.json

JOB.json: ``{"target": DIR, "prompts": [[token ids], ...], "max_tokens": N, "max_model_len": M,
"head": DIR or null, "k": K, "method": "eagle", "eagle3" or "dflash", "parallel": true for a P-EAGLE head}``. Greedy decoding (T = 0) of the token-id prompts,
stopping at the target's end-of-sequence ids as vLLM reads them from its generation config; with ``head``, EAGLE
(or EAGLE-3) speculative decoding with ``k`` draft tokens. RESULT.json: the generated token ids per prompt and,
with a head, vLLM's speculative-decoding counters from ``llm.get_metrics()`` (drafts, draft tokens, accepted
tokens, accepted per position).

With ``"sets": {NAME: [[token ids], ...], ...}`` in place of ``prompts`` (bench/peer_parity.py) each set is
generated in turn by the one loaded engine, and RESULT.json holds ``{"sets": {NAME: {"tokens", "counts"}}}``: each
set's outputs and the counters it added (the difference of ``llm.get_metrics()`` before and after it).

With ``"timing": {"repeats": R, "batches": [1, 8]}`` (bench/runtime_bench.py) it times plain decoding instead:
exactly N tokens per prompt (end-of-sequence ignored), the prompts ``batch`` at a time, one untimed warm-up and
then R repetitions per batch size; RESULT.json holds ``times`` and ``tokens`` per batch size and vLLM's version.
Imports nothing of the project: that virtualenv has vLLM's own torch and transformers.
"""

from __future__ import annotations

import json
import os
import sys
import time


def counters(metrics) -> dict:
    """vLLM's ``vllm:spec_decode_*`` counters as ``drafts``, ``draft_tokens``, ``accepted``, ``accepted_per_position``."""
    by_name = {m.name: m for m in metrics}

    def value(name: str) -> int:
        return int(by_name[name].value) if name in by_name else 0

    per_pos = by_name.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return {"drafts": value("vllm:spec_decode_num_drafts"), "draft_tokens": value("vllm:spec_decode_num_draft_tokens"),
            "accepted": value("vllm:spec_decode_num_accepted_tokens"),
            "accepted_per_position": [int(v) for v in per_pos.values] if per_pos is not None else []}


def main(job_path: str, result_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(open(job_path).read())
    spec = None
    if job.get("head"):
        spec = {"method": job.get("method", "eagle"), "model": job["head"], "num_speculative_tokens": job["k"]}
        if job.get("parallel"):  # P-EAGLE: all k drafts from one forward over the last row and k - 1 masks
            spec["parallel_drafting"] = True
    start = time.perf_counter()
    llm = LLM(model=job["target"], dtype="float32", max_model_len=job["max_model_len"], enforce_eager=True,
              speculative_config=spec, disable_log_stats=False, seed=0)
    loaded = time.perf_counter() - start
    if job.get("timing"):
        return timing(llm, job, result_path)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    if job.get("sets"):
        return by_set(llm, job, params, spec is not None, result_path, loaded)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "load_s": round(loaded, 1),
              "generate_s": round(time.perf_counter() - start, 1)}
    if spec is not None:
        result["counts"] = counters(llm.get_metrics())
    write(result, result_path)
    return 0


def by_set(llm, job: dict, params, speculative: bool, result_path: str, loaded: float) -> int:
    """Each prompt set generated in turn; its outputs and, speculative, the counters it added."""
    from vllm.inputs import TokensPrompt

    result: dict = {"load_s": round(loaded, 1), "sets": {}}
    for name, prompts in job["sets"].items():
        before = counters(llm.get_metrics()) if speculative else None
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        one = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
               "generate_s": round(time.perf_counter() - start, 1)}
        if before is not None:
            after = counters(llm.get_metrics())
            per_pos = after["accepted_per_position"]
            old = before["accepted_per_position"] + [0] * (len(per_pos) - len(before["accepted_per_position"]))
            one["counts"] = {**{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")},
                             "accepted_per_position": [a - b for a, b in zip(per_pos, old)]}
        result["sets"][name] = one
    write(result, result_path)
    return 0


def write(result: dict, result_path: str) -> None:
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)


def timing(llm, job: dict, result_path: str) -> int:
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], min_tokens=job["max_tokens"],
                            ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    result = {"version": vllm.__version__, "times": {}, "tokens": {}}
    for batch in job["timing"]["batches"]:
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]

        def run() -> list[list[int]]:
            return [list(o.outputs[0].token_ids) for g in groups for o in llm.generate(g, params, use_tqdm=False)]

        run()  # warm-up
        times = []
        for _ in range(job["timing"]["repeats"]):
            start = time.perf_counter()
            tokens = run()
            times.append(time.perf_counter() - start)
        result["times"][str(batch)], result["tokens"][str(batch)] = times, tokens
    write(result, result_path)
    return 0


if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    sys.exit(main(*sys.argv[1:3]))
