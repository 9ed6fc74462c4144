"""SPACE: Smart Parallel Auto-Correct dEcoding (Yi et al., arXiv 2402.11809) for HF causal LMs.

The public names below load on first use (PEP 562), so ``import space`` and every ``space-*
--help`` stay fast: torch and transformers are imported only by what needs them.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "load_space": ".loader", "prepare_model": ".adapter_layers",
    "DecodeConfig": ".decoding", "DecodeResult": ".decoding", "SamplingConfig": ".decoding",
    "SpaceDecoder": ".decoding", "ar_generate": ".decoding",
    "load_model": ".models",
    "MaskSpec": ".tokens", "add_mask_tokens": ".tokens", "mask_spec": ".tokens",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'space' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
