"""llama-cpp-python's `Llama` on a via-edge engine: existing code switches by changing one import.
The response shapes themselves are openai_api/responses.py's."""

from __future__ import annotations

import fnmatch
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .decode.modes import DEFAULT_MODE
from .engine import Engine
from .errors import CatalogError, InvalidParameterError
from .llama import LlamaModel, LoadParams
from .openai_api.responses import create_chat_completion, create_completion
from .weights import catalog

# llama-cpp-python's constructor: knobs of speed or logging only, taken whatever their value...
_LOAD_SPEED_ONLY = ("n_batch", "n_ubatch", "n_threads_batch", "use_mmap", "use_mlock", "numa", "verbose",
                    "no_perf", "op_offload", "offload_kqv", "main_gpu", "split_mode", "tensor_split",
                    "last_n_tokens_size", "swa_full")
# ...and those that change results, taken only at their defaults (anything else is refused by name)
_LOAD_NEUTRAL = dict(vocab_only=False, kv_overrides=None, rope_scaling_type=-1, pooling_type=-1,
                     attention_type=-1, rope_freq_base=0.0, rope_freq_scale=0.0, yarn_ext_factor=-1.0,
                     yarn_attn_factor=1.0, yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_orig_ctx=0,
                     logits_all=False, lora_base=None, lora_scale=1.0, lora_path=None,
                     chat_handler=None, draft_model=None, tokenizer=None, type_k=None,
                     type_v=None, spm_infill=False)


LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama-cpp-python's "random seed"
DEFAULT_CHAT_FORMAT = "chat_template.default"  # llama-cpp-python's name for the GGUF's own template


