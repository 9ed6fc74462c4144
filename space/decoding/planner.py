"""Step planners: the one seam between the SPACE decoder and what a step verifies (issue 44).

HF's assisted generation asks a ``CandidateGenerator`` for candidates and then tells it how many
were accepted. A SPACE step also feeds mask groups, so its planner proposes the whole block
``[x_{n-1}] [nodes] [groups] [padding]`` from the drafts at hand and the prompt-lookup
continuation, and learns from each step's outcome. :class:`SpaceDecoder` calls only
:meth:`StepPlanner.propose` and :meth:`StepPlanner.observe`; it makes a fresh planner per
generation (``SpaceDecoder.planner``), and ``SpaceDecoder.generate(..., planner=...)`` takes any
other, e.g. one that proposes chosen drafts in a test.

Exactness does not depend on the planner: any block of nodes whose parents come first, within the
context, is verified exactly (greedy, and sampled trees), so a planner decides only how fast
decoding is. A sampled chain verifies the drafts it drew by the p/q rule and takes no planner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .dynamic import AcceptanceStats, plan_step

# Drafts, SpaceDecoder and StepLayout in the annotations are ``space.decoding.decoder``'s, which
# imports this module: annotations stay strings (``from __future__ import annotations``), so this
# module imports nothing back


@dataclass(frozen=True)
class Proposal:
    """One step's block, as a planner proposes it.

    Attributes:
        layout: the block's layout (``SpaceDecoder.block_layout`` or ``static_block`` builds it).
        tokens: (N,) node tokens in block order, on the model's device.
        sources: (N,) each node's sources (``dynamic.MASK`` / ``LOOKUP`` / ``STORE`` bits), for the records.
    """

    layout: StepLayout
    tokens: torch.Tensor
    sources: tuple[int, ...]


@dataclass(frozen=True)
class StepOutcome:
    """What a step did, as its planner is told.

    Attributes:
        emitted: the accepted tokens then the bonus token (before any cut at max_new_tokens).
        path: the accepted rows of the block, in depth order.
        layout: the block that was verified.
    """

    emitted: list[int]
    path: list[int]
    layout: StepLayout


class StepPlanner(Protocol):
    """Proposes each step's block and learns from its outcome (one generation, batch size 1)."""

    def propose(self, drafts: Drafts, found: list[list[int]], cache_len: int) -> Proposal:
        """The block of the next step.

        Args:
            drafts: the previous step's mask drafts (none on the first step, or when no group was
                on the accepted path).
            found: prompt lookup's continuations of the text so far, prompt lookup decoding's
                first (``PromptLookup.continuations``, its ``stored`` the datastore's; [] when none).
            cache_len: tokens in the KV cache (x_0..x_{n-2}): rows may reach depth
                ``context - cache_len - 1``.
        """
        ...

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from the step just verified."""
        ...


class StaticPlanner:
    """The configured token tree (or the chain) pruned to the drafts at hand, then a lookup branch;
    groups on x_{n-1} and the top-1 chain (``SpaceDecoder.static_block``). Learns nothing."""

    def __init__(self, decoder: SpaceDecoder):
        self.decoder = decoder

    def propose(self, drafts: Drafts, found: list[list[int]], cache_len: int) -> Proposal:
        return Proposal(*self.decoder.static_block(cache_len, drafts, found[0] if found else []))

    def observe(self, outcome: StepOutcome) -> None:
        pass


class DynamicPlanner:
    """The dynamic tree (issue 31, ``space.decoding.dynamic``): each step's nodes, groups and group
    lengths priced from the drafts' probabilities, this sequence's running rates and the step-cost
    curve. Copies the drafts' top-R ids and probabilities to the host once per step."""

    def __init__(self, decoder: SpaceDecoder, end: int | None = None):
        cfg = decoder.config
        self.decoder = decoder
        # the sequence length the generation may reach: at its last steps a node past what it can
        # still emit is a row that never pays (nor are masks drafted for a step that will not come)
        self.end = end
        self.stats = AcceptanceStats(cfg.mask_num, cfg.lookup_tokens, decoder.cost)
        self.mask_rows_before = cfg.mask_num
        self.last: tuple | None = None  # what the last proposal was made from, for observe()

    def propose(self, drafts: Drafts, found: list[list[int]], cache_len: int) -> Proposal:
        dec, cfg = self.decoder, self.decoder.config
        ids, probs = torch.stack([drafts.ids.double(), drafts.probs.double()]).tolist()  # one copy
        ids = [[int(t) for t in row] for row in ids]
        first, others = (found[0], found[1:]) if found else ([], [])
        stored = getattr(found, "stored", 0)  # a plain list (a test's planner) holds none of a datastore's
        # depth d sits at position cache_len + d < context; the step emits its d accepted tokens and a
        # bonus, and the sequence (cache_len + 1 tokens now) ends at self.end. Never below 1 while the
        # context allows: a 1-row block is a shape of its own for a compiled trunk (a graph of minutes)
        room = dec.room(cache_len)
        if self.end is not None:
            room = max(min(room, self.end - cache_len - 2), min(room, 1))
        plan = plan_step(ids, probs, drafts.offset, first, self.stats, cfg.row_budget, cfg.mask_num, cfg.groups,
                         room, self.mask_rows_before, chained=dec.sampler is not None,
                         others=others, stored=stored)
        self.last = (ids, [p[0] for p in probs], drafts.offset, first, others, stored)
        lay, tokens = dec.block_layout(plan.parents, plan.group_rows, plan.group_len, plan.rows, plan.tokens)
        return Proposal(lay, tokens, plan.sources)

    def observe(self, outcome: StepOutcome) -> None:
        ids, top_probs, offset, found, others, stored = self.last
        self.stats.observe(outcome.emitted, ids, top_probs, offset, found, outcome.layout.rows, others, stored)
        self.mask_rows_before = sum(outcome.layout.group_len)
