"""The attention backend, chosen once when a model loads, per device and dtype (issue 58, item 3).

On a Hopper GPU with the cuDNN that torch 2.11+cu130 bundles, ``scaled_dot_product_attention``
prefers cuDNN's kernel for bf16 / fp16 queries with a mask. cuDNN builds an execution plan for
every new shape, and a decoder's key length changes at every step, so each step can pay a plan
build (tens to hundreds of ms in public reports), while fp32 takes the memory-efficient kernel,
which builds nothing: on an H200 a bf16 SPACE step cost about 87 ms against 41 ms in fp32, though a
fixed-shape forward costs the same in both (results/gpu_h200). Measured there so far is the
symptom, not this cause: ``scripts/gpu_bench.py host-time --cudnn-sdp both`` times both settings
in one run and names the attention kernels that ran.

The switch is PyTorch's and process-wide (``torch.backends.cuda.enable_cudnn_sdp``): there is no
per-model one. The decoders' 4-D masks are additive in the attention's dtype
(``space.decoding.cache.attention_dtype``): an fp32 mask with bf16 queries is what cuDNN
misreads.

The attention function itself is chosen at load too (:data:`SDPA_GQA`, set on an ``sdpa`` model by
``space.decoding.fused.fuse_trunk`` for every eager model on one device, by the CPU kernels and by a
CPU's compiled trunk): it reads the keys only up to the 4-D mask's width, so that a step over a static
cache attends over the slots that hold tokens (``space.decoding.decoder.mask_slots``; the captured
steps' slot buckets, ``space.decoding.graphs``), and it hands grouped key/value heads to SDPA
where the device has a kernel for them with a mask (:data:`GQA_WITH_MASK`). Elsewhere (CUDA) it
folds each key/value head's group of query heads into the batch, as views, so SDPA sees as many
query as key heads and takes its memory-efficient kernel, which has no GQA, without copying the
keys and values to every query head (transformers' ``repeat_kv``: two copies of the cache a layer).

On CUDA the memory-efficient kernel copies a mask in every call unless each of its strides is a
multiple of 8 (PyTorch's ``preprocess_mask``, ``pad_bias``), and a step's mask is as wide as the
cache plus its block: the masks the decoders build are views into rows padded to that
(:func:`mask_buffer`, :data:`MASK_ALIGN`).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

HALF = (torch.bfloat16, torch.float16)
SDPA_GQA = "space_sdpa_gqa"
# devices whose SDPA runs grouped key/value heads under a mask on a fast kernel. On CUDA with torch
# 2.11 the memory-efficient kernel has no GQA, so a masked grouped call (and an fp32 one without a
# mask: flash takes half precision only) lands on the math kernel (issue 58): there the query heads
# are folded into the batch instead (_folded_sdpa)
GQA_WITH_MASK = ("cpu",)
# the row alignment, in elements, of the masks a step builds on a device (mask_buffer): CUDA's
# memory-efficient SDPA pads (copies) a mask whose strides are not multiples of 8, in every layer
MASK_ALIGN = {"cuda": 8}


def mask_buffer(rows: int, width: int, dtype: torch.dtype, device: torch.device | str,
                fill: float = 0.0) -> torch.Tensor:
    """A (1, 1, rows, width) additive mask of ``fill``, a view into rows of ``width`` rounded up to
    the device's :data:`MASK_ALIGN`, so that SDPA reads it where it is (no copy per layer).

    Raises:
        ValueError: a negative ``rows`` or ``width``.
    """
    if rows < 0 or width < 0:
        raise ValueError(f"a mask has at least 0 rows and 0 keys, got {rows} x {width}")
    align = MASK_ALIGN.get(torch.device(device).type, 1)
    return torch.full((1, 1, rows, -(-width // align) * align), fill, dtype=dtype, device=device)[..., :width]


def choose_sdpa(device_type: str, dtype: torch.dtype) -> dict:
    """Set the SDPA backends for a model on ``device_type`` computing in ``dtype``: on CUDA in
    bf16 / fp16, cuDNN attention off (the memory-efficient and flash kernels stay); elsewhere
    nothing changes.

    Returns:
        the run record's entry: ``{"cudnn_sdp": bool}`` on CUDA (whether cuDNN attention is on
        now), ``{}`` on other devices.
    """
    if device_type != "cuda":
        return {}
    if dtype in HALF:
        torch.backends.cuda.enable_cudnn_sdp(False)
    return {"cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled()}


def sdpa_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (:data:`SDPA_GQA`): SDPA over the keys up to the 4-D mask's
    width, the grouped key/value heads handed to SDPA (``enable_gqa``) on the devices of
    :data:`GQA_WITH_MASK`, and elsewhere folded into the batch (one prompt, a mask shared by the
    heads); otherwise, or with a ``position_bias`` or ``softcap`` (which only transformers'
    function applies or refuses), transformers' own ``sdpa`` on the keys kept.

    Args:
        query: (batch, heads, q, head_dim); key, value: (batch, kv_heads, kv, head_dim).
        attention_mask: None, or additive / boolean (batch, 1, q, kv') (SPACE's 4-D layout mask),
            kv' <= kv: the keys past kv' are not read (a static cache's empty slots).

    Returns:
        ((batch, q, heads, head_dim) attention output, None): what ``sdpa`` returns.
    """
    # a mask narrower than the cache spans the keys that hold tokens (a step over a static cache,
    # :func:`attends_mask_width`): the empty slots past it would only cost attention time
    width = attention_mask.shape[-1] if attention_mask is not None and attention_mask.dim() == 4 else None
    bias = kwargs.get("position_bias")
    grouped = key.shape[1] != query.shape[1]
    own = bias is None and kwargs.get("softcap") is None
    on_gqa_device = query.device.type in GQA_WITH_MASK
    fold = own and grouped and not on_gqa_device and query.shape[0] == key.shape[0] == 1 and (
        attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[:2] == (1, 1)))
    delegate = not (own and on_gqa_device) and not fold
    # cut only where the mask is narrower off the CPU: an eager CUDA step is launch-bound, and a
    # slice is a dispatched op; on the CPU always (a compiled trunk's symbolic widths would guard on a branch)
    if width is not None and (on_gqa_device or width < key.shape[-2]):
        key, value = key[:, :, :width], value[:, :, :width]
        if bias is not None:
            kwargs["position_bias"] = bias[..., :width]
    if delegate:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    if fold:
        return _folded_sdpa(query, key, value, attention_mask, dropout, scaling, causal), None
    out = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        # a Python bool under torch.compile too (space.decoding.compiled): the comparison of two
        # symbolic head counts is a SymBool, which SDPA refuses, and a branch on it is a guard
        enable_gqa=True if grouped else False)
    return out.transpose(1, 2).contiguous(), None


