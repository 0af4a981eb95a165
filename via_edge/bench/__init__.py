"""The benchmark: interleaved speed and fidelity of every decoding mode and of llama-cpp-python."""

from .report import compare, load_results, summarize, write_outputs
from .peers import DEFAULT_PEERS, PEERS
from .runner import QUICK, BenchConfig, run_bench

__all__ = ["BenchConfig", "DEFAULT_PEERS", "PEERS", "QUICK", "run_bench", "summarize", "write_outputs", "load_results", "compare"]
