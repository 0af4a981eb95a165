"""`via-edge rpc-serve`: this machine's CPU as an RPC device for another machine's target layers."""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path
from typing import Optional

import typer

from ..errors import ViaEdgeError
from .app import app
from .options import doing, err, is_loopback, shared

WARNING = ("ggml's RPC protocol has no authentication: anyone who can reach this port can run computations on "
           "this machine and read the tensors it holds")


def _ipv4(host: str) -> str:
    """The numeric IPv4 address ggml's RPC server needs (it takes no names and no IPv6)."""
    try:
        return socket.getaddrinfo(host.strip("[]"), None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError):
        raise ViaEdgeError(f"cannot listen on {host}: ggml's RPC server listens on IPv4 addresses only "
                           "(127.0.0.1 for this machine, 0.0.0.0 for every interface with --allow-remote)") from None


@app.command("rpc-serve")
@shared()
def rpc_serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback unless --allow-remote)."),
    port: int = typer.Option(50052, help="Port to listen on."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for the computations (default: all cores)."),
    cache: Optional[Path] = typer.Option(None, help="Folder where the server keeps tensors it was sent, so a "
                                         "client loading the same model again sends hashes instead."),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Listen on a non-loopback address. " + WARNING
                                      + "; use it only on a network you trust."),
) -> None:
    """Serve this machine's CPU to `--rpc HOST:PORT` of generate, chat, serve and bench on another
    machine (llama.cpp's RPC backend): it holds a share of that target's layers."""
    from ..llama import default_threads, rpc

    if not 0 < port < 65536:
        raise ViaEdgeError(f"--port must be in 1..65535, got {port}")
    if threads is not None and threads < 1:
        raise ViaEdgeError(f"--threads must be >= 1, got {threads}")
    if not is_loopback(host) and not allow_remote:
        raise ViaEdgeError(f"refusing to listen on {host}: {WARNING}. Pass --allow-remote to do it anyway")
    named, host = host, _ipv4(host)
    try:  # a busy port or a bad address fails here, with one line, before ggml tries
        with socket.socket(socket.AF_INET) as probe:
            probe.bind((host, port))
    except OSError as exc:
        raise ViaEdgeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    if not rpc.available():
        raise ViaEdgeError("this llama-cpp-python was built without ggml's RPC backend; reinstall with "
                           "tools/install.sh")
    n = threads or default_threads()
    if not is_loopback(host):
        err(f"warning: {WARNING}")
    err(f"via-edge rpc-serve: this machine's CPU ({n} threads, {rpc.free_memory(rpc.cpu_device()) / 2**30:.1f} GiB "
        f"free) on {host}:{port}" + (f" ({named})" if named != host else "")
        + (" (loopback only)" if is_loopback(host) else "") + "; Ctrl-C stops it")
    doing("the RPC server", "nothing was written")
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    server = threading.Thread(target=rpc.serve, args=(host, port, n, str(cache) if cache else None), daemon=True)
    server.start()
    while not stopped.is_set() and server.is_alive():
        stopped.wait(0.5)
    if not stopped.is_set():
        raise ViaEdgeError(f"the RPC server on {host}:{port} stopped (see above)")
    err("via-edge rpc-serve: stopped")
    os._exit(0)  # ggml's server loop never returns: leave without waiting for it
