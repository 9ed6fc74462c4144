"""Per-generation bookkeeping shared by the AR loop and the SPACE decoder (DESIGN §6)."""
from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


class StopDecoding(Exception):
    """Raised by an ``on_tokens`` callback to end generation after the first ``keep`` tokens of
    the step it was given (what HF stopping criteria such as stop strings need; ``space.hf``).

    Args:
        keep: how many of the step's tokens to keep, 0..len(tokens); the rest are dropped.
    """

    def __init__(self, keep: int):
        super().__init__(keep)
        self.keep = keep


@dataclass
class DecodeResult:
    """Tokens and statistics of one generation (batch size 1).

    Attributes:
        prompt_len: tokens in the prompt.
        stop_token_ids: the ids that end the generation, as ints (given as one int, any iterable of
            ints, a tensor, or None for none). TypeError for text or ids that are not integers.
        new_ids: generated token ids (EOS included when it stopped the generation).
        accept_lengths: per SPACE step, candidates accepted (0..m), bonus not counted; empty for AR.
        step_candidates: per SPACE step, the depth of the candidates it verified (m for a chain;
            0 on a turn's first step, and after an accept that left no mask group to draft from);
            empty for AR.
        step_tokens: per step (one target forward pass that emits tokens), tokens emitted (1..k+1).
        step_times: per step, wall time in s; ``step_times[0]`` includes the prefill.
        step_rows: per SPACE step, the rows of its block (x_{n-1}, nodes, masks, padding); empty for AR.
        step_padding: per SPACE step, how many of ``step_rows`` are padding (a block rounded up to a
            bucket size); empty for AR.
        step_host: per SPACE step, seconds outside the model's forward and LM head: the planner,
            the layout, verification, cache compaction, drafting and lookup (the prefill not
            included). On a CPU the step's host work; on a GPU it also holds the wait for the
            device (the step's one read). Empty for AR.
        step_plan: per SPACE step, seconds of the planner and the block's layout (part of step_host).
        step_sources: per SPACE step, where each accepted token came from, a letter each: ``m`` a
            mask draft, ``l`` a prompt-lookup token, ``d`` a datastore's, ``b`` the masks and a lookup
            (``decoder.provenance``).
        step_offered: per SPACE step, (deepest candidate from the masks, deepest from lookup, the
            datastore's included).
        stop_reason: "eos", "length", or "stop" (``on_tokens`` raised :class:`StopDecoding`).
    """

    prompt_len: int
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    on_tokens: Callable[[list[int]], None] | None = None
    new_ids: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    step_candidates: list[int] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    step_rows: list[int] = field(default_factory=list)
    step_padding: list[int] = field(default_factory=list)
    step_host: list[float] = field(default_factory=list)
    step_plan: list[float] = field(default_factory=list)
    step_sources: list[str] = field(default_factory=list)
    step_offered: list[tuple[int, int]] = field(default_factory=list)
    stop_reason: str | None = None

    def __post_init__(self):
        # as ints: a tensor's elements hash by identity, so a stop id given as a tensor never matched
        ids = () if self.stop_token_ids is None else self.stop_token_ids  # None: no stop id, as HF's eos_token_id
        if isinstance(ids, numbers.Integral):  # one id, as HF's eos_token_id takes it (was a TypeError)
            ids = [ids]
        if isinstance(ids, (str, bytes)):  # read one character at a time: "67" stopped at token 6
            raise TypeError(f"stop_token_ids must be token ids (ints), got the text {ids!r}")
        ids = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else list(ids)
        # one-element tensors and numpy arrays ([tensor(5)], [np.array(5)]) as their value
        ids = [t.item() if not isinstance(t, numbers.Number) and hasattr(t, "item") and getattr(t, "shape", None)
               in ((), (1,)) else t for t in ids]
        wrong = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if wrong:  # int() took 6.7 as token 6
            raise TypeError(f"stop_token_ids must be token ids (ints), got {wrong[:3]!r}")
        self.stop_token_ids = frozenset(int(t) for t in ids)

    def emit(self, tokens: list[int], seconds: float, accepted: int | None = None,
             candidates: int | None = None, rows: int | None = None, host: float | None = None,
             plan: float | None = None, provenance: tuple[str, int, int] | None = None, padding: int = 0) -> bool:
        """Record one step's tokens, cut at the first stop token and at max_new_tokens.

        Args:
            tokens: the step's tokens (accepted candidates and the bonus).
            seconds: the step's wall time in s.
            accepted, candidates, rows: SPACE steps only: a, the depth of the candidates verified
                (m for a chain), and the block's rows; ``padding``: how many of them are padding.
            host, plan: SPACE steps only: seconds outside the model, and of the planner + layout.
            provenance: SPACE steps only: (sources of the accepted tokens, deepest mask candidate,
                deepest lookup candidate), as ``decoder.provenance`` gives them.

        Returns:
            True when generation is finished.
        """
        room = self.max_new_tokens - len(self.new_ids)
        kept = tokens[:room]
        for i, t in enumerate(kept):
            if t in self.stop_token_ids:
                kept, self.stop_reason = kept[: i + 1], "eos"
                break
        if self.stop_reason is None and len(self.new_ids) + len(kept) >= self.max_new_tokens:
            self.stop_reason = "length"
        self.new_ids.extend(kept)
        self.step_tokens.append(len(kept))
        self.step_times.append(seconds)
        if accepted is not None:
            self.accept_lengths.append(accepted)
            self.step_candidates.append(candidates)
        if rows is not None:
            self.step_rows.append(rows)
            self.step_padding.append(padding)
        if host is not None:
            self.step_host.append(host)
            self.step_plan.append(plan or 0.0)
        if provenance is not None:
            self.step_sources.append(provenance[0])
            self.step_offered.append(provenance[1:])
        if self.on_tokens is not None and kept:
            try:
                self.on_tokens(kept)
            except StopDecoding as stop:  # the callback ended generation inside this step
                drop = len(kept) - max(0, min(stop.keep, len(kept)))
                if drop:
                    del self.new_ids[-drop:]
                    self.step_tokens[-1] -= drop
                if drop or self.stop_reason is None:
                    self.stop_reason = "stop"
        return self.stop_reason is not None

    @property
    def wall_time(self) -> float:
        """Total generation time in s (prefill included)."""
        return sum(self.step_times)

    @property
    def num_steps(self) -> int:
        """Target forward passes that emitted tokens (the prefill of SPACE emits none)."""
        return len(self.step_tokens)

    @property
    def tokens_per_step(self) -> float:
        """Mean accepted tokens per step (MAT), bonus token and first step counted."""
        return len(self.new_ids) / max(self.num_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_ids) / self.wall_time if self.step_times and self.wall_time > 0 else 0.0


