"""CPU inference kernels that make a many-row SPACE step cost little more than a one-row AR step.

Four changes, all through public hooks of torch / transformers, all applied by :func:`optimize_for_cpu`
to every method of a benchmark alike (so a measured speedup is the decoding method's, not a kernel's):

1. **Prepacked linears** (:class:`PackedLinear`). A SPACE step feeds 5-32 query rows through
   every linear, an AR step one. With stock ``F.linear``, MKL takes a matrix-vector path for one
   row and a small matrix-matrix path for more, which costs up to 4x as much on a 2-core CPU
   (SmolLM2's linears: 142 ms at 16 rows against 37 at 1). With the weights packed once for the
   kernel, the many-row call costs little more than the one-row call. The packed kernel is MKL's
   ``cblas_sgemm_compute`` (``torch.ops.mkl._mkl_linear``, the kernel inductor uses for frozen
   CPU linears) or oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``), whichever is
   faster on this machine (:func:`choose_packed_kernel`, timed when the kernels are applied): on an
   AVX-512 Intel CPU at 2 threads MKL's packed GEMM took 0.75-0.88x oneDNN's time at 2-32 rows
   (the shipped adapter's step-cost curve went from 55.6 / 104.6 / 138.6 ms at 1 / 16 / 32 rows to
   54.4 / 89.6 / 114.0, issue 58); on an AVX2 AMD EPYC oneDNN took about half MKL's. Which path is
   faster for few rows depends on the CPU: on an AVX2 machine the packed kernel (oneDNN then)
   also won at one row (~41 ms against ~48 ms for SmolLM2's linears), on the AVX-512 machine of
   issue 43 MKL's matrix-vector path won by ~20 %. So :func:`choose_stock_rows` times both
   paths per weight shape when the kernels are applied, and each :class:`PackedLinear` calls
   stock ``F.linear`` up to the row count where it is faster (``stock_rows``), the packed kernel
   above it; the choice goes into the run record. Both paths match ``F.linear`` to fp32 rounding
   (~1e-6); the packed kernel's rows do not depend on how many rows a call holds. So an AR row
   (stock) and the same row in a SPACE block (packed) can differ at fp32 rounding, as they
   already do with the stock kernels (MKL's one-row and many-row paths): greedy SPACE equals AR
   except at a near-tie that rounding flips, and the timed choice can differ between runs
   (``stock_rows = 0``, the packed kernel everywhere, makes every row call-independent).
2. **GQA attention with a mask** (``space.decoding.backends.SDPA_GQA``). transformers' ``sdpa``
   copies the key/value cache to every query head (``repeat_kv``) whenever a mask is given, which
   SPACE's 4-D mask always is: 60 cache copies per step for SmolLM2. On a CPU that attention
   hands the grouped heads to ``torch.nn.functional.scaled_dot_product_attention``
   (``enable_gqa=True``) instead.
3. **RMSNorm in one call** (``space.rms_norm.NativeRMSNorm``). transformers' Llama-style ``RMSNorm`` runs
   eight tensor ops from Python per call, 61 calls a step in SmolLM2;
   ``torch.nn.functional.rms_norm`` runs the same ops in the same order inside ATen, so in fp32
   its result is the same bit for bit. A norm is swapped only when a probe input gives that.
4. **A fused LoRA update block by block** (:func:`blockwise_lora`). A fused q/k/v or gate/up
   linear's B is block-diagonal (``space.decoding.fused``): one ``addmm_`` over it, as a GPU step
   wants (one launch), reads its zero blocks too, half to two thirds of the bytes. A CPU step
   reads every B cold, after the GEMMs have streamed the weights through the caches, and there
   the small update GEMMs cost about their cold reads: on the AVX2 AMD EPYC of issue 58 (2
   threads) the shipped adapter's updates took 32.2 ms of a 16-row step as one call a group and
   23.6 ms as one call per member's block (``results/step_parts_cpu``, 12 rounds in turns; end to
   end on HumanEval about 0-2 % faster, as a decode step has fewer mask rows). Only the mask
   rows' drafts change, at fp32 rounding; the real rows, which decide the output, have no LoRA term.

Inference only: packed weights take no gradient.
"""
from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from .choices import KERNEL_CHOICES
from .rms_norm import swap_rms_norms

