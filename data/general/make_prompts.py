"""Build ``prompts.jsonl.gz``: a category-balanced Dolly-15k prompt set, decontaminated against the eval sets.

Source: ``databricks-dolly-15k.jsonl`` (Databricks, CC BY-SA 3.0), the file of the Hugging Face dataset
``databricks/databricks-dolly-15k``. ``SOURCE`` is either

* that file, which must be byte-identical to the one pinned below (its Git LFS object: sha256 and size) and
  hold 15,011 rows with ``instruction``, ``context``, ``response`` and ``category``; ``source_id`` is then the
  row's 0-based line number; or
* a directory holding the 12 JSON pieces of a third-party split of the same rows (``PIECES`` below, from
  GitHub ``george186/LLM_KD`` commit eb11e9c8d4bf8035cb1cd6aa6279d039758b54a5, folder ``data/10/``: the 80-row
  ``global_test.json``, ``public_training.json`` and ``local_training_0..9.json``). Each piece must match its
  pinned sha256; together they must hold 15,011 rows with exactly the four string fields, the dataset card's
  per-category counts, and, written the way the original file is written (``json.dumps`` of each row with the
  keys in the order above, lines joined by ``"\\n"``), exactly the original file's 13,085,339 bytes. The pieces
  lost the original line order, so the rows are put in a canonical order (sorted by that serialised line,
  whose joined sha256 is pinned as ``PIECES_SORTED_SHA256``) and ``source_id`` is the row's index in that order.

Steps, all deterministic:

1. Prompt = ``instruction`` stripped, plus ``"\\n\\n" + context`` when the stripped context is non-empty.
   Rows whose prompt is longer than ``--max-chars`` (1,500) characters or whose response is empty are dropped.
2. Decontamination against the eval prompts in ``data/eval`` (Spec-Bench and MT-bench: every turn; HumanEval:
   the ``prompt`` stub; GSM8K: the ``question``). Texts are normalised (NFKC, lowercase, every Unicode
   punctuation or symbol character replaced by a space, whitespace collapsed) and split on spaces. A Dolly
   prompt is removed when its normalised text equals an eval prompt's, or when it shares any word 13-gram with
   an eval prompt (eval prompts shorter than 13 words count as one n-gram, the whole prompt).
3. ``--n`` (3,000) rows are drawn: an equal share per category (``n // categories``, the remainder and any
   category's shortfall dealt round-robin over the categories in sorted order), each category's pool shuffled
   with ``random.Random(f"{seed}/{category}")``; the result is shuffled with ``random.Random(seed)``.
4. Rows are written as OpenAI-style chat rows, one JSON object per line, gzip with a zero timestamp:
   ``{"messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": RESPONSE}],
   "category": CATEGORY, "source_id": N}`` (``N``: the 0-based line of the source file, or with a pieces
   directory the row's index in the canonical order).

Usage (from the repository root):

    .venv/bin/python data/general/make_prompts.py /path/to/databricks-dolly-15k.jsonl
    .venv/bin/python data/general/make_prompts.py /path/to/pieces_dir   # the 12 pieces named in PIECES

It prints a JSON report (counts per category, rows removed by each overlap rule) to stdout.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import random
import re
import sys
import unicodedata
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The Git LFS object of `databricks-dolly-15k.jsonl` in huggingface.co/datasets/databricks/databricks-dolly-15k
# at commit d72c16e4644a463b9c678c71d9440befd4594556 ("Update with recent fixes", 2023-05-04), the newest version.
DOLLY_SHA256 = "2df9083338b4abd6bceb5635764dab5d833b393b55759dffb0959b6fcbf794ec"
DOLLY_BYTES = 13085339
DOLLY_ROWS = 15011
FIELDS = ("instruction", "context", "response", "category")
# Per-category row counts from the dataset card.
CATEGORY_COUNTS = {
    "brainstorming": 1766,
    "classification": 2136,
    "closed_qa": 1773,
    "creative_writing": 709,
    "general_qa": 2191,
    "information_extraction": 1506,
    "open_qa": 3742,
    "summarization": 1188,
}
# The same rows, split into 12 JSON arrays of row objects by a federated-learning data script (pandas
# ``to_dict`` + ``json.dump``): github.com/george186/LLM_KD, commit eb11e9c8d4bf8035cb1cd6aa6279d039758b54a5,
# folder data/10/. sha256 of each file as stored there.
PIECES = {
    "global_test.json": "1df775c08bfefc15dc30184332bf3c62b0ef83c498c541baa7212d7d5ef1e430",
    "public_training.json": "841b5e71f15cf9c3fe56d0cff8749ed2db0d1a51478f47a5508e2612f11d912b",
    "local_training_0.json": "1fbd5ba4116547ce420c689f7af1ec9879e384cb087104d590ef5cb23a19d646",
    "local_training_1.json": "a2b3913b5cb6fb3f9f4591c069303f3f9205f39e78642097b80bad892ab97030",
    "local_training_2.json": "6243790bae509796138fd93e34150217e0cb1819aa524be5ab8a63ada2bab0c8",
    "local_training_3.json": "492fa50d8db037c4cb421b6f97ab10b3b570cd9bf4c1edb36ffb03d0a3df1675",
    "local_training_4.json": "3f12730a27791247f29faa580c518d15900c77dfe070392ab5944d00937eb80d",
    "local_training_5.json": "d0377d6a98365a7c10cd88165a06123f6bdc1eedcaee2fde7637197bd3036829",
    "local_training_6.json": "e21767c542999fab74e9fbac37543b7f6239a57d9f688ca6a41b41323fffb58a",
    "local_training_7.json": "b3a4895c27f69812e9fa4c082a6769d88c55a6dd2b7f3cad47351b345b2c5eef",
    "local_training_8.json": "8e101d51073c9cd7fbc43cf27bf6f39647a8f1b1140bf7cf9292616f37978555",
    "local_training_9.json": "ba77506fb3069f9cb78b07e4ffdf04f2ff2ed79643e3d3a6444b8101d8a9b9b5",
}
# sha256 of the 15,011 serialised rows (``json.dumps`` of {instruction, context, response, category}), sorted,
# joined by "\n": the canonical order used with a pieces directory.
PIECES_SORTED_SHA256 = "f5b67c0bd83917f6cb054e06e2b556040965f430dfb275220a205614d0e384ee"
NGRAM = 13


def normalize(text: str) -> list[str]:
    """Lowercased words of ``text`` with punctuation and symbols turned into spaces."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch)[0] in "PS" else ch for ch in text)
    return text.split()


