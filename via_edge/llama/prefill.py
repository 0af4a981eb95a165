"""Long prompts decoded on a second copy of a model, loaded without weight repacking.

llama.cpp repacks quantized weights for its CPU kernels: one-token decodes run faster on the
repacked layout, but on some CPUs its batched kernels run slower than the plain layout's (an AMD
EPYC: prompts 1.4x faster unrepacked, one-token decodes 1.3x slower; docs/benchmarks.md section
61). A `Prefiller` decodes a long prompt on the unrepacked copy and hands the KV cache over to
the repacked model, which then generates. The copy maps the model's file, or for a derived
weight format the shipped file it was made from (same architecture and vocabulary, the weights
the format approximates: there its prompt kernels can be the faster ones, section 64), and has
a context of its own, one sequence as long as one of the model's: the model's slots take turns
on it. Its weights count again in resident memory as the file's pages (1.3 GB more for the 1.5B
target), which is why it is kept only where it pays (decode/costs.prompt_helper). The answer is
the model's, computed with other kernels (or the source's weights) for the prompt: greedy
answers agree with the model's own prefill up to near-ties, as batched and single decodes do.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from .model import LlamaModel
from .sequence import Seq, common_prefix

MIN_TOKENS = 64  # shorter new parts stay on the model (at 64 the copy is 1.11-1.19x faster, section 65)


class Prefiller:
    """The unrepacked copy of `model` and the hand-over of its KV cache to any of its sequences."""

    def __init__(self, model: LlamaModel, source: Path | None = None) -> None:
        """`source`: the file a derived format was made from (weights.formats.source_file), loaded
        in place of the model's own."""
        self.min_tokens = MIN_TOKENS
        one_seq = dict(n_seq=1, n_ctx=model.seqs[0].n_ctx, kv_unified=False)
        self.helper = LlamaModel(source or model.path, replace(model.params, use_extra_bufts=False,
                                                               prefill_helper=False, **one_seq))
        self._turn = threading.Lock()  # the copy's one sequence serves one slot at a time
        self._scratch = np.empty(0, dtype=np.uint8)  # the hand-overs' buffer, kept (llama/model.kv_state)

    def prime(self, seq: Seq, tokens: Sequence[int], keep: int, last: bool = True) -> np.ndarray | None:
        """Make `seq` hold exactly `tokens`, its first `keep` already there, decoding the rest on
        the copy; with `last`, the last position's logits."""
        with self._turn:
            h = self.helper.seqs[0]
            if keep == 0:
                h.reset()
            elif common_prefix(h.tokens, tokens) < keep:  # the copy lacks the kept prefix: take the model's
                h.set_state(self._state(seq), seq.tokens)
            h.truncate(keep)
            before = replace(h.usage)
            rows = h.decode(tokens[keep:], "last" if last else "none")
            logits = np.array(rows) if last else None  # a copy: the next decode reuses the buffer
            seq.set_state(self._state(h), tokens)
            spent = h.usage.since(before)  # the prompt's decode counts as the model's own work
            spent.helped = spent.tokens
        seq.usage.add(spent)
        with seq.model.lock:  # the model's other slots tally their decodes meanwhile
            seq.model.usage.add(spent)
        return logits

    def _state(self, seq: Seq) -> memoryview:
        """`seq`'s state in the kept buffer, grown when too small."""
        size = seq.state_size()
        if len(self._scratch) < size:
            self._scratch = np.empty(size, dtype=np.uint8)
        return seq.state(self._scratch)

    def close(self) -> None:
        self.helper.close()
