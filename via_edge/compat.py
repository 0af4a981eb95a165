"""llama-cpp-python's `Llama` on a via-edge engine: existing code switches by changing one import.
The response shapes themselves are openai_api/responses.py's."""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

from .decode.modes import DEFAULT_MODE
from .engine import Engine
from .errors import InvalidParameterError
from .llama import LoadParams
from .openai_api.responses import create_chat_completion, create_completion

# llama-cpp-python's constructor: knobs of speed or logging only, taken whatever their value...
_LOAD_SPEED_ONLY = ("n_batch", "n_ubatch", "n_threads_batch", "use_mmap", "use_mlock", "numa", "verbose",
                    "no_perf", "op_offload", "offload_kqv", "main_gpu", "split_mode", "tensor_split",
                    "last_n_tokens_size", "swa_full")
# ...and those that change results, taken only at their defaults (anything else is refused by name)
_LOAD_NEUTRAL = dict(vocab_only=False, kv_overrides=None, rope_scaling_type=-1, pooling_type=-1,
                     attention_type=-1, rope_freq_base=0.0, rope_freq_scale=0.0, yarn_ext_factor=-1.0,
                     yarn_attn_factor=1.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_orig_ctx=0,
                     logits_all=False, embedding=False, lora_base=None, lora_scale=1.0, lora_path=None,
                     chat_format=None, chat_handler=None, draft_model=None, tokenizer=None, type_k=None,
                     type_v=None, spm_infill=False)


LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama-cpp-python's "random seed"


class Llama:
    """llama-cpp-python's `Llama` on a via-edge engine: code written for it switches by changing
    its import.

        from via_edge.compat import Llama                         # was: from llama_cpp import Llama
        llm = Llama(model_path="model.gguf", n_ctx=2048)          # or Llama.from_pair("qwen2.5-coder")
        llm("def fib(n):", max_tokens=64)["choices"][0]["text"]

    Generation runs in via-edge's default mode (`mode=` picks another); grammars, response_format,
    tools and logprobs as the server takes them. What via-edge does not do (logit_bias, penalties,
    a draft_model of theirs, ...) is refused with a ValueError naming the argument, never ignored.
    """

    def __init__(self, model_path: str | None = None, *, n_ctx: int = 512, n_threads: int | None = None,
                 n_gpu_layers: int = 0, seed: int | None = None,
                 flash_attn: bool | None = None, mode: str | None = None, engine: Engine | None = None,
                 **kwargs) -> None:
        for key, value in kwargs.items():
            if key in _LOAD_SPEED_ONLY:
                continue
            if key not in _LOAD_NEUTRAL:
                raise InvalidParameterError(f"Llama(): unknown argument '{key}'")
            if value != _LOAD_NEUTRAL[key]:
                raise InvalidParameterError(f"Llama(): '{key}' is not supported by via-edge (got {value!r})")
        if engine is None:
            if model_path is None:
                raise InvalidParameterError("Llama() needs model_path (or use Llama.from_pair)")
            engine = Engine(model_path, mode=mode or DEFAULT_MODE, load=LoadParams(
                n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn))
        self.engine = engine
        self.model_path = str(engine.target_path)
        self.seed = None if seed == LLAMA_DEFAULT_SEED else seed  # for sampled calls that give none

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> "Llama":
        return cls(engine=Engine.from_pair(name, **kwargs))

    def n_ctx(self) -> int:
        return self.engine.target.n_ctx

    def n_vocab(self) -> int:
        return self.engine.target.n_vocab

    def token_eos(self) -> int:
        return self.engine.target.eos

    def token_bos(self) -> int:
        return self.engine.target.bos

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.engine.target.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        return b"".join(self.engine.target.token_bytes(t, special=special) for t in tokens)

    def _seeded(self, kwargs: dict) -> dict:
        if kwargs.get("seed") is None and self.seed is not None:
            kwargs["seed"] = self.seed
        return kwargs

    def create_completion(self, prompt: str | Sequence[int], **kwargs) -> dict | Iterator[dict]:
        return create_completion(self.engine, prompt, **self._seeded(kwargs))

    __call__ = create_completion

    def create_chat_completion(self, messages: Sequence[Mapping[str, str]], **kwargs) -> dict | Iterator[dict]:
        return create_chat_completion(self.engine, messages, **self._seeded(kwargs))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
