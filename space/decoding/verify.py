"""Verification of candidates: pure functions, no model, no state (DESIGN §3.4).

Convention (as in the paper and HF): ``p`` is the TARGET distribution (the model's verification
rows), ``q`` the DRAFT distribution the candidates were drawn from (mask rows of the previous step).
The sampling functions stay on the tensors' device and return tensors, so a decode step can move
everything the host needs in one copy; greedy tree verification walks the tree on the host, from
the argmaxes that copy brought.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_rejection(p: torch.Tensor, q: torch.Tensor, candidates: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    Accept c_i with probability min(1, p_{i-1}(c_i) / q_i(c_i)); at the first rejection draw the
    bonus from norm(max(0, p_{i-1} - q_i)); if all m are accepted draw it from p_m. The emitted
    tokens are then distributed exactly as sampling from p one token at a time: the first token
    is c_1 with probability q(c) min(1, p(c)/q(c)) = min(q(c), p(c)), else drawn from the residual
    with total mass 1 - Σ min(p, q), which adds max(0, p(c) - q(c)); together p(c). Given c_1
    accepted, the same argument holds for c_2 under p_1, and so on.

    Args:
        p: (..., m+1, vocab) target probabilities; row i is the distribution of the token after c_i.
        q: (..., m, vocab) draft probabilities; row i-1 is the distribution c_i was drawn from.
        candidates: (..., m) drafted ids.
        generator: a torch.Generator on the tensors' device, for the uniforms and the bonus draw.

    Returns:
        (a, bonus): long tensors of shape (...): accepted count 0..m and the bonus token id.
    """
    m, vocab = candidates.shape[-1], p.shape[-1]
    u = torch.rand(candidates.shape, generator=generator, device=p.device)
    idx = candidates[..., None]
    ratio = p[..., :m, :].gather(-1, idx)[..., 0] / q.gather(-1, idx)[..., 0]  # q(c_i) > 0: drawn from q
    a = (u < ratio).long().cumprod(-1).sum(-1)  # (...,) accepted before the first rejection
    residual = (p[..., :m, :] - q).clamp_min(0)
    # p == q up to rounding leaves no residual mass: then any draw from p is exact
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[..., :m, :])
    bonus_dist = torch.cat([residual, p[..., m:, :]], dim=-2)  # (..., m+1, vocab): row a is used
    row = bonus_dist.gather(-2, a[..., None, None].expand(*a.shape, 1, vocab))[..., 0, :]
    bonus = torch.multinomial(row.reshape(-1, vocab), 1, generator=generator).view(a.shape)
    return a, bonus


def verify_tree_greedy(pred: list[int], tokens: list[int], parents: Sequence[int], depth: Sequence[int]) -> int:
    """Greedy verification of a token tree (issue #14), on the host: the deepest node whose whole
    path equals the target's argmax chain.

    A node is right when its token is the argmax of its parent's row and its parent is right;
    all right nodes of one depth spell the same tokens, so any deepest one gives the AR output
    (the first in block order is taken). The argmaxes come to the host in the step's one copy,
    so this walk of at most a few dozen nodes replaces a dozen small device ops (issue 43).

    Args:
        pred: (1+N,) argmax of the rows of x_{n-1} and the N nodes; row i scores i's children.
        tokens: (N,) node tokens.
        parents: (1+N,) parent row of each row (-1 for x_{n-1}); parents come first.
        depth: (1+N,) depth of each row (x_{n-1}: 0).

    Returns:
        The accepted row (0 = none accepted); the bonus (auto-correct) token is ``pred[row]``.
    """
    right = [True] + [False] * len(tokens)
    best = 0
    for r in range(1, len(parents)):
        p = parents[r]
        if right[p] and tokens[r - 1] == pred[p]:
            right[r] = True
            if depth[r] > depth[best]:
                best = r
    return best


def verify_tree_sampling(p: torch.Tensor, tokens: list[int], children: list[list[int]],
                         generator: torch.Generator | None = None) -> tuple[int, torch.Tensor]:
    """Exact sampling over a tree of deterministic candidates (SpecInfer-style, q one-hot).

    From the root, the children of the current row are tried in order: child c is accepted with
    probability p'(c), where p' is the row's target distribution with every token rejected so far
    at this row set to 0 and renormalized; an accepted child becomes the current row. When no child
    is accepted the bonus is drawn from p'. Why this is exact: at one row, the first child is
    emitted with probability p(c_1); the second with (1 - p(c_1)) p(c_2) / (1 - p(c_1)) = p(c_2); a
    residual token t with (1 - sum_i p(c_i)) p(t) / (1 - sum_i p(c_i)) = p(t); so the row's token
    is distributed as p (a token is tried once per row: siblings that repeat it are one candidate,
    whose children are all of theirs). Given the token, the next one comes from the child's row, the
    target distribution after it: by induction the emitted sequence is distributed as sampling from
    the target one token at a time.

    Args:
        p: (1+N, vocab) target probabilities of x_{n-1}'s row and each node's row.
        tokens: (N,) node tokens, on the host.
        children: per row, its child rows in the order they are tried.
        generator: for the uniforms and the bonus draw (on p's device).

    Returns:
        (best, bonus): the accepted row (0 = none; of repeated siblings, their first, or a node
        under any of them) and the bonus token, a 0-d long tensor. The walk reads p at the node
        tokens and the uniforms with one host copy.
    """
    # Siblings that repeat a token (a lookup branch whose first token is the top mask draft) are one
    # candidate: their rows see the same tokens, so the walk goes over classes of (the parent's class,
    # token), a class's children being all its members' (the first member's row scores them). Walked
    # over the first member alone, a repeated sibling's deeper candidates were never tried.
    klass, kids, first_of, parent = [0] * (len(tokens) + 1), {0: []}, {}, [0] * (len(tokens) + 1)
    todo = [0]
    while todo:  # parents before children, each row's children in the order given
        r = todo.pop()
        for c in children[r]:
            parent[c] = r
            rep = first_of.setdefault((klass[r], tokens[c - 1]), c)
            klass[c] = rep
            if rep == c:
                kids[klass[r]].append(c)
                kids[c] = []
        todo.extend(reversed(children[r]))
    reps = [c for c in range(1, len(tokens) + 1) if klass[c] == c]
    if reps:
        idx = torch.tensor([tokens[c - 1] for c in reps], device=p.device)
        rows = torch.tensor([klass[parent[c]] for c in reps], device=p.device)
        u = torch.rand(len(reps), generator=generator, device=p.device)
        p_tok, u = (dict(zip(reps, v)) for v in torch.stack([p[rows, idx].double(), u.double()]).tolist())  # one host copy
    row, rejected, mass = 0, set(), 1.0
    while True:
        for c in kids[row]:
            t = tokens[c - 1]
            if u[c] * mass < p_tok[c]:  # u < p(t) / (1 - p(rejected))
                row, rejected, mass = c, set(), 1.0
                break
            rejected.add(t)
            mass -= p_tok[c]
        else:
            break
    dist = p[row].clone()
    if rejected:
        dist[list(rejected)] = 0
        if not dist.sum() > 0:  # all mass on rejected tokens up to rounding: p itself is then exact
            dist = p[row]
    return row, torch.multinomial(dist, 1, generator=generator)[0]
