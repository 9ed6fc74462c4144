"""CPU inference kernels that make a many-row SPACE step cost little more than a one-row AR step.

Two swaps, both through public hooks of torch / transformers, both applied by :func:`optimize_for_cpu`
to every method of a benchmark alike (so a measured speedup is the decoding method's, not a kernel's):

1. **oneDNN-prepacked linears** (:class:`PackedLinear`). A SPACE step feeds 5-16 query rows through
   every linear, an AR step one. With stock ``F.linear`` on a 2-core AVX2 CPU, MKL takes a
   matrix-vector path for one row and a small matrix-matrix path for more, which costs 1.4-2x as
   much (SmolLM2's 210 linears and head: ~48 ms for 1 row, ~94 ms for 10). oneDNN's inner product
   with weights reordered once into its blocked layout (the kernel inductor uses for frozen CPU
   linears) costs ~41 ms for 1 row and ~50-60 ms for 10; its 49152-row head ~7 ms and ~10 ms.
   Each output row is computed alone, so results do not depend on how many rows a call holds
   (bit-identical; stock MKL's 1-row and many-row paths differ by ~1e-6), and they match
   ``F.linear`` to fp32 rounding (~1e-6).
2. **GQA attention with a mask** (:data:`SDPA_GQA`). transformers' ``sdpa`` copies the key/value
   cache to every query head (``repeat_kv``) whenever a mask is given, which SPACE's 4-D mask always
   is: 60 cache copies per step for SmolLM2. Registered through ``AttentionInterface``, this
   implementation hands the grouped heads to ``torch.nn.functional.scaled_dot_product_attention``
   (``enable_gqa=True``) instead.

Inference only: packed weights take no gradient.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .choices import KERNEL_CHOICES

SDPA_GQA = "space_sdpa_gqa"


def packing_available() -> bool:
    """True when this torch build has the oneDNN prepacked-linear ops (CPU builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with W reordered once for oneDNN (fp32, CPU, inference).

    Args:
        linear: the ``nn.Linear`` to replace, fp32 on CPU. Its ``weight`` stays referenced as
            ``self.weight`` (shared storage, e.g. a tied embedding), so code reading it still works.
        extra: optional (r, in) rows packed below W, e.g. a LoRA ``A``: one kernel call then gives
            ``x W^T`` and ``x extra^T`` together (:meth:`forward_extra`). oneDNN computes each output
            column on its own, so the W columns are bit-identical with or without the extra rows
            (``tests/test_packed_linear.py`` checks it).

    ``forward(x (..., in)) -> (..., out)``; ``forward_extra(x) -> ((..., out), (..., r))``.

    Raises:
        ValueError: the linear is not fp32 on CPU, or this torch build lacks the oneDNN ops.
    """

    def __init__(self, linear: nn.Linear, extra: torch.Tensor | None = None):
        super().__init__()
        w = linear.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise ValueError(f"PackedLinear needs an fp32 CPU linear, got {w.dtype} on {w.device}")
        if not packing_available():
            raise ValueError("this torch build has no oneDNN prepacked linear (torch.ops.mkldnn)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = w, linear.bias
        self.extra_out = 0 if extra is None else extra.shape[0]
        with torch.no_grad():
            full = w.detach() if extra is None else torch.cat([w.detach(), extra.detach().to(w.dtype)])
            self.packed = torch.ops.mkldnn._reorder_linear_weight(full)
            bias = None if linear.bias is None else linear.bias.detach()
            if bias is not None and self.extra_out:
                bias = torch.cat([bias, bias.new_zeros(self.extra_out)])
            self.packed_bias = bias

    def _all(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.packed_bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features + self.extra_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._all(x)
        return y[..., : self.out_features] if self.extra_out else y

    def forward_extra(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self._all(x)
        return y[..., : self.out_features], y[..., self.out_features:]


def pack_linears(model: nn.Module) -> int:
    """Replace every fp32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`, in place.

    A module with a ``base`` linear and a ``lora_a`` (r, in) weight (the frozen-base
    ``space.adapters.GatedLoraLinear``) gets ``lora_a`` packed under W, so the gated update costs
    one small matmul instead of two linears (on SmolLM2, the 210 unfused LoRA updates took ~40 ms
    of a ~130 ms SPACE step on a 2-core CPU). Duck-typed, so this module imports nothing of ours.

    Returns:
        how many linears were packed (0 when the model is not fp32 on CPU or oneDNN is missing,
        so callers can pack unconditionally and report the number).
    """
    if not packing_available():
        return 0

    def packable(m: nn.Module | None) -> bool:
        return type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32

    count = 0
    for m in model.modules():
        if isinstance(getattr(m, "lora_a", None), torch.Tensor) and packable(getattr(m, "base", None)):
            m.base = PackedLinear(m.base, extra=m.lora_a)
            count += 1
    for name, m in list(model.named_modules()):
        if packable(m):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(m))
            count += 1
    return count


def sdpa_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: SDPA over grouped key/value heads, mask or not.

    Args:
        query: (batch, heads, q, head_dim); key, value: (batch, kv_heads, kv, head_dim).
        attention_mask: None, or additive / boolean (batch, 1, q, kv) (SPACE's 4-D layout mask).

    Returns:
        ((batch, q, heads, head_dim) attention output, None): what ``sdpa`` returns.
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    out = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register :data:`SDPA_GQA` with transformers (idempotent). Called when kernels are applied,
    never at import, so ``import space`` leaves transformers' registries untouched."""
    AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA, sdpa_mask)  # the masks sdpa itself would get


def optimize_for_cpu(model: nn.Module) -> dict:
    """Apply both kernels to an fp32 CPU model in place (no-op on other devices / dtypes).

    Returns:
        what was done, for run records: ``{"packed_linears": n, "attention": name}``.
    """
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return {"packed_linears": 0, "attention": model.config._attn_implementation}
    packed = pack_linears(model)
    if model.config._attn_implementation == "sdpa":
        register_attention()
        model.set_attn_implementation(SDPA_GQA)
    return {"packed_linears": packed, "attention": model.config._attn_implementation}




def apply_kernels(model: nn.Module, choice: str) -> dict:
    """The ``--kernels`` flag of space-eval and the scripts: ``fast`` runs :func:`optimize_for_cpu`,
    ``stock`` keeps transformers' own kernels. Returns the run-record entry
    ``{"choice": choice, "packed_linears": n, "attention": name}``.

    Raises:
        ValueError: choice not in KERNEL_CHOICES.
    """
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    done = (optimize_for_cpu(model) if choice == "fast"
            else {"packed_linears": 0, "attention": model.config._attn_implementation})
    return {"choice": choice, **done}
