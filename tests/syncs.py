"""Count the host syncs a CUDA run would make, on the CPU (issue 43's method).

On a GPU every read of a device tensor by the host (``.item()``, ``.tolist()``, ``bool()`` ...),
every op whose output shape depends on the data (``nonzero``, boolean indexing ...), every index by
a 0-d device tensor and every host-to-device copy of host data makes the host wait for the
device. On the CPU none of these cost anything, so a step written there can hide dozens of them.

:class:`SyncCounter` is a ``TorchFunctionMode`` that tells "device" tensors from host ones by
their origin, whatever their real device: the model's parameters and buffers are device tensors,
so is every tensor a factory makes with an explicit ``device=`` and every output of an op with a
device tensor among its inputs. Tensors made without ``device=`` (Python lists, host bookkeeping)
are host tensors. It then counts, by kind:

* ``read``: ``item``, ``tolist``, ``cpu``, ``numpy``, ``bool``/``int``/``float``/``index`` of a
  device tensor;
* ``shape``: data-dependent shapes (``nonzero``, ``masked_select``, ``unique``, one-argument
  ``where``, indexing by a boolean device tensor);
* ``index``: indexing by a 0-d device tensor (PyTorch reads it as a Python integer);
* ``upload``: host data copied to the device (``torch.tensor(data, device=...)``, ``as_tensor``,
  ``new_tensor``, ``.to(device)`` or ``copy_`` of a host tensor, a device tensor indexed by a
  Python list or a host tensor, host data written into a device tensor).

``.to(device, non_blocking=True)`` of a host tensor is not counted: the copy is queued on the
stream and the host goes on (``space.decoding.decoder.upload`` pins the tensor first on CUDA, as a
non-blocking copy wants); it is tallied in ``queued``.

Checked against CUDA's own count (``torch.cuda.set_sync_debug_mode``) on an H200, issue 45: the
marginal syncs per step of the chain, static tree, lookup and dynamic layouts agree (a
``logits[:, list] = -inf`` that this counter missed before was 1-2 of them per step).

``torch.cuda.synchronize`` is not a torch function: code that calls it on CUDA must say so itself.
"""
from __future__ import annotations

import traceback
import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
SHAPES = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "nonzero_static"}
UPLOADS = {"tensor", "as_tensor", "from_numpy"}


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter(model) as syncs: ...`` then ``syncs.total`` / ``syncs.kinds``."""

    def __init__(self, *device_modules: torch.nn.Module, holders=()):
        """``holders``: objects whose tensors, made before counting began, live on the device
        (e.g. a warm decoder's cached layouts); their attributes are searched a few levels deep."""
        super().__init__()
        self._device: dict[int, weakref.ref] = {}  # id -> the tensor (ids are reused: check identity)
        for module in device_modules:
            for t in [*module.parameters(), *module.buffers()]:
                self._mark(t)
        for holder in holders:
            self._mark_held(holder, depth=4)
        self.kinds: Counter[str] = Counter()
        self.where: Counter[str] = Counter()
        self.queued = 0  # non-blocking uploads: not syncs

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def is_device(self, t) -> bool:
        ref = self._device.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def _mark(self, t: torch.Tensor) -> None:
        self._device[id(t)] = weakref.ref(t)

    def _mark_held(self, obj, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            self._mark(obj)
        elif depth == 0 or isinstance(obj, (str, bytes, int, float, torch.nn.Module)):
            return
        elif isinstance(obj, dict):
            for v in obj.values():
                self._mark_held(v, depth - 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                self._mark_held(v, depth - 1)
        elif hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                self._mark_held(v, depth - 1)

    def _count(self, kind: str, name: str) -> None:
        self.kinds[kind] += 1
        self.where[f"{kind}:{name} at {_caller()}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(self.is_device(t) for t in inputs)
        explicit = "device" in kwargs and kwargs["device"] is not None
        if name in READS and on_device:
            self._count("read", name)
        elif name in SHAPES and on_device:
            self._count("shape", name)
        elif name == "where" and len(args) == 1 and on_device:
            self._count("shape", name)
        elif name in ("__getitem__", "__setitem__") and len(args) >= 2:
            indices = args[1] if isinstance(args[1], tuple) else (args[1],)
            for index in indices:
                if self.is_device(index) and index.dtype == torch.bool:
                    self._count("shape", "bool index")
                elif self.is_device(index) and index.dim() == 0:
                    self._count("index", "0-d index")
                elif self.is_device(args[0]) and (isinstance(index, list) or isinstance(index, torch.Tensor)
                                                  and not self.is_device(index) and index.dim() > 0):
                    self._count("upload", f"{name[2:-2]} by a host index")  # the index goes up first
            if name == "__setitem__" and self.is_device(args[0]) and _setitem_uploads(self, args[1], args[2]):
                self._count("upload", "setitem of a host value")
        elif name == "copy_" and self.is_device(args[0]) and _host_data(self, args[1]):
            self._count("upload", "copy_")
        elif name == "new_tensor" and self.is_device(args[0]):
            self._count("upload", name)
        elif name in UPLOADS and explicit and not (args and self.is_device(args[0])):
            self._count("upload", name)
        elif name == "to" and not on_device and _names_device(args[1:], kwargs):
            if kwargs.get("non_blocking"):
                self.queued += 1
            else:
                self._count("upload", "to")
        out = func(*args, **kwargs)
        if on_device or explicit or name == "to" and _names_device(args[1:], kwargs):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module: where the sync was asked for."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("syncs.py"):
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"
    return "?"


def _host_data(counter: SyncCounter, value) -> bool:
    """Host data that a write into a device tensor must copy up (Python scalars travel as kernel
    arguments, and so do 0-d host tensors)."""
    if isinstance(value, torch.Tensor):
        return not counter.is_device(value) and value.dim() > 0
    return isinstance(value, (list, tuple))


def _setitem_uploads(counter: SyncCounter, index, value) -> bool:
    """``t[index] = value`` on a CUDA tensor: host data goes up, and with an advanced index (a
    tensor or a list) so does a Python scalar (PyTorch copies it into a 0-d device tensor first;
    ``index_fill_`` / ``masked_fill_`` pass it as a kernel argument). The scalar case was seen by
    CUDA's sync debug mode (issue 45); a scalar written into a plain slice is not counted."""
    advanced = any(isinstance(i, (torch.Tensor, list)) for i in (index if isinstance(index, tuple) else (index,)))
    return _host_data(counter, value) or advanced and isinstance(value, (int, float, bool))


def _names_device(args, kwargs) -> bool:
    """A ``.to(...)`` call that moves to a device (not just a dtype change)."""
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) or isinstance(a, torch.Tensor) for a in args)
