"""Typed errors for user mistakes. The CLI prints their message and exits non-zero, no traceback.

Those llama-cpp-python raises as ValueError (a missing model, bad arguments, a prompt over the
context) are ValueErrors here too, so code written for it catches them unchanged."""


class ViaEdgeError(Exception):
    """Base class: anything a user can fix by changing input, files or flags."""

    exit_code = 2


class ModelFileError(ViaEdgeError, ValueError):
    """A model file is missing, not a GGUF, truncated or fails to load."""


class CatalogError(ViaEdgeError, ValueError):
    """An unknown model or pair name, or a catalog entry that cannot be used."""


class DownloadError(ViaEdgeError):
    """Fetching or verifying a model from its sources failed."""


class IncompatibleModelsError(ViaEdgeError, ValueError):
    """Draft, slim and target cannot be used together (vocabularies differ)."""


class LayerSpecError(ViaEdgeError, ValueError):
    """A slim layer set is empty, out of range, unsorted or repeats a block."""


class InvalidParameterError(ViaEdgeError, ValueError):
    """A sampling, threshold or size parameter is outside its valid range (`param` names it,
    for an API's error object)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextOverflowError(ViaEdgeError, ValueError):
    """The prompt does not fit in the context window."""


class RemoteDeviceError(ViaEdgeError):
    """An RPC server (llama.cpp's ggml-rpc) is unreachable, of another version, or failed mid-decode."""