PROBE_ROWS = (1, 2, 4, 8)  # row counts timed per weight shape; stock wins, if anywhere, at the low end
KERNEL_PROBE_ROWS = (4, 16)  # the packed kernels are compared where they run: a few-row and a SPACE-sized step
PACKED_KERNELS = ("mkl", "onednn")
# MKL packs a weight for a row count, and the packed buffer carries its own format (MKL's docs:
# internally stored metadata): ``cblas_sgemm_compute`` takes any row count from it. torch's op
# falls back to the stock linear unless told the call's own count as the pack's, so PackedLinear
# passes it. Measured here: 2-40 rows from one pack equal the exact pack for each count bit for
# bit (tests/test_cpu_kernels.py checks the call against F.linear and across counts). A pack for
# few rows caps the blocking: packed for 16 rows, a 32-row call took 1.35x the time packed for 64
# or more, while 1-32 row calls cost the same from packs for 64 to 512 rows (SmolLM2's shapes, 2
# threads)
MKL_PACK_ROWS = 128
# A packed call's rows are padded with zero rows to at least 2 and to a multiple of ROW_MULTIPLE, so
# that each row's rounding does not depend on how many rows share the call. Both kernels take another
# path for 1 row on some shapes (MKL at 96 inputs, oneDNN at 1536). On an AVX2 AMD EPYC, MKL also
# rounds the rows past the last multiple of 4 otherwise in calls of 1-3, 5-7 and 9-11 rows (96-1536
# inputs), and padded to a multiple of 4 every count from 1 to 301 matched; on the AVX-512 Intel CPU
# of issue 58 any count from 2 matched. The padding copies the rows when the count is not a multiple.
ROW_MULTIPLE = {"mkl": 4, "onednn": 1}
# The fewest rows a packed call is padded to, chosen among these by timing (:func:`choose_min_rows`):
# a kernel's GEMM for 2 rows can cost more than for 4. On the 2-core Zen 4 EPYC (oneDNN, 2 threads)
# SmolLM2 with the shipped adapter took 44.9 ms a 1-row step padded to 2 rows, 36.2 padded to 4 and
# 41.6 to 8, and a 4-row step 37.9 (6 rounds in turns): AR's eager step was about a fifth slower than
# it had to be. Rows never differ with the count here (any count from 2 rounds alike, ROW_MULTIPLE).
MIN_ROWS_CHOICES = (2, 4, 8)


