"""What bench/peer_parity.py prints: acceptance from vLLM's counters with standard errors, and the side-by-side table.

From one vLLM run's counters at draft length k (``drafts`` D, ``accepted_per_position`` a_1..a_k, where a_i counts
the drafts whose first i tokens were all accepted):

- α_i = a_i / D, the rate at which position i is accepted (unconditional, vLLM's convention);
- MAL = 1 + Σ a_i / D, the mean acceptance length with the bonus token;
- the accepted length of one draft is L with P(L ≥ i) = a_i / D, so E[L²] = Σ (2i − 1) a_i / D and
  SE(MAL) = sqrt((E[L²] − E[L]²) / D); SE(α_1) = sqrt(α_1 (1 − α_1) / D).

These treat drafts as independent, which drafts of one answer are not, so the errors are lower bounds. The goal
compares the two trainers by paired differences instead: ours minus the peer's per cell and seed (each side's
counters pooled over the prompt sets), whose standard error over the runs holds the seeds' spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Acceptance:
    """One head at one k on one prompt set, from vLLM's counters."""

    drafts: int
    per_position: tuple[int, ...]  # a_1..a_k

    @property
    def alphas(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.per_position]

    @property
    def mal(self) -> float:
        return 1.0 + sum(self.alphas)

    @property
    def se_alpha1(self) -> float:
        p = self.alphas[0] if self.per_position else 0.0
        return math.sqrt(p * (1 - p) / self.drafts) if self.drafts else 0.0

    @property
    def se_mal(self) -> float:
        if not self.drafts:
            return 0.0
        mean = sum(self.alphas)
        square = sum((2 * i + 1) * a for i, a in enumerate(self.alphas))
        return math.sqrt(max(square - mean * mean, 0.0) / self.drafts)


def from_counts(counts: dict) -> Acceptance:
    return Acceptance(counts["drafts"], tuple(counts["accepted_per_position"]))


def pooled(counts: list[dict]) -> Acceptance:
    """One head's counters summed over prompt sets (drafts and per-position acceptances add)."""
    accepted = [c["accepted_per_position"] for c in counts]
    return Acceptance(sum(c["drafts"] for c in counts), tuple(map(sum, zip(*accepted))))


def paired_differences(scores: dict, k: int, peer: str, ours: str = "ours") -> dict[str, list[float]]:
    """``{"alpha1": [...], "mal": [...]}``: ``ours`` minus ``peer`` per run (a cell at one seed) that trained both,
    each side's counters pooled over the run's prompt sets. ``scores[run][trainer][k][set]`` as
    :func:`acceptance_rows` reads them."""
    out: dict[str, list[float]] = {"alpha1": [], "mal": []}
    for s in scores.values():
        if ours not in s or peer not in s:
            continue
        a, b = (pooled([r["counts"] for r in s[t][k].values()]) for t in (ours, peer))
        out["alpha1"].append(a.alphas[0] - b.alphas[0])
        out["mal"].append(a.mal - b.mal)
    return out


def verdict(differences: list[float]) -> tuple[float, float, str]:
    """Mean and standard error of paired differences (one per cell and seed, so the error holds the seeds' spread as
    well as the prompts'), and "ahead" or "behind" beyond 2 standard errors, else "level"."""
    n = len(differences)
    mean = sum(differences) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1) / n) if n > 1 else math.inf
    return mean, se, "ahead" if mean > 2 * se else "behind" if mean < -2 * se else "level"


def acceptance_rows(run: str, scores: dict, ks: list[int], trainers: list[str]) -> list[str]:
    """Markdown rows for one run (a cell at one seed): per prompt set and k, each of ``trainers``' α_1..α_k and
    MAL ± SE ("–" where the run did not train it), then whether every speculative output was lossless.

    ``scores[trainer][k][set]`` = ``{"counts": ..., "lossless": bool}``.
    """
    rows = []
    for name in scores["ours"][ks[0]]:
        for k in ks:
            heads = [from_counts(scores[t][k][name]["counts"]) if t in scores else None for t in trainers]
            lossless = all(scores[t][k][name]["lossless"] for t in scores)
            rows.append(f"| {run} | {name} | {k} | "
                        + " | ".join(' / '.join(f'{x:.3f}' for x in a.alphas) if a else "–" for a in heads) + " | "
                        + " | ".join(f"{a.mal:.3f} ± {a.se_mal:.3f}" if a else "–" for a in heads)
                        + f" | {' / '.join(str(a.drafts) if a else '–' for a in heads)} | "
                        + f"{'yes' if lossless else 'NO'} |")
    return rows


def acceptance_header(trainers: list[str]) -> str:
    """The header of :func:`acceptance_rows`' table for ``trainers``."""
    return ("| run | prompts | k | " + " | ".join(f"{t} α_1..α_k" for t in trainers) + " | "
            + " | ".join(f"{t} MAL ± SE" for t in trainers) + f" | drafts ({' / '.join(trainers)}) | lossless |\n"
            + "|---|---|---:|" + "---|" * len(trainers) + "---:|" * len(trainers) + "---:|---|")