def clock(device: torch.device) -> float:
    """A monotonic time in s that counts the device's queued work (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_prompt(input_ids: torch.Tensor | list[int], max_new_tokens: int, context: int,
                 vocab: int | None = None) -> torch.Tensor:
    """Validate a batch-1 prompt; returns (seq,) long ids.

    Args:
        vocab: the model's vocabulary size (its LM head's rows): every id must lie in [0, vocab).

    Raises:
        ValueError: batch > 1, ids not integers, not of shape (seq,) or (1, seq), empty prompt,
            max_new_tokens not an integer >= 1, an id outside
            the vocabulary (an embedding's IndexError on a CPU, a device-side assert that breaks
            the process's CUDA state on a GPU), or prompt + max_new_tokens over the context (the
            message names both lengths).
    """
    ids = torch.as_tensor(input_ids)
    if ids.numel() == 0:  # before the dtype: [] is a float tensor
        raise ValueError("empty prompt: pass at least one token")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:  # a cast to long truncated 1.9 to 1
        raise ValueError(f"prompt ids must be integers, got {ids.dtype}")
    ids = ids.long()
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"batch size {ids.shape[0]} is not supported: pass one prompt (batch size 1)")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"prompt ids must be (seq,) or (1, seq), got shape {tuple(ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if vocab is not None:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"token id {low if low < 0 else high} is outside the model's vocabulary [0, {vocab})")
    need = ids.numel() + max_new_tokens
    if need > context:
        raise ValueError(f"prompt ({ids.numel()} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                         f"the model context {context}; shorten the prompt or lower max_new_tokens")
    return ids


@contextmanager
def model_time(*modules: torch.nn.Module) -> Iterator[list[float]]:
    """Seconds spent inside ``modules``' forward calls while the block runs, accumulated in the
    yielded one-item list (read it before and after a step for that step's share). A call inside
    another of them counts once, in the outer one (the input embedding a sampler head also calls
    alone runs inside the trunk's forward too). Forward hooks, removed on exit; the list is the
    caller's, no module keeps it."""
    spent, starts = [0.0], []

    def pre(*_):
        starts.append(time.perf_counter())

    def post(*_):
        start = starts.pop()
        if not starts:  # the outermost call: the inner ones lie inside its time
            spent[0] += time.perf_counter() - start

    handles = [h for m in modules for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        yield spent
    finally:
        for h in handles:
            h.remove()