def ngrams(words: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def eval_prompts(eval_dir: Path) -> dict[str, list[str]]:
    """Every eval prompt text, by set."""

    def jsonl(path: Path) -> list[dict]:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    out = {
        "spec_bench": [t for r in jsonl(eval_dir / "spec_bench/question.jsonl") for t in r["turns"]],
        "mt_bench": [t for r in jsonl(eval_dir / "mt_bench/question.jsonl") for t in r["turns"]],
        "humaneval": [r["prompt"] for r in jsonl(eval_dir / "humaneval/HumanEval.jsonl.gz")],
        "gsm8k": [r["question"] for r in jsonl(eval_dir / "gsm8k/test.jsonl")],
    }
    for name, texts in out.items():
        if not texts:
            raise SystemExit(f"eval set {name}: no prompts")
    return out


def serialize(row: dict) -> str:
    """A row written the way the original file writes it."""
    return json.dumps({k: row[k] for k in FIELDS})


def read_pieces(path: Path, verify: bool) -> tuple[list[dict], dict]:
    """The rows of the pieces directory ``path`` (see ``PIECES``), in canonical order."""
    rows: list[dict] = []
    for name, want in PIECES.items():
        data = (path / name).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if verify and digest != want:
            raise SystemExit(f"{path / name}: sha256 {digest}, expected {want} (pass --no-verify to use another copy)")
        part = json.loads(data.decode("utf-8"))
        if not isinstance(part, list):
            raise SystemExit(f"{path / name}: not a JSON array")
        rows += part
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != set(FIELDS) or not all(isinstance(row[k], str) for k in FIELDS):
            raise SystemExit(f"{path}: row {i} is not an object with exactly the string fields {FIELDS}")
    lines = sorted(serialize(r) for r in rows)
    joined = "\n".join(lines).encode("utf-8")
    counts = dict(sorted(Counter(r["category"] for r in rows).items()))
    digest = hashlib.sha256(joined).hexdigest()
    if verify:
        if len(rows) != DOLLY_ROWS:
            raise SystemExit(f"{path}: {len(rows)} rows, expected {DOLLY_ROWS}")
        if counts != CATEGORY_COUNTS:
            raise SystemExit(f"{path}: category counts {counts}, expected {CATEGORY_COUNTS}")
        if len(joined) != DOLLY_BYTES:
            raise SystemExit(f"{path}: rows serialise to {len(joined)} bytes, expected {DOLLY_BYTES}")
        if digest != PIECES_SORTED_SHA256:
            raise SystemExit(f"{path}: sorted rows sha256 {digest}, expected {PIECES_SORTED_SHA256}")
    rows = [json.loads(line) for line in lines]
    return rows, {"pieces_dir": str(path), "sorted_rows_sha256": digest, "bytes": len(joined), "rows": len(rows)}


def read_dolly(path: Path, verify: bool) -> tuple[list[dict], dict]:
    if path.is_dir():
        return read_pieces(path, verify)
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if verify and (digest != DOLLY_SHA256 or len(data) != DOLLY_BYTES):
        raise SystemExit(
            f"{path}: sha256 {digest} / {len(data)} bytes, expected {DOLLY_SHA256} / {DOLLY_BYTES} "
            "(pass --no-verify to use another copy)"
        )
    rows = [json.loads(line) for line in io.StringIO(data.decode("utf-8")) if line.strip()]
    for i, row in enumerate(rows):
        if not all(isinstance(row.get(k), str) for k in FIELDS):
            raise SystemExit(f"{path}: line {i} lacks one of {FIELDS}")
    if verify and len(rows) != DOLLY_ROWS:
        raise SystemExit(f"{path}: {len(rows)} rows, expected {DOLLY_ROWS}")
    return rows, {"file": path.name, "sha256": digest, "bytes": len(data), "rows": len(rows)}


def build_prompt(row: dict) -> str:
    prompt = row["instruction"].strip()
    context = row["context"].strip()
    return f"{prompt}\n\n{context}" if context else prompt


def allocate(sizes: dict[str, int], n: int) -> dict[str, int]:
    """An equal share of ``n`` per category, capped by its size; leftovers dealt round-robin in sorted order."""
    cats = sorted(sizes)
    take = {c: 0 for c in cats}
    left = min(n, sum(sizes.values()))
    while left:
        for c in cats:
            if left and take[c] < sizes[c]:
                take[c] += 1
                left -= 1
    return take


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="databricks-dolly-15k.jsonl, or a directory with the pieces in PIECES")
    ap.add_argument("--out", type=Path, default=HERE / "prompts.jsonl.gz")
    ap.add_argument("--eval-dir", type=Path, default=REPO / "data" / "eval")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--max-chars", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256, size, row-count and category-count checks")
    args = ap.parse_args(argv)

    rows, source = read_dolly(args.source, verify=not args.no_verify)

    evals = eval_prompts(args.eval_dir)
    eval_exact = {" ".join(normalize(t)) for texts in evals.values() for t in texts}
    eval_grams: dict[tuple[str, ...], set[str]] = {}
    for name, texts in evals.items():
        for t in texts:
            for g in ngrams(normalize(t)):
                eval_grams.setdefault(g, set()).add(name)

    dropped = Counter()
    removed_by_set = Counter()
    removed_ids: list[int] = []
    pools: dict[str, list[tuple[int, str, str]]] = {}
    for idx, row in enumerate(rows):
        prompt = build_prompt(row)
        if not row["response"].strip():
            dropped["empty_response"] += 1
            continue
        if len(prompt) > args.max_chars:
            dropped["too_long"] += 1
            continue
        words = normalize(prompt)
        if " ".join(words) in eval_exact:
            dropped["eval_exact_match"] += 1
            removed_ids.append(idx)
            continue
        hit = set().union(*(eval_grams.get(g, set()) for g in ngrams(words)))
        if hit:
            dropped["eval_13gram_overlap"] += 1
            removed_by_set.update(hit)
            removed_ids.append(idx)
            continue
        pools.setdefault(row["category"], []).append((idx, prompt, row["response"]))

    take = allocate({c: len(p) for c, p in pools.items()}, args.n)
    chosen = []
    for cat in sorted(pools):
        pool = list(pools[cat])
        random.Random(f"{args.seed}/{cat}").shuffle(pool)
        chosen += [(cat, *item) for item in pool[: take[cat]]]
    random.Random(args.seed).shuffle(chosen)

    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
        for cat, idx, prompt, response in chosen:
            rec = {
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                "category": cat,
                "source_id": idx,
            }
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))
    args.out.write_bytes(buf.getvalue())

    report = {
        "source": source,
        "eval_prompts": {k: len(v) for k, v in evals.items()},
        "dropped": dict(dropped),
        "overlap_removed_ids": removed_ids,
        "overlap_13gram_by_eval_set": dict(removed_by_set),
        "eligible_by_category": {c: len(p) for c, p in sorted(pools.items())},
        "written_by_category": dict(sorted(Counter(c for c, *_ in chosen).items())),
        "written": len(chosen),
        "out": str(args.out),
        "out_bytes": len(buf.getvalue()),
        "out_sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
    }
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
