"""DeepSpeed ZeRO-3 for SPACE: read and write partitioned weights, check what a save wrote.

Under ZeRO-3 a model loaded by ``from_pretrained`` is partitioned at load time
(``deepspeed.zero.Init``): each rank holds a slice of every weight and the parameter itself has
shape (0,). Code that reads a weight's shape or rows (the mask token's mean embedding, DESIGN §3.7)
or saves it must gather it first, on every rank at once (a collective). Without DeepSpeed, or for
weights that are not partitioned, :func:`gathered` does nothing.

:func:`check_shapes` is the guard against the silent failure this caused before: an artifact whose
weights were saved partitioned (shape (0,)) or of another shape than the model's config says.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a ZeRO-3 parameter (it carries DeepSpeed's ``ds_id``)."""
    return hasattr(param, "ds_id")


def gathered(params, modifier_rank: int | None = None):
    """A context in which ZeRO-3 ``params`` hold their full data on every rank.

    Args:
        params: parameters (partitioned or not).
        modifier_rank: None to read; a rank whose in-place changes are broadcast to every rank and
            partitioned again on exit (``deepspeed.zero.GatheredParameters``).

    A no-op context when none of ``params`` is partitioned. Under ZeRO-3 it is a collective: call
    it on every rank.
    """
    params = [p for p in params if p is not None]
    if not any(is_partitioned(p) for p in params):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Parameter and buffer shapes of the causal LM ``config`` describes (built on the meta
    device: no memory, no weights)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    # the class itself, not AutoModelForCausalLM.from_config: under ZeRO-3 that one builds inside
    # deepspeed.zero.Init, a collective, and this runs on rank 0 alone (a save)
    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_shapes(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where) -> None:
    """Refuse a saved model whose tensors are empty or of other shapes than ``expected``.

    Args:
        shapes: name -> shape of the tensors saved (or about to be).
        expected: name -> shape from the model's config (:func:`expected_shapes`).
        where: the file or folder, named in the error.

    Raises:
        ValueError: an empty tensor (a ZeRO-3 partition saved without gathering), a tensor of
            another shape, or a weight of the model that is missing.
    """
    empty = [k for k, s in shapes.items() if 0 in s]
    wrong = [f"{k} {shapes[k]} (config: {expected[k]})" for k in shapes if k in expected and shapes[k] != expected[k]]
    # tied weights and non-persistent buffers may be left out of a saved model: only a weight the
    # checkpoint must hold (a layer's own weight) counts as missing
    missing = [k for k in expected if k not in shapes and ".layers." in k and k.endswith(".weight")]
    if empty:
        raise ValueError(f"{where}: {len(empty)} empty tensors ({', '.join(empty[:3])}): weights saved while "
                         "partitioned by ZeRO-3 (gather them before saving); refusing this artifact")
    if wrong or missing:
        raise ValueError(f"{where}: tensors do not match the model's config: "
                         f"{'; '.join(wrong[:3]) or 'missing ' + ', '.join(missing[:3])}; refusing this artifact")


def saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the ``*.safetensors`` files of a HF checkpoint folder,
    read from the files' headers (no tensor is loaded)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_saved_shapes(folder: Path) -> None:
    """:func:`check_shapes` of a full HF checkpoint folder (its ``config.json`` against its
    safetensors files).

    Raises:
        ValueError: no safetensors weights, or :func:`check_shapes`'s errors (the folder named).
    """
    from transformers import AutoConfig

    shapes = saved_shapes(folder)
    if not shapes:
        raise ValueError(f"{folder}: no *.safetensors weights in this checkpoint")
    check_shapes(shapes, expected_shapes(AutoConfig.from_pretrained(folder)), folder)