def _folded_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 dropout: float, scaling: float | None, causal: bool) -> torch.Tensor:
    """Grouped-query attention of one prompt as plain multi-head SDPA: query head ``h`` of key head
    ``h // group`` becomes batch ``h % group``, head ``h // group``; the keys and values are the
    same tensors expanded over that batch (stride 0: nothing copied), the mask broadcast over it.

    Args:
        query: (1, heads, q, head_dim); key: (1, kv_heads, kv, head_dim); value: (1, kv_heads, kv,
            value head_dim); heads a multiple of kv_heads; mask: None or (1, 1, q, kv).

    Returns:
        (1, q, heads, value head_dim) contiguous: what transformers' ``sdpa`` returns for these inputs.
    """
    _, heads, rows, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if causal and key.shape[2] > rows:  # as transformers' sdpa: the rows see no key past their own (top-left)
        key, value = key[:, :, :rows], value[:, :, :rows]
    # transformers' repeat_kv order: query head h reads key head h // group
    folded = query[0].unflatten(0, (kv_heads, group)).transpose(0, 1)  # (group, kv_heads, q, head_dim)
    out = nn.functional.scaled_dot_product_attention(
        folded, key.expand(group, -1, -1, -1), value.expand(group, -1, -1, -1), attn_mask=mask, dropout_p=dropout,
        scale=scaling, is_causal=causal)  # (group, kv_heads, q, value head_dim)
    # back to (1, q, heads, value head_dim), head = kv head * group + batch: one copy, as transformers' own
    return out.permute(2, 1, 0, 3).reshape(1, rows, heads, value.shape[-1]).contiguous()


def attends_mask_width(model: nn.Module) -> bool:
    """Whether ``model``'s attention reads the keys only up to its 4-D mask's width
    (:data:`SDPA_GQA`), so that a step over a static cache may pass a mask over the cached tokens
    and its block alone (``space.decoding.decoder.with_cache``), not over every slot. transformers'
    own attention functions read every slot of the cache: a narrower mask fails there."""
    return getattr(model.config, "_attn_implementation", None) == SDPA_GQA


def register_attention() -> None:
    """Register :data:`SDPA_GQA` with transformers (idempotent). Called when a model loads (its
    trunk fused, the CPU kernels applied, a CPU trunk compiled), never at import, so ``import space`` leaves transformers' registries untouched."""
    AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA, sdpa_mask)  # the masks sdpa itself would get