def cpu_model() -> str:
    """This machine's CPU model as Linux names it (``/proc/cpuinfo`` "model name", e.g. "AMD
    EPYC"), else what ``platform.processor()`` says, else the architecture. Which packed kernel is
    faster, and so every CPU timing, depends on it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_identity() -> str:
    """This CPU as a step-cost curve records it (``space.artifact.setup_key``): its model
    (:func:`cpu_model`) and the widest vector ISA torch's kernels use here
    (``torch.backends.cpu.get_cpu_capability()``), e.g. "AMD EPYC (AVX512)". Two machines Linux
    names alike can step differently: an AVX2 EPYC's 16-row SmolLM2 step cost 1.89x its 1-row step,
    a Zen 4 EPYC's 1.56x, and the dynamic tree priced by the AVX2 curve decoded 1.10x slower on the
    Zen 4 (``results/humaneval20_zen4_curve``)."""
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


def has_kernel(kernel: str) -> bool:
    """Whether this torch build has the packed kernel ``kernel`` (one of :data:`PACKED_KERNELS`)."""
    if kernel == "mkl":
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    return (kernel == "onednn" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packed_kernel() -> str | None:
    """The packed kernel PackedLinear takes when given none: ``"mkl"`` where torch has MKL (x86
    builds), else ``"onednn"`` (builds with mkldnn only, e.g. aarch64), else None. The fast kernels
    do not use this default: they time both (:func:`choose_packed_kernel`)."""
    return next((k for k in PACKED_KERNELS if has_kernel(k)), None)


def packing_available() -> bool:
    """True when this torch build has a prepacked-linear kernel (:func:`packed_kernel`)."""
    return packed_kernel() is not None


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W packed once for a GEMM kernel (fp32, CPU, inference).

    Args:
        linear: the ``nn.Linear`` to replace, fp32 on CPU. Its ``weight`` stays referenced as
            ``self.weight`` (shared storage, e.g. a tied embedding), so code reading it still works.
        extra: optional (r, in) rows packed below W, e.g. a LoRA ``A``: one kernel call then gives
            ``x W^T`` and ``x extra^T`` together (:meth:`forward_extra`). Both kernels compute each
            output column on its own, so the W columns are bit-identical with or without the extra
            rows (``tests/test_cpu_kernels.py`` checks it).
        stock_rows: calls of at most this many rows take stock ``F.linear`` (MKL's matrix-vector
            or small-matrix path): :meth:`forward` on W alone, :meth:`forward_extra` on W and
            ``extra`` stacked; 0 = always the packed kernel. Above it, :meth:`forward` computes
            ``extra`` with W in one call and drops it.
        kernel: ``"mkl"`` or ``"onednn"`` (:data:`PACKED_KERNELS`); None: :func:`packed_kernel`,
            MKL where torch has it.
        min_rows: a packed call of fewer rows is padded with zero rows to this many (at least 2,
            :data:`MIN_ROWS_CHOICES`, :func:`choose_min_rows`), then to a multiple of the kernel's
            ``ROW_MULTIPLE``.

    ``forward(x (..., in)) -> (..., out)``; ``forward_extra(x) -> ((..., out), (..., r))``.

    The stacked ``[W; extra]`` that the stock path of :meth:`forward_extra` reads is a view when
    ``extra``'s rows follow W's in memory (``GatedLoraLinear`` keeps them so), else a copy; only a
    view is kept when ``stock_rows`` is 0 (nothing reads it then). Without that path a 2-row
    step with a mask row took the packed kernel and one without took MKL's stock path: on SmolLM2
    at 2 threads the measured adapter cost (``space.eval.step_cost.adapter_cost``) was 28 ms
    instead of ~8. ``stock_rows`` is timed on W alone (:func:`choose_stock_rows`); the stacked GEMM
    is r rows taller, which moved no crossover here.

    Raises:
        ValueError: the linear is not fp32 on CPU, or this torch build lacks the kernel, or
            ``min_rows`` < 2 (one row takes another path, ROW_MULTIPLE).
    """

    def __init__(self, linear: nn.Linear, extra: torch.Tensor | None = None, stock_rows: int = 0,
                 kernel: str | None = None, min_rows: int = 2):
        super().__init__()
        if min_rows < 2:
            raise ValueError(f"min_rows must be >= 2 (a 1-row call takes another path and rounds otherwise), "
                             f"got {min_rows}")
        self.stock_rows, self.min_rows = stock_rows, min_rows
        self.kernel = kernel or packed_kernel()
        w = linear.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise ValueError(f"PackedLinear needs an fp32 CPU linear, got {w.dtype} on {w.device}")
        if not has_kernel(self.kernel):
            raise ValueError(f"this torch build has no packed linear kernel {self.kernel!r} (choose from "
                             f"{[k for k in PACKED_KERNELS if has_kernel(k)]})")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = w, linear.bias
        self.extra_out = 0 if extra is None else extra.shape[0]
        with torch.no_grad():
            full, is_view = (w.detach(), False) if extra is None else _stacked(w.detach(), extra.detach().to(w.dtype))
            self.stacked = full if extra is not None and (is_view or stock_rows > 0) else None
            # torch's MKL op reads its original-weight argument for the shape alone, but for a fallback
            # to the stock linear that the call's own row count never takes: a 0-stride stand-in,
            # whose fallback would give the bias alone (tests/test_cpu_kernels.py compares with F.linear)
            self.shape_only = full.new_zeros(()).expand(full.shape) if self.kernel == "mkl" else None
            self.packed = (torch.ops.mkl._mkl_reorder_linear_weight(full, MKL_PACK_ROWS) if self.kernel == "mkl"
                           else torch.ops.mkldnn._reorder_linear_weight(full))
            bias = None if linear.bias is None else linear.bias.detach()
            if bias is not None and self.extra_out:
                bias = torch.cat([bias, bias.new_zeros(self.extra_out)])
            self.packed_bias = bias

    def _all(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        n = rows.shape[0]
        padded = max(self.min_rows, -(-n // ROW_MULTIPLE[self.kernel]) * ROW_MULTIPLE[self.kernel])
        if padded > n:  # other counts take other paths, whose rounding differs (ROW_MULTIPLE)
            rows = torch.cat([rows, rows.new_zeros(padded - n, self.in_features)])
        if self.kernel == "mkl":  # the call's row count as the pack's: MKL computes any count from one pack
            y = torch.ops.mkl._mkl_linear(rows, self.packed, self.shape_only, self.packed_bias, rows.shape[0])
        else:
            y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.packed_bias, "none", [], "")
        return y[:n].view(*x.shape[:-1], self.out_features + self.extra_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.stock_rows * self.in_features:
            return nn.functional.linear(x, self.weight, self.bias)
        y = self._all(x)
        return y[..., : self.out_features] if self.extra_out else y

    def forward_extra(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stacked is not None and x.numel() <= self.stock_rows * self.in_features:
            y = nn.functional.linear(x, self.stacked, self.packed_bias)
        else:
            y = self._all(x)
        return y[..., : self.out_features], y[..., self.out_features:]


def _stacked(w: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``([w; extra] (out + r, in), is_view)``: a view of their storage when extra's rows directly
    follow w's (no second copy of W), else a new tensor."""
    rows, cols = w.shape
    adjacent = (extra.dim() == 2 and extra.shape[1] == cols and w.stride() == (cols, 1) and extra.stride() == (cols, 1)
                and w.untyped_storage().data_ptr() == extra.untyped_storage().data_ptr()
                and extra.data_ptr() == w.data_ptr() + w.numel() * w.element_size())
    if adjacent:
        return w.as_strided((rows + extra.shape[0], cols), (cols, 1)), True
    return torch.cat([w, extra]), False


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _probe_linear(weight: torch.Tensor, kernel: str | None = None, min_rows: int = 2) -> PackedLinear:
    """A :class:`PackedLinear` over ``weight`` (out, in) alone, every call on the packed kernel."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)  # no copy of W besides the pack
    return PackedLinear(linear, kernel=kernel, min_rows=min_rows)


def choose_packed_kernel(weights: dict[str, tuple[torch.Tensor, int]], rows: tuple[int, ...] = KERNEL_PROBE_ROWS,
                         repeats: int = 10) -> tuple[str | None, dict]:
    """Time each packed kernel this torch build has (:data:`PACKED_KERNELS`) on a model's linears,
    on this machine, now, and choose the one with the least total time.

    Which kernel is faster depends on the CPU, not on the build: on the AVX-512 Intel machine of
    issue 58 MKL's packed GEMM took 0.75-0.88x oneDNN's time at 2-32 rows, while on an AVX2 AMD EPYC
    (2 threads) oneDNN's took about half of MKL's time on most shapes from 2 rows up, and the
    shipped adapter's 16-row step cost 210 ms with oneDNN against 298 with MKL, its 1-row step the
    same (``results/packed_kernels_cpu``).

    Args:
        weights: ``{"out x in": (a weight of that shape, how many linears of the model have it)}``.
        rows: the row counts timed (a prompt-lookup step's and a SPACE step's, by default).

    Returns:
        (kernel, ``{"out x in": {kernel: [us per row count]}}``, medians): the kernel with the least
        sum over shapes of count x the times; with one kernel in the build, that one and no timings;
        with none, None.
    """
    kernels = [k for k in PACKED_KERNELS if has_kernel(k)]
    if len(kernels) < 2:
        return (kernels[0] if kernels else None), {}
    gen = torch.Generator().manual_seed(0)
    timings: dict[str, dict] = {}
    total = dict.fromkeys(kernels, 0.0)
    with torch.no_grad():
        for key, (weight, count) in weights.items():
            xs = [torch.randn(r, weight.shape[1], generator=gen) for r in rows]
            timings[key] = {}
            for kernel in kernels:
                packed = _probe_linear(weight, kernel)
                us = [round(_median_us(lambda: packed(x), repeats), 1) for x in xs]
                timings[key][kernel] = us
                total[kernel] += count * sum(us)
    return min(kernels, key=total.__getitem__), timings


def choose_min_rows(weights: dict[str, tuple[torch.Tensor, int]], kernel: str | None = None,
                    choices: tuple[int, ...] = MIN_ROWS_CHOICES, repeats: int = 10) -> tuple[int, dict]:
    """Time the packed ``kernel`` (None: :func:`packed_kernel`) on a model's linears at each row
    count of ``choices`` (ascending), on this machine, now, and choose the one with the least total
    time: a call of fewer rows (AR's step, a small block) is padded to it (:data:`MIN_ROWS_CHOICES`).

    Args:
        weights: ``{"out x in": (a weight of that shape, how many linears of the model have it)}``.

    Returns:
        (min_rows, ``{"out x in": {rows: us}}`` medians): a tie goes to the fewer rows.
    """
    gen = torch.Generator().manual_seed(0)
    timings: dict[str, dict] = {}
    total = dict.fromkeys(choices, 0.0)
    with torch.no_grad():
        for key, (weight, count) in weights.items():
            packed = _probe_linear(weight, kernel)
            timings[key] = {}
            for rows in choices:
                x = torch.randn(rows, weight.shape[1], generator=gen)
                timings[key][rows] = round(_median_us(lambda: packed(x), repeats), 1)
                total[rows] += count * timings[key][rows]
    return min(choices, key=total.__getitem__), timings


def choose_stock_rows(weight: torch.Tensor, rows: tuple[int, ...] = PROBE_ROWS, repeats: int = 15,
                      kernel: str | None = None, min_rows: int = 2) -> tuple[int, dict]:
    """Time stock ``F.linear`` against the packed kernel ``kernel`` (None: :func:`packed_kernel`),
    its calls padded to ``min_rows``, on ``weight`` (out, in) for each row count in ``rows``
    (ascending), on this machine, now.

    Returns:
        (stock_rows, timings): the largest probed row count up to which stock was faster at every
        probed count (0 if it lost at one row), and ``{rows: [stock_us, packed_us]}`` medians.
    """
    w = weight.detach()
    packed = _probe_linear(w, kernel, min_rows)  # stock_rows 0: every call takes the packed kernel
    gen = torch.Generator().manual_seed(0)
    timings, stock_rows, stock_wins = {}, 0, True
    with torch.no_grad():
        for r in rows:
            x = torch.randn(r, w.shape[1], generator=gen)
            stock = _median_us(lambda: nn.functional.linear(x, w), repeats)
            packed_us = _median_us(lambda: packed(x), repeats)
            timings[r] = [round(stock, 1), round(packed_us, 1)]
            stock_wins = stock_wins and stock < packed_us
            stock_rows = r if stock_wins else stock_rows
    return stock_rows, timings


def pack_linears(model: nn.Module, choose: bool = False, kernel: str | None = None, min_rows: int | None = None,
                 paths: dict[str, dict] | None = None) -> tuple[int, str | None, dict, int]:
    """Replace every fp32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`, in place. A
    linear under an accelerate hook (a model placed by a device map) is left alone: the replacement
    would drop the hook.

    A module with a ``base`` linear and a ``lora_a`` (r, in) weight (the frozen-base
    ``space.adapter_layers.GatedLoraLinear``) gets ``lora_a`` packed under W, so the gated update costs
    one small matmul instead of two linears (on SmolLM2, the 210 unfused LoRA updates took ~40 ms
    of a ~130 ms SPACE step on a 2-core CPU). Duck-typed, so this module imports nothing of ours.

    ``choose``: time the packed kernels on the model's linear shapes and take the faster
    (:func:`choose_packed_kernel`), the fewest rows its calls are padded to
    (:func:`choose_min_rows`), then time stock against it once per weight shape
    (:func:`choose_stock_rows`) and give each packed linear its shape's ``stock_rows``; else the
    build's default kernel (:func:`packed_kernel`), calls padded to 2 rows, and every call on it.
    ``kernel``: this packed kernel (:data:`PACKED_KERNELS`) instead of the timed or default one;
    ``min_rows`` and ``paths`` (a record's per-shape entries, ``{"out x in": {"stock_rows": n,
    ...}}``): these instead of the timed ones, each shape of ``paths`` keeping its entry (a resumed
    run's, whose samples were timed with them); a shape it lacks is timed.

    Returns:
        (how many linears were packed, the packed kernel, ``{"out x in": {"stock_rows": n, "us":
        timings, "kernel_us": {kernel: [us at KERNEL_PROBE_ROWS]}, "min_rows_us": {rows: us}}}``
        per shape when ``choose``, the fewest rows a packed call is padded to). 0 packed (and
        kernel None) when the model has no fp32 CPU linear or torch has no packed kernel, so
        callers can pack unconditionally and report the number.
    """
    if not packing_available():
        return 0, None, {}, 2

    def packable(m: nn.Module | None) -> bool:  # a hooked one (device map, offload) keeps its hook: left alone
        return (type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
                and not hasattr(m, "_hf_hook"))

    gated = [m for m in model.modules() if isinstance(getattr(m, "lora_a", None), torch.Tensor)
             and packable(getattr(m, "base", None))]
    bases = {id(m.base) for m in gated}  # packed with their A below
    plain = [(name, m) for name, m in model.named_modules() if packable(m) and id(m) not in bases]
    linears = [m.base for m in gated] + [m for _, m in plain]
    if not linears:
        return 0, None, {}, 2
    shapes: dict[str, tuple[torch.Tensor, int]] = {}
    for linear in linears:  # stock_rows and the kernel are timed on W alone (the stacked [W; A] is r rows taller)
        key = "x".join(map(str, linear.weight.shape))
        shapes[key] = (linear.weight, shapes.get(key, (None, 0))[1] + 1)
    kernel, kernel_us = ((kernel, {}) if kernel else choose_packed_kernel(shapes) if choose
                         else (packed_kernel(), {}))
    choices: dict[str, dict] = {}
    min_rows, min_rows_us = (min_rows, {}) if min_rows else choose_min_rows(shapes, kernel) if choose else (2, {})
    if choose:
        for key, (weight, _) in shapes.items():
            if key in (paths or {}):
                choices[key] = paths[key]
                continue
            n, timings = choose_stock_rows(weight, kernel=kernel, min_rows=min_rows)
            choices[key] = {"stock_rows": n, "us": timings, **({"kernel_us": kernel_us[key]} if kernel_us else {}),
                            **({"min_rows_us": min_rows_us[key]} if key in min_rows_us else {})}

    def stock_rows(linear: nn.Linear) -> int:
        return choices["x".join(map(str, linear.weight.shape))]["stock_rows"] if choose else 0

    for m in gated:
        m.base = PackedLinear(m.base, extra=m.lora_a, stock_rows=stock_rows(m.base), kernel=kernel, min_rows=min_rows)
    for name, m in plain:
        model.set_submodule(name, PackedLinear(m, stock_rows=stock_rows(m), kernel=kernel, min_rows=min_rows))
    return len(linears), kernel, choices, min_rows


def blockwise_lora(model: nn.Module) -> int:
    """Turn on ``blockwise`` in every module of ``model`` that has B^T ``blocks`` (a fused
    ``space.adapter_layers.GatedLoraLinear``; duck-typed): its decode-step update then runs one
    ``addmm_`` per nonzero block instead of one over the block-diagonal B (module docstring, item
    4). Returns how many modules were switched."""
    fused = [m for m in model.modules() if getattr(m, "blocks", None) and hasattr(m, "blockwise")]
    for m in fused:
        m.blockwise = True
    return len(fused)


def optimize_for_cpu(model: nn.Module, kernel: str | None = None, min_rows: int | None = None,
                     paths: dict[str, dict] | None = None) -> dict:
    """Apply the four changes to an fp32 CPU model in place (no-op on other devices / dtypes).

    The packed kernel is ``kernel``, or by default the faster one on this machine
    (:func:`choose_packed_kernel`), its calls padded to the fewest rows where it is fastest
    (:func:`choose_min_rows`), and the linears take stock ``F.linear`` up to the row count where
    it is faster than that kernel (:func:`choose_stock_rows`); all timed here, a few seconds for
    SmolLM2, except what ``min_rows`` and ``paths`` pin (:func:`pack_linears`).

    Returns:
        what was done, for run records: ``{"packed_linears": n, "packed_kernel": "mkl" | "onednn" | None,
        "packed_min_rows": n, "attention": name, "rms_norms": swapped, "blockwise_lora": n, "stock_rows":
        {"out x in": {"stock_rows": n, "us": {rows: [stock, packed]}, "kernel_us": {kernel: [us]},
        "min_rows_us": {rows: us}}}}`` (``"stock_rows"`` holds the timings: a record keeps it apart
        from the settings).
    """
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return {"packed_linears": 0, "attention": model.config._attn_implementation}
    from .decoding.backends import SDPA_GQA, register_attention  # the decoding package imports this module

    packed, kernel, choices, min_rows = pack_linears(model, choose=True, kernel=kernel, min_rows=min_rows, paths=paths)
    if model.config._attn_implementation == "sdpa":
        register_attention()
        model.set_attn_implementation(SDPA_GQA)
    return {"packed_linears": packed, "packed_kernel": kernel, "packed_min_rows": min_rows,
            "attention": model.config._attn_implementation, "rms_norms": swap_rms_norms(model),
            "blockwise_lora": blockwise_lora(model), "stock_rows": choices}


def apply_kernels(model: nn.Module, choice: str, kernel: str | None = None, min_rows: int | None = None,
                  paths: dict[str, dict] | None = None) -> dict:
    """The ``--kernels`` flag of space-eval and the scripts: ``fast`` runs :func:`optimize_for_cpu`
    (with the packed ``kernel``, ``min_rows`` and per-shape ``paths``, None: timed), ``stock`` keeps
    transformers' own kernels. Returns the run-record entry
    ``{"choice": choice, "packed_linears": n, "attention": name}``, plus ``"packed_kernel"``,
    ``"rms_norms"`` (norms swapped), ``"blockwise_lora"`` (fused updates made blockwise) and ``"stock_rows"`` (the timed path per weight shape,
    :func:`optimize_for_cpu`) for ``fast`` on an fp32 CPU model.

    Raises:
        ValueError: choice not in KERNEL_CHOICES.
    """
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    done = (optimize_for_cpu(model, kernel, min_rows, paths) if choice == "fast"
            else {"packed_linears": 0, "attention": model.config._attn_implementation})
    return {"choice": choice, **done}
