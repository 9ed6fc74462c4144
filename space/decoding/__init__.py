"""Decoding: the SPACE auto-correct decoder and the AR baseline with the same conventions."""
from .autoregressive import ar_generate
from .config import DEFAULT_MASK_NUM, DecodeConfig
from .result import DecodeResult
from .sampling import SamplingConfig
from .decoder import SpaceDecoder

__all__ = ["DEFAULT_MASK_NUM", "DecodeConfig", "DecodeResult", "SamplingConfig", "SpaceDecoder", "ar_generate"]
