"""via-edge: speculative decoding with intra-model routing (VIA-SD) for local LLMs on llama.cpp."""

from .decode.sampling import SamplingParams
from .decode.spec import SpecParams
from .decode.stats import Stats
from .engine import Engine, Request
from .errors import (
    CatalogError,
    ContextOverflowError,
    DownloadError,
    IncompatibleModelsError,
    InvalidParameterError,
    LayerSpecError,
    ModelFileError,
    ViaEdgeError,
)
from .results import Piece, Result, Stream
from .version import VERSION as __version__

__all__ = [
    "__version__",
    "Engine", "Request", "Stream", "Piece", "Result", "SpecParams", "SamplingParams", "Stats",
    "ViaEdgeError", "ModelFileError", "CatalogError", "DownloadError", "IncompatibleModelsError",
    "LayerSpecError", "InvalidParameterError", "ContextOverflowError",
]
