"""via-edge: speculative decoding with intra-model routing (VIA-SD) for local LLMs on llama.cpp."""

from .spec import SpecParams
from .engine import Engine, Request
from .results import Piece, Result, Stream
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
from .sampling import SamplingParams
from .stats import Stats
from .version import VERSION as __version__

__all__ = [
    "__version__",
    "Engine", "Request", "Stream", "Piece", "Result", "SpecParams", "SamplingParams", "Stats",
    "ViaEdgeError", "ModelFileError", "CatalogError", "DownloadError", "IncompatibleModelsError",
    "LayerSpecError", "InvalidParameterError", "ContextOverflowError",
]
