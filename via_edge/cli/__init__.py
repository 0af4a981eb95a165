"""The `via-edge` command line.

app      the application, its command groups, --version, errors turned into exit codes
options  the options commands share, checked before anything loads
run      generate, chat, serve, info
measure  bench, tune
models   models list/rm/prune/pull/path/verify/optimize, slim build
remote   rpc-serve (this machine as an RPC device)
"""

from . import run, measure, models, remote  # noqa: F401, I001  (each registers its commands, in this order of --help)
from .app import app, main
from .options import load_progress

__all__ = ["app", "main", "load_progress"]
