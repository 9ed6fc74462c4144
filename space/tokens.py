"""The mask token (DESIGN §3.7): add it by name, resize embeddings once, record it in the config.

The ids and mask_num live in ``model.config.space_mask`` (saved with the model's config.json and
with our adapters), so the decoder finds them without hard-coded ids.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch

from .zero3 import gathered

MASK_TOKEN = "<|space_mask|>"
MAX_MASK_NUM = 16  # layout rows grow as k^2: beyond this a step costs more than it can save


@dataclass(frozen=True)
class MaskSpec:
    """What a SPACE model knows about its mask tokens.

    Attributes:
        token_ids: one id, or k ids when ``mask_diff`` (one per offset j).
        mask_num: k the model was trained with (0: never trained, any k up to MAX_MASK_NUM).
        mask_diff: a distinct mask token per offset.
    """

    token_ids: tuple[int, ...]
    mask_num: int = 0
    mask_diff: bool = False

    def ids_for(self, k: int) -> torch.Tensor:
        """(1,) or (k,) mask ids to lay out k masks per group; see ``Layout.input_ids``."""
        check_mask_num(k, self)
        return torch.tensor(self.token_ids[:k] if self.mask_diff else self.token_ids[:1])


def mask_token_names(mask_num: int, mask_diff: bool) -> list[str]:
    return [f"<|space_mask_{j}|>" for j in range(mask_num)] if mask_diff else [MASK_TOKEN]


def check_mask_num(k: int, spec: MaskSpec | None = None) -> None:
    """Raise ValueError unless 1 <= k <= MAX_MASK_NUM (and k <= the trained k with mask_diff)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:  # True is an int to Python
        raise ValueError(f"mask_num (k) must be an integer >= 1, got {k!r}")
    if k > MAX_MASK_NUM:
        raise ValueError(f"mask_num (k) = {k} exceeds the maximum {MAX_MASK_NUM}")
    if spec is not None and spec.mask_diff and k > len(spec.token_ids):
        raise ValueError(f"this model has {len(spec.token_ids)} per-offset mask tokens (mask_diff); k = {k} is too large")


def warn_untrained_offsets(k: int, spec: MaskSpec, stacklevel: int = 3) -> None:
    """Warn when k exceeds the k a shared mask token was trained for: its offsets past that draft
    untrained (the output is the same, fewer drafts are accepted)."""
    if 0 < spec.mask_num < k:
        warnings.warn(f"mask_num (k) = {k} exceeds the k = {spec.mask_num} this model's mask token was trained for: "
                      f"offsets {spec.mask_num + 1}..{k} draft untrained (the output is the same, fewer drafts are "
                      "accepted)", stacklevel=stacklevel)


def add_mask_tokens(model, tokenizer, mask_num: int, mask_diff: bool = False) -> MaskSpec:
    """Add the mask token(s) to tokenizer and model; idempotent.

    New embedding rows (and untied LM-head rows) start from the mean real-token embedding.
    Records the result in ``model.config.space_mask``, and the mask ids in the model's generation
    config's ``suppress_tokens`` (:func:`suppress_in_generate`). Under DeepSpeed ZeRO-3 (a model partitioned
    at load) the embeddings are gathered for this, so every rank gets the same finite rows as
    without ZeRO-3; it is then a collective: call it on every rank.

    Raises:
        ValueError: mask_num out of range, or mask rows that are not finite.
    """
    check_mask_num(mask_num)
    names = mask_token_names(mask_num, mask_diff)
    # the mask rows this model already has (recorded in its config: a SAR-SFT checkpoint, a second
    # call); a tokenizer that knows the token says nothing of a model's rows (one tokenizer, two models)
    had = set((getattr(model.config, "space_mask", None) or {}).get("token_ids") or ())
    tokenizer.add_special_tokens({"additional_special_tokens": names}, replace_extra_special_tokens=False)
    ids = tokenizer.convert_tokens_to_ids(names)
    # under ZeRO-3 the weights are partitioned at load (shape (0,) on every rank): read the real
    # vocabulary size and the real rows from the gathered weights, never from a partition
    with gathered([model.get_input_embeddings().weight]):
        old_rows = model.get_input_embeddings().weight.shape[0]
    if max(ids) >= old_rows:
        model.resize_token_embeddings(max(ids) + 1, mean_resizing=False)  # transformers gathers under ZeRO-3
    real = min(min(ids), old_rows)  # rows below the first mask id are real tokens
    # only new rows start at the mean: a model that has them (a SAR-SFT checkpoint trained on, a warm
    # start) keeps its trained rows (they were reset, silently)
    new = [i for i in ids if i not in had or i >= old_rows]
    mats = list({id(m): m for m in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)}.values())
    with gathered(mats, modifier_rank=0), torch.no_grad():  # rank 0's rows go to every rank
        for mat in mats if new else ():
            mat[new] = mat[:real].mean(dim=0, keepdim=True).to(mat.dtype)
            if not torch.isfinite(mat[new]).all():
                raise ValueError(f"the new mask rows are not finite (vocabulary {real} real rows of {mat.shape[0]}): "
                                 "are the model's embeddings finite?")
    spec = MaskSpec(tuple(ids), mask_num, mask_diff)
    model.config.space_mask = asdict(spec)
    suppress_in_generate(model, spec)
    return spec


def suppress_in_generate(model, spec: MaskSpec) -> None:
    """Add the mask ids to ``model.generation_config.suppress_tokens`` (kept with any others there),
    so plain HF ``generate()`` never emits a mask token, as SPACE never does (DESIGN §3.7): greedy
    SPACE then equals plain ``generate`` even where a mask token would be the argmax. A model
    without a generation config is left as it is."""
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.suppress_tokens = sorted(set(config.suppress_tokens or ()) | set(spec.token_ids))


def mask_spec(model, tokenizer=None) -> MaskSpec:
    """The model's MaskSpec from its config, or from the tokenizer's mask token.

    Raises:
        ValueError: neither records a mask token (call ``add_mask_tokens`` first).
    """
    recorded = getattr(model.config, "space_mask", None)
    if recorded:
        return MaskSpec(tuple(recorded["token_ids"]), recorded.get("mask_num", 0), recorded.get("mask_diff", False))
    if tokenizer is not None and MASK_TOKEN in tokenizer.get_vocab():
        return MaskSpec((tokenizer.convert_tokens_to_ids(MASK_TOKEN),))
    raise ValueError("model has no SPACE mask token: call space.tokens.add_mask_tokens(model, tokenizer, k) first")
