"""ggml's RPC backend: serve this machine's CPU to other processes, or use remote ones as devices.

ggml's RPC protocol has no authentication: whoever reaches a server's port can run computations
on it and read the tensors it holds. ggml also aborts the whole process when a server cannot be
reached or dies mid-decode; so endpoints are checked with a handshake of our own before ggml
sees them, and the abort is caught (`runtime.catch_aborts`): the decode that hit it fails with
`RemoteDeviceError`, the process lives on.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import sys
import threading
from functools import lru_cache
from pathlib import Path

from ..errors import InvalidParameterError, RemoteDeviceError
from .runtime import abandon_compute, backend_init, lib, on_compute_thread

RPC_TIMEOUT = 60.0  # seconds a decode with RPC devices may take before its server counts as gone

DEFAULT_PORT = 50052
RPC_HELLO = 14          # RPC_CMD_HELLO in ggml-rpc.cpp
PROTO_MAJOR = 7         # RPC_PROTO_MAJOR_VERSION of the vendored ggml (ggml/include/ggml-rpc.h)
CAPS = 24               # RPC_CONN_CAPS_SIZE: the hello request; the answer is version (4 bytes) + caps


@lru_cache(maxsize=1)
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL]:
    """libggml-rpc, libggml-base and libggml (the device registry) of the installed llama-cpp-python."""
    folder = Path(lib().__file__).parent / "lib"
    found = [_loaded(folder, name) for name in ("libggml-rpc", "libggml-base", "libggml")]
    if not all(found):
        raise RemoteDeviceError("this llama-cpp-python was built without ggml's RPC backend; reinstall with "
                                "tools/install.sh (it builds with -DGGML_RPC=ON)")
    r, b, g = (ctypes.CDLL(str(path)) for path in found)
    r.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                                ctypes.POINTER(ctypes.c_void_p)]
    r.ggml_backend_rpc_start_server.restype = None
    r.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    r.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    b.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    b.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    b.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    b.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    b.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.POINTER(ctypes.c_size_t)]
    b.ggml_backend_dev_memory.restype = None
    g.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    g.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    return r, b, g


def _loaded(folder: Path, name: str) -> Path | None:
    """The file of `name` the process already uses. Wheels store each library three times (the
    symlinks become copies), and opening another copy would load a second ggml with globals of
    its own (an abort callback set there would never be called)."""
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = Path(line.split(maxsplit=5)[-1]) if line.count(" ") >= 5 else None
            if path is not None and path.parent == folder and path.name.split(".")[0] == name:
                return path
    for candidate in (f"{name}.so.0", f"{name}.0.dylib", f"{name}.dylib", f"{name}.so"):
        if (folder / candidate).exists():
            return folder / candidate
    return None


def available() -> bool:
    try:
        _libs()
        return True
    except RemoteDeviceError:
        return False


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RemoteDeviceError(f"an RPC endpoint is HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def hello(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """The server's protocol version, by the handshake ggml makes first (and would abort on)."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(struct.pack("<BQ", RPC_HELLO, CAPS) + bytes(CAPS))  # no transport upgrade offered
            want = 8 + 4 + CAPS
            got = b""
            while len(got) < want:
                chunk = s.recv(want - len(got))
                if not chunk:
                    break
                got += chunk
    except socket.timeout:
        raise RemoteDeviceError(f"no RPC server answers at {endpoint} within {timeout:g} s (an RPC server serves one "
                                "client at a time: is another using it?)") from None
    except OSError as exc:
        raise RemoteDeviceError(f"no RPC server answers at {endpoint}: {exc.strerror or exc} (start one there "
                                "with `via-edge rpc-serve`)") from None
    if len(got) != 8 + 4 + CAPS:
        raise RemoteDeviceError(f"{endpoint} closed the connection during the RPC handshake: not an RPC server, or "
                                f"one of another protocol version than this build's {PROTO_MAJOR}.x")
    size, major, minor, patch = struct.unpack("<QBBB", got[:11])
    if size != 4 + CAPS:
        raise RemoteDeviceError(f"{endpoint} does not speak this build's RPC protocol ({PROTO_MAJOR}.x)")
    if major != PROTO_MAJOR:
        raise RemoteDeviceError(f"the RPC server at {endpoint} speaks protocol {major}.{minor}.{patch}, this build "
                                f"{PROTO_MAJOR}.x: run the same via-edge / llama.cpp version on both sides")
    return major, minor, patch


