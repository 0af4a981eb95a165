"""How much a derived format changes a model: measured against its source, never assumed.

Three figures, all teacher-forced so that one disagreement does not derail the rest:
- **agreement**: share of positions where the variant's argmax equals the source's, along the
  source's own greedy continuations of calibration prompts (what greedy decoding would see);
- **kl**: mean KL(source || variant) of the next-token distributions there, in nats;
- **perplexity** of both on a fixed text shipped with the package (`data/perplexity/`), as a
  ratio variant / source, which also sees positions the source would not have chosen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import resources
from typing import Callable, Mapping, Sequence

import numpy as np

from ..decode.loop import Decoder
from ..decode.sampling import SamplingParams
from ..decode.scores import ScoredModel
from ..decode.stats import Stats
from ..llama import LlamaModel

PPL_TEXT = "textwrap.py.txt"   # CPython's Lib/textwrap.py, PSF licence (data/perplexity/LICENSE)
PPL_TOKENS = 512               # tokens of it scored (prefill runs ~40 tok/s for the 1.5B on 2 cores)
WINDOW = 256                   # rows per call: logits for 256 x 151,936 floats = 155 MB


@dataclass
class Quality:
    agreement: float       # teacher-forced top-1 agreement with the source
    kl: float              # mean KL(source || variant) per position, nats
    ppl: float             # variant's perplexity on the fixed text
    ppl_source: float      # the source's
    positions: int         # continuation positions compared

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.ppl_source

    def to_dict(self) -> dict:
        return {**asdict(self), "ppl_ratio": self.ppl_ratio}


Tick = Callable[[], None]  # one unit of work done (a prompt, a model's prompt, a perplexity window)


def greedy_continuations(model: LlamaModel, prompts: Sequence[list[int]], n: int,
                         tick: Tick = lambda: None) -> list[list[int]]:
    """The model's own greedy output for each prompt, made by the decoding loop's `ar` from a cold
    cache (the prompt but its last token prefilled, as the engine does)."""
    decoder = Decoder(ScoredModel(model))
    out = []
    for prompt in prompts:
        model.reset()
        model.seqs[0].prefill(prompt[:-1])
        out.append([c.token for c in decoder.generate(prompt, "ar", SamplingParams(), n, Stats())])
        tick()
    return out


def work_units(prompts: int, variants: int) -> int:
    """The ticks of `greedy_continuations` plus `compare` (for a progress bar)."""
    return prompts + prompts * (1 + variants) + (1 + variants) * (PPL_TOKENS // WINDOW + 1)


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    x = rows - rows.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def compare(source: LlamaModel, variants: Mapping[str, LlamaModel], prompts: Sequence[list[int]],
            continuations: Sequence[list[int]], text: Sequence[int] | None = None,
            tick: Tick = lambda: None) -> dict[str, Quality]:
    """Each variant against `source`: agreement and KL along `continuations` (the source's own,
    see `greedy_continuations`; the source's rows are computed once per prompt), perplexity on
    `text` (default: the shipped text, tokenized by the source)."""
    agree = dict.fromkeys(variants, 0)
    kl = dict.fromkeys(variants, 0.0)
    positions = 0
    for prompt, cont in zip(prompts, continuations):
        if not cont:
            continue
        ctx = list(prompt) + list(cont[:-1])
        source.reset()
        ls = _log_softmax(np.array(source.seqs[0].eval(ctx, len(cont)), dtype=np.float32))
        top, ps = ls.argmax(1), np.exp(ls)
        tick()
        for name, v in variants.items():
            v.reset()
            lv = _log_softmax(np.array(v.seqs[0].eval(ctx, len(cont)), dtype=np.float32))
            agree[name] += int((lv.argmax(1) == top).sum())
            kl[name] += float((ps * (ls - lv)).sum())
            tick()
        positions += len(cont)
    tokens = list(text) if text is not None else ppl_tokens(source)
    base = perplexity(source, tokens, tick)
    n = max(positions, 1)
    return {name: Quality(agree[name] / n, kl[name] / n, perplexity(v, tokens, tick), base, positions)
            for name, v in variants.items()}


def perplexity(model: LlamaModel, tokens: Sequence[int], tick: Tick = lambda: None) -> float:
    """exp(mean negative log-likelihood) of tokens[1:], scored in windows of WINDOW rows."""
    tokens = list(tokens)[: model.n_ctx]
    model.reset()
    nll, count = 0.0, 0
    for start in range(1, len(tokens), WINDOW):
        end = min(start + WINDOW, len(tokens))
        rows = _log_softmax(np.array(model.seqs[0].eval(tokens[:end - 1], end - start), dtype=np.float32))
        nll -= float(rows[np.arange(end - start), tokens[start:end]].sum())
        count += end - start
        tick()
    return float(np.exp(nll / max(count, 1)))


def ppl_tokens(model: LlamaModel, limit: int = PPL_TOKENS) -> list[int]:
    text = resources.files("via_edge").joinpath("data", "perplexity", PPL_TEXT).read_text()
    return model.tokenize(text)[:limit]
