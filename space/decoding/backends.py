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
"""
from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)


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
