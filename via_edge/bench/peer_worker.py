"""llama-cpp-python's `Llama` generating greedily, in this process or as a child process of the
benchmark in another environment (`python peer_worker.py ARGS_JSON`, then one JSON request per
line on stdin, one result per line on stdout). Imports nothing of via-edge."""

from __future__ import annotations

import json
import sys
import time
from typing import Callable


class Generator:
    def __init__(self, path: str, n_ctx: int, n_threads: int, lookup: bool) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
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
                # every token over the span after the first, as via-edge counts (one token: no span)
                "tok_s": len(out) / gen_s if len(out) > 1 and gen_s > 0 else 0.0}

    def close(self) -> None:
        self.llm.close()


def main() -> None:
    import llama_cpp

    gen = Generator(**json.loads(sys.argv[1]))
    vocab = llama_cpp.llama_model_get_vocab(gen.llm.model)

    def is_eog(tok: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(vocab, tok))

    for line in sys.stdin:
        request = json.loads(line)
        result = {"ok": True} if request.get("ping") else gen.run(request["tokens"], request["max_tokens"], is_eog)
        print(json.dumps(result), flush=True)
    gen.close()


if __name__ == "__main__":
    main()
