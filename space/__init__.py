"""SPACE: Smart Parallel Auto-Correct dEcoding (Yi et al., arXiv 2402.11809) for HF causal LMs."""
from .adapters import load_space, prepare_model
from .decoding import DecodeConfig, DecodeResult, SamplingConfig, SpaceDecoder, ar_generate
from .models import load_model
from .tokens import MaskSpec, add_mask_tokens, mask_spec

__all__ = ["DecodeConfig", "DecodeResult", "MaskSpec", "SamplingConfig", "SpaceDecoder", "add_mask_tokens", "ar_generate",
           "load_model", "load_space", "mask_spec", "prepare_model"]