def devices(endpoints: list[str]) -> list[int]:
    """ggml device handles of the servers at `endpoints` (each checked first)."""
    r, b, _ = _libs()
    backend_init()
    out = []
    for endpoint in endpoints:
        hello(endpoint)
        reg = r.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise RemoteDeviceError(f"the RPC server at {endpoint} offers no device")
        out += [b.ggml_backend_reg_dev_get(reg, i) for i in range(b.ggml_backend_reg_dev_count(reg))]
    return out


def cpu_device() -> int:
    return _libs()[2].ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU


def free_memory(device: int) -> int:
    b = _libs()[1]
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    b.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
    return free.value


def serve(host: str, port: int, threads: int, cache_dir: str | None) -> None:
    """ggml's RPC server for this machine's CPU; returns only if it cannot start (it says why on stderr)."""
    r = _libs()[0]
    backend_init()
    devs = (ctypes.c_void_p * 1)(cpu_device())
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    r.ggml_backend_rpc_start_server(endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, 1, devs)


_abort_callback = None  # must outlive every abort ggml may report
_failures: list[str] = []


def catch_aborts() -> None:
    """Turn ggml's aborts into errors of the call that hit them, for processes that use RPC devices.

    ggml aborts when an RPC server stops answering (in its dispatcher thread, while the compute
    thread waits for it). The callback says so on stderr, fails the waiting call with
    RemoteDeviceError, moves later llama.cpp calls to a fresh compute thread, and never returns
    (returning would abort the process); the models that used the server refuse further decodes.
    """
    global _abort_callback
    if _abort_callback is not None:
        return
    b = _libs()[1]
    kind = ctypes.CFUNCTYPE(None, ctypes.c_char_p)

    def on_abort(message: bytes) -> None:
        text = (message or b"").decode("utf-8", "replace").strip().split(": ", 1)[-1]  # without ggml's file:line
        _failures.append(text)
        sys.stderr.write(f"via-edge: an RPC device failed: {text}\n")
        abandon_compute(RemoteDeviceError(f"an RPC server stopped answering mid-decode ({text})"))
        threading.Event().wait()

    _abort_callback = kind(on_abort)
    b.ggml_set_abort_callback.argtypes = [kind]
    b.ggml_set_abort_callback.restype = ctypes.c_void_p
    b.ggml_set_abort_callback(_abort_callback)


def failure() -> str | None:
    """Why RPC devices in this process can no longer be used, once one has failed."""
    return _failures[0] if _failures else None


def fail(reason: str) -> None:
    """Mark the RPC devices failed (a decode timed out: its server may never answer)."""
    _failures.append(reason)


class RemoteSplit:
    """Where the layers of a model with RPC servers go. llama.cpp offloads the last `n_gpu_layers`
    blocks to the devices it is given and keeps the rest on this machine's CPU; the offloaded ones
    are split among the devices by `tensor_split`. The shares (this machine's first) come from
    `LoadParams.tensor_split`, or else from each side's free memory, llama.cpp's own default rule
    with this machine counted as one more device. Draft and slim models never use it."""

    def __init__(self, endpoints: tuple[str, ...], tensor_split: tuple[float, ...], n_block: int) -> None:
        catch_aborts()
        # on the compute thread: should ggml abort while connecting, that call fails, not the caller's thread
        try:
            self.devices = on_compute_thread(devices, list(endpoints), timeout=RPC_TIMEOUT)
        except TimeoutError:
            raise RemoteDeviceError(f"the RPC servers {', '.join(endpoints)} did not answer within "
                                    f"{RPC_TIMEOUT:g} s") from None
        n = len(self.devices)
        shares = list(tensor_split) or [free_memory(cpu_device())] + [free_memory(d)
                                                                                   for d in self.devices]
        if len(shares) != n + 1 or any(x < 0 for x in shares) or sum(shares) <= 0:
            raise InvalidParameterError(f"--tensor-split takes {n + 1} shares >= 0, this machine's then one per RPC "
                                        f"device, got {list(tensor_split)}", "tensor_split")
        local = shares[0] / sum(shares)
        # all blocks remote: the output layer too (n_gpu_layers past the block count)
        self.n_remote = n_block + 1 if local == 0 else round(n_block * (1 - local))
        self.shares = shares[1:]

    def apply(self, mp) -> None:
        lc = lib()
        self._devices = (ctypes.c_void_p * (len(self.devices) + 1))(*self.devices, None)  # NULL-terminated
        mp.devices = ctypes.cast(self._devices, ctypes.c_void_p)  # declared void* by the bindings
        mp.n_gpu_layers = self.n_remote
        self._split = (ctypes.c_float * lc.llama_max_devices())(*self.shares)
        mp.tensor_split = ctypes.cast(self._split, ctypes.POINTER(ctypes.c_float))
