"""``space-layout``: print a SPACE mask-token layout for given sizes (DESIGN §3), drawn by
``space.masking.render``: the decode block of a step (a chain or a token tree), one step the dynamic
tree's planner chooses (``--tree dynamic``, :func:`dynamic_example`), or a training sample's layout.
"""
from __future__ import annotations

import argparse

from .cli import add_debug_flag, console
from .masking import Layout, build_layout, decode_layout, render, train_layout, tree_parents, truncate_layout


def dynamic_example(k: int, cache_len: int, num_groups: int | None, draft_probs: str | None, lookup: int | None,
                    row_budget: int | None, step_cost: str | None) -> tuple[Layout, list[str]]:
    """One step of the dynamic tree (``space.decoding.dynamic``, issue 31) drawn by its planner
    from given draft probabilities: the first step of a sequence (fresh running rates), after a
    step with k mask rows. Draft tokens are made up (``100 * depth + rank``), lookup tokens too
    (``9000 + depth``), so every node is distinct and its kind can be told.

    Args:
        k: masks per group.
        cache_len: tokens in the KV cache.
        num_groups: most mask groups (None: k+1).
        draft_probs: JSON (r, R), the top-R draft probabilities of each of the r <= k masks
            (None: a confident example, the top draft 0.8 at depth 1, x0.75 per depth).
        lookup: prompt-lookup tokens found (None: 0).
        row_budget: most rows per step (None: DecodeConfig's default).
        step_cost: JSON ``[[rows, cost], ...]`` (None: ``dynamic.DEFAULT_STEP_COST``).

    Returns:
        (the layout, padded to the plan's bucket; the lines describing the plan).

    Raises:
        ValueError: probabilities that are not JSON, not an (r <= k, 1 <= R <= 99) list, not in (0, 1],
            not in decreasing order within a mask, or summing above 1; a lookup count below 0, a
            row budget below 1, num_groups outside 1..k+1 or a bad step-cost curve.
    """
    import json
    import math

    from .decoding.config import DecodeConfig
    from .decoding.dynamic import DEFAULT_STEP_COST, AcceptanceStats, StepCost, plan_step

    def parse(flag: str, text: str):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag}: not JSON ({e.msg}): {text!r}") from None

    if draft_probs is None:
        probs = [[round(0.8 * 0.75 ** d, 2), 0.1] for d in range(k)]
    else:
        probs = parse("--draft-probs", draft_probs)
        shape = isinstance(probs, list) and 1 <= len(probs) <= k and all(isinstance(r, list) and 1 <= len(r) <= 99
                                                                         for r in probs)
        if not shape or not all(isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p)
                                and 0 < p <= 1 for r in probs for p in r):
            raise ValueError(f"--draft-probs must be a JSON list of 1..k = 1..{k} masks, each a list of its top 1..99 "
                             f"draft probabilities in (0, 1], e.g. [[0.8, 0.1], [0.6, 0.2]], got {draft_probs!r}")
        if any(b > a for r in probs for a, b in zip(r, r[1:])) or any(sum(r) > 1 + 1e-6 for r in probs):
            raise ValueError(f"--draft-probs: each mask's probabilities must be its top drafts in decreasing order, "
                             f"summing to at most 1, got {draft_probs!r}")
    lookup = 0 if lookup is None else lookup
    if lookup < 0:
        raise ValueError(f"--lookup must be >= 0, got {lookup}")
    budget = DecodeConfig().row_budget if row_budget is None else row_budget
    if budget < 1:
        raise ValueError(f"--row-budget must be >= 1, got {budget}")
    groups = k + 1 if num_groups is None else num_groups
    if not 1 <= groups <= k + 1:
        raise ValueError(f"num_groups must lie in 1..{k + 1}, got {groups}")
    try:
        cost = StepCost(DEFAULT_STEP_COST if step_cost is None else parse("--step-cost", step_cost))
    except ValueError as e:
        raise ValueError(f"--step-cost: {e}") from None
    ids = [[100 * (d + 1) + r for r in range(len(row))] for d, row in enumerate(probs)]
    found = [9000 + d + 1 for d in range(lookup)]
    stats = AcceptanceStats(k, lookup, cost)
    plan = plan_step(ids, probs, 0, found, stats, budget, k, groups, 1 << 20, k)
    lay = build_layout(cache_len, 1 + len(plan.tokens), [r + 1 for r in plan.group_rows], list(plan.group_len),
                       parents=list(plan.parents), pad_to=plan.rows)
    name = ["x"] + [f"c{i}" for i in range(1, len(plan.parents))]

    def count(n: int, noun: str) -> str:
        return f"{n} {noun}{'s' * (n != 1)}"

    lines = [f"dynamic step: k = {k}, row budget {budget}, up to {count(groups, 'group')}, "
             f"{count(lookup, 'lookup token')}, "
             f"draft probabilities {json.dumps(probs)}, step cost {[list(p) for p in cost.points]}",
             "node  depth  parent  kind             value"]
    for i, (token, value) in enumerate(zip(plan.tokens, plan.values), 1):
        kind = f"lookup {token - 9000}" if token > 9000 else f"mask {token // 100 - 1} rank {token % 100}"
        lines.append(f"{name[i]:<5} {int(lay.depth[i]):<6} {name[plan.parents[i]]:<7} {kind:<16} {value:.3f}")
    groups_text = ", ".join(f"G{g} on {name[r]} ({count(n, 'mask')})"
                            for g, (r, n) in enumerate(zip(plan.group_rows, plan.group_len)))
    lines.append(f"groups: {groups_text or 'none (the next step drafts by lookup alone)'}")
    pad = plan.rows - plan.used_rows  # the bucket's free rows beyond the candidates left
    lines.append(f"rows: 1 + {count(len(plan.tokens), 'node')} + {count(sum(plan.group_len), 'mask')} = "
                 f"{plan.used_rows} used, {plan.rows} in the block ({pad} pad)")
    return lay, lines


