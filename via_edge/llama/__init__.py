"""The llama.cpp adapter: the only package that touches ctypes.

runtime   the library, its log and the one thread that runs every load and decode
model     a loaded GGUF with one context (LoadParams, LlamaModel, batched decodes)
sequence  one KV sequence of that context and its token bookkeeping (Seq)
grammar   llama.cpp's grammar sampler as a state (constrained decoding)
capture   intermediate tensors of a decode (slim verifiers' calibration)
quantize  llama_model_quantize, for derived weight formats
"""

from .grammar import GrammarState
from .model import EXACT, EXACT_F32, MAX_SEQ, LlamaModel, LoadParams
from .quantize import quantize
from .runtime import default_threads, extra_bufts_default, on_compute_thread, system_info
from .sequence import Seq, common_prefix, reuse_point, row_indices

__all__ = ["EXACT", "EXACT_F32", "MAX_SEQ", "GrammarState", "LlamaModel", "LoadParams", "Seq", "common_prefix", "default_threads",
           "extra_bufts_default", "on_compute_thread", "quantize", "reuse_point", "row_indices", "system_info"]
