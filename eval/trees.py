"""The report's tree table: every draft tree of ``eval.trees`` beside the chain of k = its depth, same draft and
temperature, and the best tree's speedup beside the best chain's."""

from __future__ import annotations

from mtp_train.eval.report import Report, SweepPoint


def _num(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "—" if x is None else f"{x:.{digits}f}{suffix}"


def _drafts(r: Report) -> list[tuple[str, list[SweepPoint], list[SweepPoint]]]:
    """``(name, chains, trees)`` of every draft that swept a tree, this report's first."""
    drafts = [(r.mode, r.sweep, r.tree_sweep)] + [(c.name, c.sweep, c.tree_sweep) for c in r.comparisons]
    return [d for d in drafts if d[2]]


def _best(points: list[SweepPoint]) -> SweepPoint | None:
    measured = [p for p in points if p.measured_speedup is not None]
    return max(measured, key=lambda p: p.measured_speedup) if measured else None


def _setting(p: SweepPoint) -> str:
    shape = f"tree {p.tree.describe()}" if p.tree is not None else f"chain k={p.k}"
    return f"{shape}, T={p.temperature:g}"


def best_tree_cell(r: Report) -> str | None:
    """The headline's line for this draft's best tree against its best chain (``None`` without trees)."""
    if not r.tree_sweep:
        return None
    tree, chain = _best(r.tree_sweep), _best(r.sweep)
    if tree is None:
        return None
    line = f"{tree.measured_speedup:.2f}× measured, τ {tree.tau:.2f} ({_setting(tree)})"
    if chain is not None:
        line += f"; best chain {chain.measured_speedup:.2f}× ({_setting(chain)})"
    return line


def tree_table(r: Report):
    """The section, or ``None`` when no draft swept a tree."""
    drafts = _drafts(r)
    if not drafts:
        return None
    rows = []
    for name, chains, trees in drafts:
        chain_at = {(p.k, p.temperature): p for p in chains}
        for p in sorted(trees, key=lambda p: (p.temperature, p.tree.depth, p.tree.topk, p.tree.draft_tokens)):
            chain = chain_at.get((p.k, p.temperature))
            ratio = None if chain is None or not chain.tau else p.tau / chain.tau
            mal = None if p.engine_acceptance is None else p.engine_acceptance.mean_acceptance_length
            cost = p.cost
            rows.append([name, p.tree.describe(), f"{p.temperature:g}", _num(p.tau),
                         "—" if chain is None else _num(chain.tau), _num(ratio, 3, "×"), _num(mal),
                         "—" if cost is None else _num(cost.draft_forward_ms * (p.draft_forwards_per_step or p.k), 3),
                         "—" if cost is None else _num(cost.verify_step_ms, 3),
                         _num(p.expected_speedup, 2, "×"), _num(p.measured_speedup, 2, "×"),
                         "n/a" if p.lossless is None else ("yes" if p.lossless else "NO")])
    best = []
    for name, chains, trees in drafts:
        tree, chain = _best(trees), _best(chains)
        if tree is not None and chain is not None:
            best.append(f"{name}: best tree {tree.measured_speedup:.2f}× ({_setting(tree)}), best chain "
                        f"{chain.measured_speedup:.2f}× ({_setting(chain)}).")
    return ("Draft trees against chains", [
        ("p", "Each tree is EAGLE-2's dynamic tree as SGLang serves it (topk children per expanded node, depth levels, "
              "the best draft tokens by cumulative draft probability, the root counted), verified in one target "
              "forward with a tree mask; the chain beside it is the same draft at k = the tree's depth. SGLang's "
              "accept length is what its log prints: 1 + accepted drafts per verify step. Draft ms is a step's "
              "draft forwards (the tree's levels and the re-sync), verify ms the rest of the step."),
        ("table", ["draft", "tree", "T", "τ", "chain τ (k = depth)", "tree / chain", "SGLang accept length",
                   "draft ms / step", "verify ms / step", "expected speedup", "measured speedup", "lossless"], rows),
        *[("p", line) for line in best],
    ])