MAX_DRAWN = 512  # the longest cache, sample or span start space-layout draws


def main(argv: list[str] | None = None) -> str:
    """``space-layout``: print the decode or training layout for given sizes; returns what it printed.

    Raises:
        ValueError: k < 1, more candidates than k (each comes from one mask), sizes the layout
            cannot hold (groups, cache length, span starts) or a drawing cannot (past ``MAX_DRAWN``), dynamic-tree flags without
            ``--tree dynamic`` or out of range (see :func:`dynamic_example`), a flag of another mode,
            ``--num-candidates`` with a tree, several ``--spans`` to truncate.
    """
    p = argparse.ArgumentParser(prog="space-layout", description="Print a SPACE mask-token layout (DESIGN §3).")
    p.add_argument("--mode", choices=["decode", "train", "truncate"], default="decode")
    p.add_argument("--mask-num", "-k", type=int, default=2, help="masks per group (k)")
    p.add_argument("--cache-len", type=int, default=None, help="decode: tokens in the KV cache (n-1; default 2)")
    p.add_argument("--num-candidates", type=int, default=None, help="decode: candidates m (default k)")
    p.add_argument("--num-groups", type=int, default=None, help="decode: groups attached (default m+1; "
                   "dynamic: most groups, default k+1)")
    p.add_argument("--tree", default=None, help="decode: a token tree, JSON paths of ranks such as "
                   "'[[0],[1],[0,0]]' (groups on x and the top-1 chain), or 'dynamic': one step the dynamic "
                   "tree's planner chooses from --draft-probs, --lookup, --row-budget and --step-cost")
    p.add_argument("--draft-probs", default=None, help="dynamic: JSON (r, R), the top-R draft probabilities of "
                   "each of r <= k masks, e.g. '[[0.8,0.1],[0.6,0.2]]' for k = 2 (default: a confident example)")
    p.add_argument("--lookup", type=int, default=None, help="dynamic: prompt-lookup tokens found (default 0)")
    p.add_argument("--row-budget", type=int, default=None, help="dynamic: most rows per step, padding included "
                   "(default: DecodeConfig's)")
    p.add_argument("--step-cost", default=None, help="dynamic: step-cost curve, JSON [[rows, cost], ...] with rows "
                   "ascending from 1 (default: space.decoding.dynamic.DEFAULT_STEP_COST)")
    p.add_argument("--seq-len", type=int, default=None, help="train: sample length (default 6)")
    p.add_argument("--spans", type=int, nargs="+", default=None,
                   help="train: span starts s (default 2 4); truncate: one span start (default 2)")
    add_debug_flag(p)
    a = p.parse_args(argv)
    # flags another mode does not read: refused, not left unread
    for flag, value, modes in (("--cache-len", a.cache_len, ("decode",)), ("--seq-len", a.seq_len, ("train",)),
                               ("--spans", a.spans, ("train", "truncate")), ("--tree", a.tree, ("decode",)),
                               ("--num-candidates", a.num_candidates, ("decode",)),
                               ("--num-groups", a.num_groups, ("decode",))):
        if value is not None and a.mode not in modes:
            raise ValueError(f"{flag}: only for --mode {' or '.join(modes)}")
    if a.mode == "truncate" and a.spans is not None and len(a.spans) > 1:
        raise ValueError(f"--mode truncate draws one span start: give one --spans, got {a.spans}")
    a.spans = a.spans or ([2] if a.mode == "truncate" else [2, 4])
    a.cache_len, a.seq_len = 2 if a.cache_len is None else a.cache_len, 6 if a.seq_len is None else a.seq_len
    from .tokens import check_mask_num

    check_mask_num(a.mask_num)  # every mode: a k of thousands asked for terabytes
    # a drawing has a cell per row and column: 60,000 tokens asked for gigabytes
    for flag, value, low in (("--cache-len", a.cache_len, 0), ("--seq-len", a.seq_len, 1),
                             *(("--spans", s, 1) for s in a.spans)):
        if not low <= value <= MAX_DRAWN:
            raise ValueError(f"{flag} must lie in {low}..{MAX_DRAWN} (a drawing), got {value}")
    if a.num_groups is not None and not 1 <= a.num_groups <= a.mask_num + 1:
        raise ValueError(f"--num-groups must lie in 1..k + 1 = 1..{a.mask_num + 1}, got {a.num_groups}")
    if a.num_candidates is not None and a.tree not in (None, "chain"):
        raise ValueError("--num-candidates: the chain's (a --tree sets its own nodes)")
    dynamic = a.mode == "decode" and a.tree == "dynamic"
    given = [f for f, v in (("--draft-probs", a.draft_probs), ("--lookup", a.lookup), ("--row-budget", a.row_budget),
                            ("--step-cost", a.step_cost)) if v is not None]
    if given and not dynamic:
        raise ValueError(f"{', '.join(given)}: only for --mode decode --tree dynamic")
    lines = []
    if dynamic:
        lay, lines = dynamic_example(a.mask_num, a.cache_len, a.num_groups, a.draft_probs, a.lookup, a.row_budget,
                                     a.step_cost)
    elif a.mode == "decode" and a.tree not in (None, "chain"):
        from .decoding.tree import chain_depth, group_rows, parse_tree
        tree = parse_tree(a.tree, a.mask_num)
        groups = min(a.num_groups or a.mask_num + 1, chain_depth(tree) + 1)  # num_groups None: all
        # the decoder's groups: on x_{n-1} and the top-1 chain, wherever breadth-first order puts it
        lay = build_layout(a.cache_len, 1 + len(tree), [r + 1 for r in group_rows(tree, groups)], a.mask_num,
                           parents=tree_parents(tree))
    elif a.mode == "decode":
        m = a.mask_num if a.num_candidates is None else a.num_candidates
        if not 0 <= m <= a.mask_num:  # candidates are the drafts of the k masks of one group
            raise ValueError(f"--num-candidates must lie in 0..k = 0..{a.mask_num}, got {m}")
        lay = decode_layout(a.cache_len, m, m + 1 if a.num_groups is None else a.num_groups, a.mask_num)
    elif a.mode == "train":
        lay = train_layout(a.seq_len, a.spans, a.mask_num)
    else:
        lay = truncate_layout(a.spans[0], a.mask_num)
    text = "\n".join([*lines, render(lay)])
    print(text)
    return text


cli = console("space-layout", main)

if __name__ == "__main__":
    cli()
