"""Count the ops a decoding step dispatches, a hardware-free proxy for its kernel launches (issue 58).

On a GPU a small model's eager step is launch-bound: the host spends ~10 us queueing each kernel
and the GPU finishes it sooner, so a step costs about what its op count says, whatever its rows.
:class:`OpCounter` is a ``TorchDispatchMode``: it sees every aten op as dispatched (after autograd,
a composite op such as ``linear`` or ``scaled_dot_product_attention`` as one op, which is one
kernel, or one library call, on CUDA) and counts those that would launch a kernel:

* an op that writes a tensor (in-place or ``out=``: ``addmm_``, ``index_copy_``, ``copy_``);
* an op that returns a tensor with storage of its own (``mm``, ``cat``, ``to`` a new dtype);
* a host read (``_local_scalar_dense``: ``item``), a device-to-host copy on CUDA. ``tolist`` of a
  CPU tensor dispatches nothing and is not counted (on CUDA it is a ``_to_copy``, counted): the
  counts made on the CPU leave out a step's host copies (AR's one, SPACE's one or two:
  verification's, and the dynamic tree's drafts for its planner);
* a non-blocking ``Tensor.to``: on the CPU it returns its input before any dispatch, on CUDA it
  is the host-to-device copy of ``space.decoding.decoder.upload``, so a ``TorchFunctionMode`` the
  counter enters with itself counts each one that dispatched nothing (a copying one is counted
  once, by the dispatch mode, as ``_to_copy``; pinning the host buffer first launches nothing).

Views (``slice``, ``transpose``, ``view``, a ``to`` that changes nothing) and allocations
(``empty``) launch nothing and are not counted. Counts are deterministic for a given input and
model structure and do not depend on the model's width, so a narrow model with a real model's
depth and attention layout counts what the real one counts per layer.

Per step: :meth:`OpCounter.mark` is the decoders' ``on_tokens`` callback, called once per step
after its tokens are known; :meth:`OpCounter.per_step` averages the ops between the first mark
and the last (the first step, which holds the prompt's forward, is left out), and
:meth:`OpCounter.per_step_by_op` splits them by op. :meth:`OpCounter.pause` and
:meth:`OpCounter.resume` leave a region out: a captured step's trunk (``space.decoding.graphs``),
one graph replay on a GPU, runs eagerly on the CPU, so what a captured step launches besides it
is counted with the trunk's forward hooks pausing the counter.

:func:`cuda_attention` runs the attention path a CUDA device takes (``space.decoding.backends``:
grouped query heads folded into the batch, masks in aligned rows) on the CPU, so that its ops
can be counted here.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import backends

aten = torch.ops.aten
# allocations, and the host-side copy into pinned memory that precedes a CUDA upload
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
             aten.new_empty.default, aten.new_empty_strided.default, aten.lift_fresh.default,
             aten._pin_memory.default}


def _storages(values) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(values)[0]
            if isinstance(t, torch.Tensor) and t.numel()}


class _Uploads(TorchFunctionMode):
    """Counts non-blocking ``Tensor.to`` calls into an :class:`OpCounter` (see the module doc)."""

    def __init__(self, counter: "OpCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # a .to that returned its input dispatched nothing: count it here, once; a copying one
        # (another device or dtype) reached the dispatch mode, which counted its copy already
        if func is torch.Tensor.to and kwargs.get("non_blocking", False) and out is args[0]:
            self.counter.count("upload")
        return out


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: generate(..., on_tokens=ops.mark)`` then ``ops.per_step()``.

    Attributes:
        total: ops counted so far.
        by_op: ``{op name: count}`` so far, to see where a step's ops come from.
        marks: ``total`` at each :meth:`mark`.
    """

    def __init__(self):
        super().__init__()
        self.total, self.by_op, self.marks = 0, Counter(), []
        self._by_op_at_marks: tuple[Counter, Counter] | None = None  # by_op at the first mark and the last
        self._paused = 0
        self._uploads = _Uploads(self)

    def __enter__(self):
        self._uploads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._uploads.__exit__(*exc)

    def count(self, name: str) -> None:
        if self._paused:
            return
        self.total += 1
        self.by_op[name] += 1

    def pause(self) -> None:
        """Count nothing until the matching :meth:`resume` (pairs nest)."""
        self._paused += 1

    def resume(self) -> None:
        """End the latest :meth:`pause`.

        Raises:
            ValueError: no pause to end.
        """
        if not self._paused:
            raise ValueError("resume without a pause")
        self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._launches(func, args, kwargs, out):
            self.count(str(func.overloadpacket.__name__))
        return out

    @staticmethod
    def _launches(func, args, kwargs, out) -> bool:
        if func in NO_KERNEL:
            return False
        if func is aten._local_scalar_dense.default or func._schema.is_mutable:
            return True
        return bool(_storages(out) - _storages((args, kwargs)))

    def mark(self, _tokens=None) -> None:
        """Record the count at the end of a step (signature of the decoders' ``on_tokens``)."""
        now = Counter(self.by_op)
        self._by_op_at_marks = (self._by_op_at_marks[0] if self.marks else now, now)
        self.marks.append(self.total)

    def per_step(self) -> float:
        """Mean ops per step between the first and the last mark.

        Raises:
            ValueError: fewer than two marks (no whole step after the first).
        """
        if len(self.marks) < 2:
            raise ValueError(f"need at least 2 steps to count ops per step, got {len(self.marks)}")
        return (self.marks[-1] - self.marks[0]) / (len(self.marks) - 1)

    def per_step_by_op(self) -> dict[str, float]:
        """Mean ops per step between the first mark and the last, by op name, most first.

        Raises:
            ValueError: fewer than two marks.
        """
        steps = len(self.marks) - 1
        if steps < 1:
            raise ValueError(f"need at least 2 steps to count ops per step, got {len(self.marks)}")
        first, last = self._by_op_at_marks
        return {name: n / steps for name, n in (last - first).most_common()}


@contextmanager
def cuda_attention() -> Iterator[None]:
    """Inside it, the CPU takes the attention path CUDA takes: off ``backends.GQA_WITH_MASK`` (the
    grouped query heads folded into the batch) and with CUDA's ``backends.MASK_ALIGN`` (each step's
    mask in aligned rows). Both are restored on exit. Pair it with CUDA's one-call norms
    (``space.rms_norm.swap_rms_norms(model, exact=False)``) to count the trunk CUDA loads."""
    saved = backends.GQA_WITH_MASK, backends.MASK_ALIGN
    cuda = tuple(d for d in saved[0] if d != "cpu"), {**saved[1], "cpu": saved[1].get("cuda", 1)}
    try:
        backends.GQA_WITH_MASK, backends.MASK_ALIGN = cuda
        yield
    finally:
        backends.GQA_WITH_MASK, backends.MASK_ALIGN = saved
