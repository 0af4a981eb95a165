"""`via-edge chat`: an interactive, streaming, multi-turn chat in the terminal.

History is kept within the context window: when the next prompt would not fit, the oldest
turns are dropped (the system message stays) with a notice. Ctrl-C stops the current answer and
keeps the session; Ctrl-D or /exit quits.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

from .decode.modes import COPY, DRAFT, MODE_NAMES, SLIM, TARGET
from .decode.stats import Stats
from .engine import Engine
from .errors import ViaEdgeError

COLOURS = {DRAFT: "\033[32m", COPY: "\033[36m", SLIM: "\033[33m", TARGET: "\033[34m"}
RESET = "\033[0m"
HELP = """commands:
  /stats        speed, acceptance and tier shares for this session
  /reset        forget the conversation
  /mode MODE    switch decoding mode (ar, sd, via, hier, lookup)
  /help         this text
  /exit         quit (Ctrl-D too); Ctrl-C stops an answer and keeps the session"""


class ChatSession:
    def __init__(self, engine: Engine, *, system: str | None = None, max_tokens: int = 512,
                 show_tiers: bool = False, out: TextIO = sys.stdout, **sampling) -> None:
        self.engine, self.max_tokens, self.show_tiers, self.out = engine, max_tokens, show_tiers, out
        self.sampling = sampling
        self.system = system
        self.history: list[dict] = []
        self.stats = Stats()

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    @property
    def room(self) -> int:
        """Prompt tokens that still leave room to answer."""
        n_ctx = self.engine.target.n_ctx
        return n_ctx - min(self.max_tokens, n_ctx // 2)

    def fit(self, text: str) -> list[int] | None:
        """The prompt for `text` after the history, dropping the oldest exchanges until it leaves
        room to answer; None (history untouched) when `text` alone is too long."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        alone = len(self.engine.chat_prompt(head + [{"role": "user", "content": text}]))
        if alone > self.room:
            self.write(f"[not sent: that message is {alone} prompt tokens and leaves no room to answer in the "
                       f"{self.engine.target.n_ctx}-token context (at most {self.room}); shorten it or restart "
                       f"with a larger --ctx. The conversation so far is kept.]\n")
            return None
        self.history.append({"role": "user", "content": text})
        dropped = False
        while len(tokens := self.engine.chat_prompt(self.messages())) > self.room:
            self.history = self.history[2:]  # the oldest exchange; the new message alone fits
            dropped = True
        if dropped:
            self.write("[oldest turns dropped to fit the context window]\n")
        return tokens

    def ask(self, text: str, is_interrupted: Callable[[], bool] | None = None) -> str | None:
        """Answer `text`, streaming; None when it was not sent (too long for the context)."""
        tokens = self.fit(text)
        if tokens is None:
            return None
        if len(tokens) > 256:
            self.write(f"[processing a {len(tokens)}-token prompt…]\r")
        pieces: list[str] = []
        stream = self.engine.stream(tokens, max_tokens=self.max_tokens, should_stop=is_interrupted, **self.sampling)
        for piece in stream:
            pieces.append(piece.text)
            if self.show_tiers:
                self.write(f"{COLOURS.get(piece.origin, '')}{piece.text}{RESET}")
            else:
                self.write(piece.text)
        result = stream.result
        if result.finish_reason == "cancelled":
            self.write("\n[stopped]")
        answer = "".join(pieces)
        self.history.append({"role": "assistant", "content": answer})
        self.stats += result.stats
        self.write("\n")
        return answer

    def command(self, line: str) -> bool:
        """Handle a /command; False means quit."""
        cmd, _, arg = line.strip().partition(" ")
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/help":
            self.write(HELP + "\n")
        elif cmd == "/reset":
            self.history.clear()
            self.stats = Stats()
            self.write("[conversation cleared]\n")
        elif cmd == "/mode":
            if arg not in MODE_NAMES:
                self.write(f"[modes: {', '.join(MODE_NAMES)}]\n")
            else:
                try:
                    self.engine.prepare(arg)
                    self.engine.mode = arg
                    self.write(f"[mode {arg}]\n")
                except ViaEdgeError as exc:
                    self.write(f"[cannot switch: {exc}]\n")
        elif cmd == "/stats":
            self.write(self.stats_text() + "\n")
        else:
            self.write(f"[unknown command {cmd}; /help lists them]\n")
        return True

    def stats_text(self) -> str:
        s = self.stats
        gen = s.generated_tokens or 1
        return (f"[mode {self.engine.mode}] {s.generated_tokens} tokens at {s.tokens_per_second:.1f} tok/s; "
                f"drafted {s.draft_n}, accepted {s.draft_n_accepted} ({s.acceptance_rate:.0%}), "
                f"{s.mean_accepted_per_round:.1f} per round, drafts of {s.mean_draft_length:.1f}; "
                f"copied {s.copied_tokens} ({s.copied_tokens / gen:.0%}); "
                f"tiers A {s.tier_a / gen:.0%} B {s.tier_b / gen:.0%} C {s.tier_c / gen:.0%}")

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def run(engine: Engine, **kwargs) -> None:
    session = ChatSession(engine, **kwargs)
    session.write(f"via-edge chat: {engine.model_name}, mode {engine.mode}, {engine.format} weights. "
                  "/help for commands, Ctrl-D to quit.\n")
    while True:
        try:
            line = input("> ")
        except EOFError:
            session.write("\n")
            return
        except KeyboardInterrupt:
            session.write("\n")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            if not session.command(line):
                return
            continue
        with sigint_flag() as interrupted:
            session.ask(line, interrupted)


@contextmanager
def sigint_flag() -> Iterator[Callable[[], bool]]:
    """Ctrl-C during an answer sets a flag the decoding loop polls, instead of raising inside it
    (an exception between a llama_decode and its bookkeeping would desync the KV cache)."""
    hit = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda _sig, _frame: hit.set())
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)
