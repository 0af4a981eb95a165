"""OpenAI's Predicted Outputs on the engine: a request's prediction becomes a copy source for the
drafter (never part of the prompt), and once the answer is done, usage counts which of its tokens
the answer holds; prediction and answer then go to the copy memory."""

from __future__ import annotations

import difflib
from typing import Sequence

from .decode.sources import CopySource
from .decode.memory import CopyMemory
from .decode.stats import Stats
from .errors import InvalidParameterError
from .llama import LlamaModel


def prediction_source(model: LlamaModel, prediction: str | Sequence[int] | None) -> CopySource | None:
    """A checked prediction (text, or token ids of `model`), tokenized once; None for none or an
    empty one. Longer than the context window is refused: no answer could hold it."""
    if prediction is None:
        return None
    if isinstance(prediction, str):
        tokens = model.tokenize(prediction, add_special=False, parse_special=False)
    elif all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model.n_vocab for t in prediction):
        tokens = list(prediction)
    else:
        raise InvalidParameterError(f"a prediction must be text or token ids in 0..{model.n_vocab - 1}", "prediction")
    if len(tokens) > model.n_ctx:
        raise InvalidParameterError(f"the prediction has {len(tokens)} tokens but the context window holds "
                                    f"{model.n_ctx}; shorten it or raise n_ctx (--ctx)", "prediction")
    return CopySource("prediction", tokens) if tokens else None


def shared_tokens(prediction: Sequence[int], answer: Sequence[int]) -> int:
    """Tokens of the prediction that appear in the answer, in order (the matching blocks of a
    diff): OpenAI's `accepted_prediction_tokens`, whatever was drafted."""
    matcher = difflib.SequenceMatcher(None, prediction, answer, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def settle(stats: Stats, prediction: CopySource | None, prompt: Sequence[int], answer: Sequence[int],
           memory: CopyMemory) -> None:
    """After a generation: the prediction's accepted and rejected tokens, and what the memory keeps
    (the answer after the end of its prompt)."""
    if prediction is not None:
        stats.prediction_accepted = shared_tokens(prediction.tokens, answer)
        stats.prediction_rejected = len(prediction.tokens) - stats.prediction_accepted
        memory.add(prediction.tokens)
    memory.add(answer, lead=prompt)
