"""The code that touches transformers' internals in SPACE training (STYLE item 19): the frozen
real tokens' KV cache and the activation-checkpointing hooks (DESIGN §3.6)."""
from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import DynamicCache

from ..masking import mask_rows, mask_rows_start


class PrefixCache(DynamicCache):
    """The real tokens' KV cache of a frozen-base step, read-only once ``frozen``.

    The no-grad real pass fills it; the mask pass then gets, per layer, the real keys and values
    followed by the mask rows' own, without storing the latter. The cache is the same before and
    after each mask forward, so a decoder layer recomputed in backward (activation checkpointing)
    sees exactly what it saw in forward, and every chunk of mask rows sees the real tokens alone.
    """

    frozen = False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.frozen:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


def checkpoint_with_prefix_cache(model) -> None:
    """Make transformers' activation checkpointing of ``model`` recompute what the forward computed.

    Call it after checkpointing is enabled (``activation_checkpointing_enable``; the Trainer does
    that in ``train()``, and ``space.train.callbacks.CheckpointInMaskRowsCallback`` calls this
    then). Two things differ in a recompute unless told:

    * the mask rows: a layer recomputed in backward runs outside the forward's ``mask_rows``
      block (and on a GPU in autograd's own thread), so the frozen-base LoRA gate would see no
      mask row and zero the LoRA output; each checkpoint re-enters the forward's block
      (``context_fn``);
    * the cache: transformers drops the cache of a checkpointed layer, since a recomputed layer
      would write it twice; its ``_can_checkpoint_with_cache`` is for layers that only read it,
      which is what a frozen :class:`PrefixCache` makes every layer do (the frozen-base mask pass
      is the only one that runs layers with gradients and a cache).

    Raises:
        ValueError: a transformers version without that switch (it appeared in 5.24), or
            reentrant checkpointing (``use_reentrant: true``, or settings that leave it out: torch's
            default), which takes no ``context_fn``.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        raise ValueError("SPACE training with activation_checkpointing needs transformers >= 5.24 (earlier "
                         "versions drop the real tokens' cache in checkpointed layers); upgrade, or turn it off")
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module._can_checkpoint_with_cache = True
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is not None and not getattr(func, "in_mask_rows", False):
                # left out, torch's checkpoint runs the reentrant variant (its default), which takes no context_fn
                if getattr(func, "keywords", {}).get("use_reentrant", True):
                    raise ValueError("SPACE training needs activation_checkpointing_kwargs use_reentrant: false "
                                     "(a reentrant recompute cannot re-enter the mask rows' context)")
                module._gradient_checkpointing_func = _in_mask_rows(func)


def _in_mask_rows(func):
    """``func`` (a checkpoint function) with the recompute inside the forward's mask_rows block."""
    def checkpoint(function, *args, **kwargs):
        start = mask_rows_start()  # read at forward time; the recompute enters a block of its own
        return func(function, *args, context_fn=lambda: (nullcontext(), mask_rows(start)), **kwargs)

    checkpoint.in_mask_rows = True
    return checkpoint
