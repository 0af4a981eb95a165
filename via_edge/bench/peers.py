"""What users already have: llama-cpp-python's own `Llama`, plain and with prompt-lookup drafting,
and llama.cpp's own `llama-server`, plain, with its default n-gram drafting (`--spec-default`,
ngram-mod) and with `--spec-type ngram-simple`.

Measured on the same prompt tokens, greedy, same context and threads. `Llama.generate` yields
token ids, so fidelity is computed on tokens as for via-edge's modes. Its prefill cannot be timed
apart from the first decode, so `prefill_s` is the time to the first token and the generation
rate is every token over the time after it, as via-edge counts its own (the first token comes
with the prompt in both).

A peer runs in this process (the llama.cpp build via-edge uses) or, given another environment's
Python (`peer_python`), in a child process there: how via-edge on the AMX build is compared with
llama-cpp-python as users install it (the noamx wheel on an AMX machine; its native build crashes
there). The child is `peer_worker.py`, which needs nothing but llama-cpp-python. A peer in this
process runs on via-edge's llama.cpp compute thread: a second OpenMP team would slow both.

`llama-server` is the binary `tools/build_llama_server.sh` builds from the same vendored llama.cpp,
flags and patch as the installed flavor (or `VIA_EDGE_LLAMA_SERVER`). It runs as a process of its
own on loopback for the whole benchmark (on Linux it ends with the benchmark even when that dies
without closing it), one slot, no prompt cache across requests; its decode
speed comes from the server's own `timings`: every generated token over the time from the first
to the last (`predicted_n / predicted_ms`), as via-edge's `tokens_per_second` counts them. The
server's `predicted_per_second` leaves the first token out of the count (it comes with the prompt)
over the same span, which made a peer look n/(n-1) slower than via-edge for the same decodes
(docs/benchmarks.md section 59).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Callable

from ..errors import ViaEdgeError
from ..llama import on_compute_thread
from .peer_worker import Generator

DEFAULT_PEERS = ("llama-cpp-python", "llama-cpp-python-lookup")  # what `bench` runs unless told
SERVER_PEERS = {"llama-server": (), "llama-server-ngram": ("--spec-default",),  # name -> extra flags
                "llama-server-ngram-simple": ("--spec-type", "ngram-simple")}
PEERS = DEFAULT_PEERS + tuple(SERVER_PEERS)
BUILD_SERVER = Path(__file__).resolve().parents[2] / "tools" / "build_llama_server.sh"


def make_peer(name: str, path: Path, n_ctx: int, n_threads: int, python: str | None, eos: int) -> "Peer | ServerPeer":
    """A peer by name; "<peer>@<format>" is the same peer reading `path` in that format."""
    base = name.partition("@")[0]
    peer = ServerPeer(base, path, n_ctx, n_threads, eos) if base in SERVER_PEERS else \
        Peer(base, path, n_ctx, n_threads, python)
    peer.name = name
    return peer


def server_binary() -> Path | None:
    """The llama-server built for this checkout's llama.cpp flavor, if it has been built."""
    given = os.environ.get("VIA_EDGE_LLAMA_SERVER")
    if given:
        return Path(given) if Path(given).is_file() else None
    if not BUILD_SERVER.exists():
        return None
    out = subprocess.run(["bash", str(BUILD_SERVER), "--print"], capture_output=True, text=True)
    path = Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None
    return path if path is not None and path.is_file() else None


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


def server_tokens(out: dict, eos: int, is_eog: Callable[[int], bool]) -> list[int]:
    """The answer's tokens from a `/completion` response, ending with the end-of-generation token
    when it stopped on one, as via-edge's answers do: the server lists it in `tokens` for some
    models (Qwen2.5's `<|im_end|>`) and not for others."""
    got = list(out["tokens"])
    if out.get("stop_type") == "eos" and not (got and is_eog(got[-1])):
        got.append(eos)
    return got


def with_parent() -> list[str]:
    """The prefix that ends a server with the thread that started it, on Linux (util-linux's
    `setpriv --pdeathsig`, which then runs the server in its own place): a benchmark killed or
    aborted inside llama.cpp never calls `close`, and the server would hold its model's memory."""
    return ["setpriv", "--pdeathsig", "TERM", "--"] if sys.platform == "linux" and shutil.which("setpriv") else []


class ServerPeer:
    """llama.cpp's llama-server on the same GGUF, greedy, one request at a time. Start it on a
    thread that outlives it (on Linux the server ends with that thread: `with_parent`)."""

    def __init__(self, name: str, path: Path, n_ctx: int, n_threads: int, eos: int, timeout: float = 180) -> None:
        binary = server_binary()
        if binary is None:
            raise ViaEdgeError(f"peer {name}: llama-server is not built here; run `bash tools/build_llama_server.sh` "
                               "once (a few minutes), or set VIA_EDGE_LLAMA_SERVER to a llama-server binary")
        self.name, self.eos = name, eos
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        args = [*with_parent(), str(binary), "-m", str(path), "-c", str(n_ctx), "-t", str(n_threads),
                "-tb", str(n_threads), "-np", "1", "--host", "127.0.0.1", "--port", str(port), *SERVER_PEERS[name]]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ViaEdgeError(f"peer {name}: llama-server exited at start: {self._proc.stderr.read()[-1500:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.close()
        raise ViaEdgeError(f"peer {name}: llama-server did not become ready within {timeout:g} s")

    def run(self, tokens: list[int], max_tokens: int, is_eog: Callable[[int], bool]) -> dict:
        body = {"prompt": tokens, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "seed": 0}
        req = urllib.request.Request(self.base + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        got = server_tokens(out, self.eos, is_eog)
        t = out["timings"]
        # predicted_per_second is (predicted_n - 1) / predicted_ms (the first token comes with the
        # prompt); via-edge counts every generated token over the same span, and so does this
        return {"tokens": got, "prefill_s": t["prompt_ms"] / 1e3, "gen_s": t["predicted_ms"] / 1e3,
                "tok_s": t["predicted_n"] / (t["predicted_ms"] / 1e3) if t["predicted_n"] > 1 else 0.0,
                "draft_n": t.get("draft_n", 0),
                "draft_n_accepted": t.get("draft_n_accepted", 0)}

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
