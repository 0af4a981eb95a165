"""What users already have: llama-cpp-python's own `Llama`, plain and with prompt-lookup drafting.

Measured on the same prompt tokens, greedy, same context and threads. `Llama.generate` yields
token ids, so fidelity is computed on tokens as for via-edge's modes. Its prefill cannot be timed
apart from the first decode, so `prefill_s` is the time to the first token and the generation
rate counts the tokens after it.

A peer runs in this process (the llama.cpp build via-edge uses) or, given another environment's
Python (`peer_python`), in a child process there: how via-edge on the AMX build is compared with
llama-cpp-python as users install it (the noamx wheel on an AMX machine; its native build crashes
there). The child is `peer_worker.py`, which needs nothing but llama-cpp-python. A peer in this
process runs on via-edge's llama.cpp compute thread: a second OpenMP team would slow both.
"""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path
from typing import Callable

from ..llama import on_compute_thread
from .peer_worker import Generator

PEERS = ("llama-cpp-python", "llama-cpp-python-lookup")


class Peer:
    def __init__(self, name: str, path: Path, n_ctx: int, n_threads: int, python: str | None = None) -> None:
        self.name = name
        args = dict(path=str(path), n_ctx=n_ctx, n_threads=n_threads, lookup=name.endswith("lookup"))
        self._local = on_compute_thread(partial(Generator, **args)) if python is None else None
        self._proc = None
        if python is not None:
            worker = Path(__file__).with_name("peer_worker.py")
            self._proc = subprocess.Popen([python, str(worker), json.dumps(args)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
            self._call({"ping": True})

    def _call(self, request: dict) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.name} exited with code {self._proc.wait()}")
        return json.loads(line)

    def run(self, tokens: list[int], max_tokens: int, is_eog: Callable[[int], bool]) -> dict:
        if self._local is not None:
            return on_compute_thread(self._local.run, tokens, max_tokens, is_eog)
        return self._call({"tokens": tokens, "max_tokens": max_tokens})  # it stops on its own EOG set

    def close(self) -> None:
        if self._local is not None:
            on_compute_thread(self._local.close)
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
