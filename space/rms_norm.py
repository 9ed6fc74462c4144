"""RMSNorm in one call (issue 58): ``torch.nn.functional.rms_norm`` in place of transformers'
Llama-style RMSNorm, where a probe says the swap is safe. The CPU's fast kernels swap fp32 norms
that give the same bits (``space.cpu_kernels``, item 3); the fused trunk swaps CUDA norms, where
the native norm is one kernel (``space.decoding.fused.fuse_trunk``)."""
from __future__ import annotations

import inspect

import torch
from torch import nn


class NativeRMSNorm(nn.Module):
    """``torch.nn.functional.rms_norm`` in place of a transformers Llama-style ``RMSNorm`` (Llama,
    Mistral, Qwen2/3, Phi3, Olmo2 and kin): ``x * rsqrt(mean(x^2, -1) + eps) * weight``, one call
    where transformers' Python makes eight (six kernels in fp32, eight in bf16; 61 norms a SmolLM2
    step). On a CPU in fp32, ATen's composite runs the same ops in the same order, so it gives the
    same bits; on CUDA it is one fused kernel (torch >= 2.9), which rounds otherwise, and in bf16 /
    fp16 ATen multiplies by the weight before casting down, transformers after
    (:func:`swap_rms_norms` says where it is swapped in). ``forward(x (..., hidden)) -> (...,
    hidden)``. Its ``weight`` is the norm's own parameter (same state-dict key, ties kept)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _one_input(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes exactly one argument (a gated norm's also takes the gate)."""
    try:
        return len(inspect.signature(module.forward).parameters) == 1
    except (TypeError, ValueError):
        return False


# rows a probe input holds (a decode step has up to a few hundred rows, a per-head norm rows x heads),
# and the row counts whose native results must equal the whole probe's rows: alone, few, and odd
PROBE_ROWS, ROW_COUNTS = 512, (1, 2, 16, 37)


def _agrees(norm: nn.Module, native: NativeRMSNorm, probe: torch.Tensor, exact: bool) -> bool:
    """Whether ``native`` may stand in for ``norm`` (:func:`swap_rms_norms`): the same bits on
    ``probe`` (``exact``), or (not ``exact``) the same values to the dtype's rounding, which a
    norm of another formula misses by far, and each row the bits it gets among the whole probe's
    :data:`PROBE_ROWS` rows when it is normalized alone, and among the first 2, 16 and 37 rows. A
    decode step's rows and AR's one row are then normalized alike, which greedy SPACE equalling AR
    needs of the norms (and checks end to end, ``tests/test_cuda.py``)."""
    try:
        with torch.no_grad():
            ref, got = norm(probe), native(probe)
            if exact:
                return torch.equal(ref, got)
            # per element, against the norm's own scale there (|x / rms| is about 1): one outlier weight
            # leaves the others' tolerance where it was
            tol = 1e-4 if probe.dtype == torch.float32 else 3e-2
            if not ((got.float() - ref.float()).abs() <= tol * (ref.float().abs() + native.weight.float().abs())).all():
                return False
            if not all(torch.equal(native(probe[:n]), got[:n]) for n in ROW_COUNTS):
                return False
            last = probe.shape[0] - 1  # a row far from the first, alone
            return torch.equal(native(probe[last:]), got[last:]) and torch.equal(native(probe[None])[0], got)
    except Exception:  # a norm that needs more than its input, or another shape: left alone
        return False


def swap_rms_norms(model: nn.Module, exact: bool = True, dtype: torch.dtype | None = None) -> int:
    """Replace RMSNorms of ``model`` by :class:`NativeRMSNorm`, in place, where a probe input says
    the swap is safe. A candidate has a 1-D ``weight`` parameter, a ``variance_epsilon`` and a
    forward of one argument, and no accelerate hook (a model placed by a device map keeps its
    modules: a swapped one would lose its hook). The probe keeps a norm of another formula
    (``1 + weight`` under Llama's names, a mean-subtracting or grouped norm), and one whose call
    fails.

    Args:
        exact: fp32 CPU norms only, swapped where the two give the same bits (the CPU's fast
            kernels, ``space.cpu_kernels``: the output stays transformers' to the bit); False
            (``space.decoding.fused.fuse_trunk`` on CUDA): norms of any device, swapped where the
            two agree to rounding and the native norm's rows do not depend on the other rows
            (:func:`_agrees`).
        dtype: with ``exact`` False, the dtype the norms' inputs have (the trunk's): a norm whose
            weight has another (kept in fp32 under a bf16 trunk) is left alone, as it would run on
            inputs of a dtype its probe did not have. None: any.

    Returns:
        how many norms were swapped.
    """
    gen = torch.Generator().manual_seed(0)
    count = 0
    for name, m in list(model.named_modules()):
        weight = getattr(m, "weight", None)
        if (not hasattr(m, "variance_epsilon") or isinstance(m, NativeRMSNorm) or hasattr(m, "_hf_hook")
                or not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not weight.is_floating_point()
                or (exact and (weight.device.type != "cpu" or weight.dtype != torch.float32))
                or (dtype is not None and weight.dtype != dtype) or not _one_input(m)):
            continue
        native = NativeRMSNorm(m)
        rows = 3 if exact else PROBE_ROWS
        # rows of other means and scales: a mean-subtracting norm differs from RMSNorm where a row's mean
        # is not about 0 (with zero-mean rows, by about 1/sqrt(hidden), within bf16's rounding)
        probe = (torch.randn(rows, weight.shape[0], generator=gen) * 3 + torch.randn(rows, 1, generator=gen) * 3).to(weight)
        if _agrees(m, native, probe, exact):
            model.set_submodule(name, native)
            count += 1
    return count
