"""Decoding: the SPACE auto-correct decoder and the AR baseline with the same conventions."""
from .autoregressive import ar_generate
from .result import DecodeResult
from .sampling import SamplingConfig
from .space import SpaceDecoder

__all__ = ["DecodeResult", "SamplingConfig", "SpaceDecoder", "ar_generate"]
