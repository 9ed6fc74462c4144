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
  ``.to(device)`` of a host tensor).

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

    def __init__(self, *device_modules: torch.nn.Module):
        super().__init__()
        self._device: dict[int, weakref.ref] = {}  # id -> the tensor (ids are reused: check identity)
        for module in device_modules:
            for t in [*module.parameters(), *module.buffers()]:
                self._mark(t)
        self.kinds: Counter[str] = Counter()
        self.where: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def is_device(self, t) -> bool:
        ref = self._device.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def _mark(self, t: torch.Tensor) -> None:
        self._device[id(t)] = weakref.ref(t)

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
        elif name == "__getitem__" and len(args) == 2:
            for index in tree_flatten(args[1])[0]:
                if self.is_device(index) and index.dtype == torch.bool:
                    self._count("shape", "bool index")
                elif self.is_device(index) and index.dim() == 0:
                    self._count("index", "0-d index")
        elif name in UPLOADS and explicit and not (args and self.is_device(args[0])):
            self._count("upload", name)
        elif name == "to" and not on_device and _names_device(args[1:], kwargs):
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


def _names_device(args, kwargs) -> bool:
    """A ``.to(...)`` call that moves to a device (not just a dtype change)."""
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) or isinstance(a, torch.Tensor) for a in args)