class LlamaState:
    """What `save_state` returns: the cached tokens and their KV (llama-cpp-python's field names;
    `scores` stays empty: via-edge keeps no logits of the prompt)."""

    def __init__(self, input_ids: np.ndarray, n_tokens: int, llama_state: bytes, seed: int | None) -> None:
        self.input_ids, self.n_tokens, self.seed = input_ids, n_tokens, seed
        self.llama_state, self.llama_state_size = llama_state, len(llama_state)
        self.scores = np.zeros((0, 0), dtype=np.single)


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
                 n_gpu_layers: int = 0, seed: int | None = None, chat_format: str | None = None,
                 embedding: bool = False, flash_attn: bool | None = None, mode: str | None = None,
                 engine: Engine | None = None, **kwargs) -> None:
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
        self.metadata: dict[str, str] = engine.target.metadata()
        self.chat_format = self._chat_format(chat_format)
        self.cache: Any = None
        # flash attention off unless asked for, as llama-cpp-python has it: the vectors then match theirs
        self._embedder = LlamaModel(engine.target_path, replace(
            engine.load, n_seq=1, kv_unified=False, embeddings=True,
            flash_attn=bool(flash_attn))) if embedding else None

    def _chat_format(self, asked: str | None) -> str:
        """llama-cpp-python's name for the chat format in use. via-edge formats chats with the
        GGUF's own template, so a format asked for must be that template's."""
        from llama_cpp.llama_chat_format import guess_chat_format_from_gguf_metadata

        own = ((guess_chat_format_from_gguf_metadata(self.metadata) or DEFAULT_CHAT_FORMAT)
               if "tokenizer.chat_template" in self.metadata else None)
        if asked is not None and asked not in (own, DEFAULT_CHAT_FORMAT):
            raise InvalidParameterError(f"Llama(): chat_format={asked!r} is not supported: via-edge formats chats "
                                        f"with the model's own template ({own or 'none in this GGUF'})")
        if own is None:
            raise InvalidParameterError("Llama(): this GGUF has no chat template; via-edge needs one for chats")
        return asked or own

    @classmethod
    def from_pair(cls, name: str | None = None, **kwargs) -> "Llama":
        return cls(engine=Engine.from_pair(name, **kwargs))

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str, **kwargs) -> "Llama":
        """A catalog model by its Hugging Face repository and file name (a glob, as llama-cpp-python
        takes it), fetched the way `via-edge models pull` fetches it (Hugging Face, else PyPI)."""
        for e in catalog.entries():
            hf = e.spec.get("huggingface", {})
            if hf.get("repo") == repo_id and fnmatch.fnmatch(hf.get("file", e.file), filename):
                return cls(str(catalog.resolve(e.name, pull_missing=True)), **kwargs)
        raise CatalogError(f"Llama.from_pretrained: {repo_id} / {filename} is not in via-edge's catalog "
                           "(`via-edge models list`); download the GGUF and pass model_path=")

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
        if self.cache is not None:
            self._from_cache(prompt)
        out = create_completion(self.engine, prompt, **self._seeded(kwargs))
        if self.cache is not None and not kwargs.get("stream"):
            self._to_cache()
        return out

    def reset(self) -> None:
        """Forget the cached prompt: the next call prefills from the start."""
        self.engine.reset()

    def save_state(self) -> LlamaState:
        """The cached tokens and their KV, to `load_state` later (this process)."""
        seq = self.engine.target.seqs[0]
        return LlamaState(np.array(seq.tokens, dtype=np.intc), len(seq.tokens), bytes(seq.state()), self.seed)

    def load_state(self, state: LlamaState) -> None:
        """Restore a saved state: a prompt that starts with its tokens reuses their KV."""
        self.engine.reset()
        self.engine.target.seqs[0].set_state(state.llama_state, [int(t) for t in state.input_ids[:state.n_tokens]])
        if state.seed is not None:
            self.seed = state.seed

    def set_cache(self, cache: Any) -> None:
        """A prompt cache as llama-cpp-python takes it (`LlamaRAMCache`, `LlamaDiskCache`, or any
        mapping of token tuples to states with its longest-prefix lookup): before a completion the
        longest cached prefix of its prompt is loaded, after it the new state is stored."""
        self.cache = cache

    def _from_cache(self, prompt: str | Sequence[int]) -> None:
        tokens = self.tokenize(prompt.encode()) if isinstance(prompt, str) else list(prompt)
        try:
            state = self.cache[tokens]
        except KeyError:
            return
        if isinstance(state, LlamaState):
            self.load_state(state)

    def _to_cache(self) -> None:
        state = self.save_state()
        self.cache[state.input_ids.tolist()] = state

    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,
              return_count: bool = False):
        """Embeddings as llama-cpp-python returns them: per input one vector, or one per token
        for a model that pools nothing; needs `embedding=True`."""
        if self._embedder is None:
            raise RuntimeError("Llama model must be created with embedding=True to call this method")
        inputs = [input] if isinstance(input, str) else list(input)
        out, count = [], 0
        for text in inputs:
            tokens = self.tokenize(text.encode("utf-8"))
            if len(tokens) > self._embedder.n_batch:
                if not truncate:
                    raise InvalidParameterError(f"Requested tokens ({len(tokens)}) exceed batch size of "
                                                f"{self._embedder.n_batch}")
                tokens = tokens[: self._embedder.n_batch]
            vec = self._embedder.embed(tokens)
            if normalize:
                vec = vec / np.maximum(np.linalg.norm(vec, axis=-1, keepdims=True), 1e-12)
            out.append(vec.tolist())
            count += len(tokens)
        out = out[0] if isinstance(input, str) else out
        return (out, count) if return_count else out

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict:
        embeds, total = self.embed(input if isinstance(input, list) else [input], return_count=True)
        return {"object": "list", "model": model or self.model_path,
                "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(embeds)],
                "usage": {"prompt_tokens": total, "total_tokens": total}}

    __call__ = create_completion

    def create_chat_completion(self, messages: Sequence[Mapping[str, str]], **kwargs) -> dict | Iterator[dict]:
        return create_chat_completion(self.engine, messages, **self._seeded(kwargs))

    def close(self) -> None:
        self.engine.close()
        if self._embedder is not None:
            self._embedder.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
