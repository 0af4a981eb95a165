"""The engine's slots: where a generation runs (sequence `index` of every model) and the two ways
generations share them.

With several slots every model holds that many KV sequences; a generation takes the free slot
whose cache shares most of its prompt (a chat's next turn finds its own history), waits while none
is free, and its decodes go through the `Scheduler`, which gathers the slots' calls into shared
batches (batching.py). With one slot, generations from several threads take turns at every token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence, TypeVar

from .batching import BatchedSeq, Scheduler
from .decode.copying import CopyDrafter, CopyFirst, CopyPolicy
from .decode.drafters import Drafter, ModelDrafter
from .decode.modes import mode_info
from .decode.scores import ScoredModel
from .llama import common_prefix
from .loading import Models
from .weights.slim import slice_seq_state

T = TypeVar("T")


@dataclass
class Slot:
    """One generation's place: sequence `index` of every model, and the loop's views of them
    (built as modes need them, then kept: their EOG lookups and the copy drafter's index and
    record carry over to the slot's next generation)."""

    index: int
    scored: dict[str, ScoredModel] = field(default_factory=dict)
    drafters: dict[str, Drafter] = field(default_factory=dict)


class SlotPool:
    def __init__(self, n_slots: int, models: Models) -> None:
        self.models = models
        self.scheduler = Scheduler() if n_slots > 1 else None
        self.slots = [Slot(i) for i in range(n_slots)]
        self._free = list(self.slots)
        self._cv = threading.Condition()
        self._holder: object | None = None  # one slot: the generation whose turn it is, and its thread
        self._holder_thread: int | None = None
        self.busy = 0  # generations under way

    def occupy(self, prompt: Sequence[int], body: Callable[[Slot], Iterator[T]]) -> Iterator[T]:
        """Run `body` on a slot, waiting for one (and, with one slot, for its turn at every step);
        the slot is free again however the iteration ends."""
        me = object()
        slot = self._acquire(prompt, me)
        steps = body(slot)
        try:
            while True:
                if self.scheduler is None:
                    with self._cv:  # the turn may have passed to a newer call of this thread
                        self._take_turn(me)
                item = next(steps, None)
                if item is None:
                    return
                yield item
        finally:
            steps.close()
            self._release(slot, me)

    def _acquire(self, prompt: Sequence[int], me: object) -> Slot:
        with self._cv:
            self.busy += 1
            if self.scheduler is None:
                self._take_turn(me)
                return self.slots[0]
            while not self._free:
                self._cv.wait()
            # ties to the lowest id (with the unified KV buffer the ids' order costs nothing)
            target = self.models.target
            slot = max(self._free, key=lambda s: (common_prefix(target.seqs[s.index].tokens, prompt), -s.index))
            self._free.remove(slot)
        self.scheduler.enter()
        return slot

    def _take_turn(self, me: object) -> None:
        """With one slot, `me` waits while another thread's generation holds it. A generation of
        this same thread holds it only while suspended (a stream left half-read), so `me` takes
        it over rather than wait forever; the other re-syncs the KV cache when it is read again.
        Called holding `_cv`."""
        thread = threading.get_ident()
        while self._holder not in (None, me) and self._holder_thread != thread:
            self._cv.wait()
        self._holder, self._holder_thread = me, thread

    def _release(self, slot: Slot, me: object) -> None:
        if self.scheduler is not None:
            self.scheduler.leave()
        with self._cv:
            self.busy -= 1
            if self.scheduler is not None:
                self._free.append(slot)
                self._cv.notify()
            elif self._holder is me:
                self._holder = self._holder_thread = None
                self._cv.notify_all()

    def scorer(self, slot: Slot, role: str) -> ScoredModel | None:
        """The decoding loop's view of a slot's sequence of a loaded model: direct with one slot,
        through the scheduler with several."""
        model = getattr(self.models, role)
        if model is None:
            return None
        if role not in slot.scored or slot.scored[role].model is not model:
            seq = model.seqs[slot.index]
            slot.scored[role] = ScoredModel(model, seq if self.scheduler is None else BatchedSeq(seq, self.scheduler))
        return slot.scored[role]

    def drafter(self, slot: Slot, mode: str, copy: bool = False) -> Drafter | None:
        """The slot's drafter for `mode`; with `copy` (a request that brings a prediction), copy
        drafting as well in a mode that has none: alone for `ar`, in front of a draft model."""
        kind = mode_info(mode).drafter
        for need in {kind, "lookup" if copy else None} - {None}:
            if need not in slot.drafters:
                slot.drafters[need] = (CopyDrafter(CopyPolicy(self.models.batch_cost), others=self._others)
                                       if need == "lookup" else ModelDrafter(self.scorer(slot, "draft")))
        if kind == "model" and copy:
            return CopyFirst(slot.drafters["lookup"], slot.drafters["model"])
        return slot.drafters.get(kind or ("lookup" if copy else ""))

    def prefill(self, slot: Slot, prompt: list[int], used: list[tuple[str, ScoredModel]], import_slim: bool) -> bool:
        """Fill every used model's KV on `slot` with the prompt. The target (one slot) takes all of
        it in one decode and keeps the last position's logits for the first round (`Seq.prime`);
        the others, and the target under the scheduler, take all but the last token, which each
        round decodes. A prefix slim imports the target's KV instead of recomputing it when
        `import_slim` (see docs/design.md). True when the prompt's decode gave the first token."""
        m, tokens, primed = self.models, prompt[:-1], False
        for role, scored in used:
            seq = scored.model.seqs[slot.index]
            if role == "target" and scored.seq is seq:
                seq.prime(prompt)
                primed = True
            elif not tokens:
                seq.reset()
            elif role == "slim" and m.slim_prefix and import_slim:
                if seq.tokens[:len(tokens)] != tokens:
                    source = m.target.seqs[slot.index]
                    seq.set_state(slice_seq_state(source.state(), m.slim_prefix), source.tokens)
            else:
                scored.seq.prefill(tokens)
        return primed

    def _others(self) -> int:
        """Tokens the other slots add to the target's next decode (none without slots)."""
        return self.scheduler.others(self.models.target) if self.scheduler is not None else 0

    def forget_copies(self) -> None:
        """Drop what the copy drafters indexed (their policy starts each request afresh anyway)."""
        for slot in self.slots:
            slot.drafters.pop("lookup", None)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
