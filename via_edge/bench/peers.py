"""What users already have: llama-cpp-python's own `Llama`, plain and with prompt-lookup drafting.

Measured on the same prompt tokens, greedy, same context and threads. `Llama.generate` yields
token ids, so fidelity is computed on tokens as for via-edge's modes. Its prefill cannot be timed
apart from the first decode, so `prefill_s` is the time to the first token and the generation
rate counts the tokens after it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

PEERS = ("llama-cpp-python", "llama-cpp-python-lookup")


class Peer:
    def __init__(self, name: str, path: Path, n_ctx: int, n_threads: int) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if name.endswith("lookup") else None
        self.name = name
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                         draft_model=draft, logits_all=draft is not None, verbose=False)

    def run(self, tokens: list[int], max_tokens: int, is_eog: Callable[[int], bool]) -> dict:
        self.llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = t0
        for tok in self.llm.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if not out:
                t_first = time.perf_counter()
            out.append(tok)
            if is_eog(tok) or len(out) >= max_tokens:
                break
        t_end = time.perf_counter()
        gen_s = t_end - t_first
        return {"tokens": out, "prefill_s": t_first - t0, "gen_s": gen_s,
                "tok_s": (len(out) - 1) / gen_s if len(out) > 1 and gen_s > 0 else 0.0}

    def close(self) -> None:
        self.llm.close()