def goal_rows(scores: dict, k: int, peer: str, ours: str = "ours") -> list[tuple[str, str]]:
    """The goal at ``k``, pooled over cells and seeds: ``ours`` ahead of ``peer`` by more than 2 standard errors in
    α_1 and in MAL. Returns ``(line, verdict)`` per measure."""
    out = []
    for measure, diffs in paired_differences(scores, k, peer, ours).items():
        if not diffs:
            out.append((f"{measure} at k = {k}, {ours} − {peer}: no run trained both", "no claim"))
            continue
        mean, se, said = verdict(diffs)
        out.append((f"{measure} at k = {k}, {ours} − {peer} over {len(diffs)} runs (cells × seeds): "
                    f"{mean:+.4f} ± {se:.4f}", said))
    return out


def cost_rows(costs: dict) -> list[str]:
    """Markdown rows: each trainer's steps, tokens trained, training tokens/s (Σ tokens / Σ optimizer-step wall time,
    loader waits included) and feature bytes per token, as stored and with the states at bf16, per run."""
    rows = ["| run | trainer | steps | tokens trained | training tokens/s | feature bytes/token | at bf16 |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for run, c in costs.items():
        for trainer, r in c.items():
            rows.append(f"| {run} | {trainer} | {r['steps']} | {r['tokens_trained']:,} | {r['tokens_per_s']:,.0f} | "
                        f"{r['bytes_per_token']:,.0f} | {r.get('bytes_per_token_bf16', r['bytes_per_token']):,.0f} |")
    return rows


def ratio_line(costs: dict, label: str, ours: str, peer: str, what: str, theirs: str | None = None) -> str:
    """``what`` of ``ours`` ÷ ``theirs`` (default: the same field) of ``peer`` per run whose two sides ran on one
    machine (a cost's ``machine``; runs kept from other sessions may not have): mean ± standard error, and the
    range."""
    ratios = [c[ours][what] / c[peer][theirs or what] for c in costs.values()
              if peer in c and c[ours].get("machine") == c[peer].get("machine")]
    if not ratios:
        return f"{label}, {ours} ÷ {peer}: no run with both sides on one machine"
    n, mean = len(ratios), sum(ratios) / len(ratios)
    se = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (n - 1) / n) if n > 1 else math.inf
    return (f"{label}, {ours} ÷ {peer}: {mean:.2f} ± {se:.2f} ({min(ratios):.2f}–{max(ratios):.2f} over {n} runs "
            "on one machine each)")


def with_int_k(scores: dict) -> dict:
    """``scores[trainer][k][set]`` with ``k`` back to an int (JSON stores it as a string)."""
    return {t: {int(k): sets for k, sets in by_k.items()} for t, by_k in scores.items()}


def report(outcomes: dict, rows: dict, ks: list[int], differences: list[str]) -> None:
    """What bench/peer_parity.py prints from its cells' outcomes (``outcomes[cell]`` = ``{"run", "wall_s", "costs":
    {setting: {trainer: cost}}, "scores": {setting: {trainer: {k: {set: ...}}}}}``): per row of settings the
    acceptance, the costs, the goals at k = 3 against each peer (for ours and for ours with the exact teacher) and
    the cost ratios; then the differences that remain and the wall time."""
    goal_k = 3 if 3 in ks else max(ks)
    for setting, (overrides, theirs) in rows.items():
        ran = [o for o in outcomes.values() if setting in o["scores"]]  # a row may run at some seeds only
        if not ran:
            continue
        scores = {o["run"]: with_int_k(o["scores"][setting]) for o in ran}
        costs = {o["run"]: o["costs"][setting] for o in ran}
        trainers = ["ours", "ours-exact", *theirs]
        print(f"\n### {setting}: ours {' '.join(overrides) or 'as recipes/smollm2.yaml'}; {theirs}\n")
        print(acceptance_header(trainers))
        for name, s in scores.items():
            print("\n".join(acceptance_rows(name, s, ks, trainers)))
        print()
        print("\n".join(cost_rows(costs)))
        print(f"\nGoals at k = {goal_k}, pooled over cells and seeds (ahead: by more than 2 standard errors):")
        for peer in theirs:
            for ours in ("ours", "ours-exact"):
                for line, said in goal_rows(scores, goal_k, peer, ours):
                    print(f"- {said}: {line}")
            for label, what, theirs, said in (("tokens_per_s", "tokens_per_s", None, "(higher: ours ahead)"),
                                              ("bytes/token", "bytes_per_token", None, "as stored (lower: ours ahead)"),
                                              ("bytes/token", "bytes_per_token", "bytes_per_token_bf16",
                                               f"with {peer}'s states at bf16")):
                for ours in ("ours", "ours-exact"):
                    print(f"- {ratio_line(costs, label, ours, peer, what, theirs)} {said}")
    print("\nDifferences between the trainers that remain:")
    notes = {n for o in outcomes.values() for c in o["costs"].values() for v in c.values() for n in v.get("notes", [])}
    for line in differences + sorted(notes):
        print(f"- {line}")
    wall = sum(o["wall_s"] for o in outcomes.values())
    machines = sorted({m for o in outcomes.values() for m in o["machine"]})
    print(f"\nWall time of the {len(outcomes)} cells: {wall / 3600:.2f} h (every run's, summed), on "
          + "; ".join(machines))
