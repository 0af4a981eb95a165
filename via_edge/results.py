"""What a generation returns: streamed pieces, the stream itself, the final result, and a batch's results.
The engine makes them; the CLI, the server and `compat` read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from .decode.modes import Mode, Origin, Tier
from .decode.scores import TokenLogprobs
from .decode.stats import Stats


@dataclass(frozen=True)
class Piece:
    """A piece of streamed text and the origin of the token that completed it; with logprobs, the
    entries of the tokens since the previous piece."""

    text: str
    token: int
    origin: Origin
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass
class Result:
    text: str
    tokens: list[int]
    origins: list[Origin]  # per token: draft, slim or target (which model produced it)
    tiers: list[Tier]      # per token: A, B or C (what decided it; see Stats)
    finish_reason: str     # "stop" (EOS or a stop string), "length", "tool_calls" (Engine.chat), or "cancelled" (should_stop, or
    stats: Stats           # the consumer stopped reading the stream)
    mode: Mode
    prompt_tokens: int
    eog: bool = False      # the last token is the end-of-generation token (part of `tokens`, not of `text`)
    logprobs: list[TokenLogprobs] | None = None  # per answer token (not the EOG), when asked for (Engine.stream)
    tool_calls: list[dict] | None = None  # OpenAI-shaped calls, when Engine.chat was given tools

    @property
    def completion_tokens(self) -> int:
        """The tokens of the answer, without the end-of-generation token (OpenAI's usage count)."""
        return len(self.tokens) - self.eog

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "origins": self.origins, "tiers": self.tiers,
                "finish_reason": self.finish_reason, "mode": self.mode,
                "prompt_tokens": self.prompt_tokens, "stats": self.stats.to_dict()}


class Stream:
    """The pieces of one generation as they are committed; `result` once it has ended.

    The result is built in the generator's `finally`, so it is there however the stream ends:
    drained, closed, or read early (reading `result` of a stream still running ends it, with
    finish_reason "cancelled"). The generator holds only the list the result goes into, not the
    stream, so a stream dropped half-read ends (and frees its slot) as soon as it is unreferenced.
    """

    def __init__(self, run: Callable[[list[Result]], Iterator[Piece]], empty: Result) -> None:
        self._box: list[Result] = []
        self._empty = empty  # the result if it is closed before it started
        self._gen = run(self._box)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Piece:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        if not self._box:
            self._box.append(self._empty)

    @property
    def result(self) -> Result:
        if not self._box:
            self.close()
        return self._box[0]

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class BatchResult:
    """The results of `Engine.generate_batch`, in the order of its prompts, and the batch's wall time."""

    results: list[Result]
    seconds: float

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, i: int) -> Result:
        return self.results[i]

    def __iter__(self) -> Iterator[Result]:
        return iter(self.results)

    @property
    def generated_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        """Aggregate throughput: every prompt's tokens over the batch's wall time."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def drain(stream: Stream) -> Result:
    """Read a stream to its end: its result."""
    for _ in stream:
        pass
    return stream.result
