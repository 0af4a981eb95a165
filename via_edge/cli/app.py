"""The `via-edge` application: its command groups, --version, and the one place errors become exit codes.

User errors print one line and exit 2, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from ..errors import ViaEdgeError
from .options import activity, err

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="Speculative decoding with intra-model routing (VIA-SD) on llama.cpp.")
models_app = typer.Typer(no_args_is_help=True, help="Known models: list, pull, path, verify, optimize, rm, prune.")
slim_app = typer.Typer(no_args_is_help=True, help="Slim verifiers: derived GGUFs of a target's blocks.")
app.add_typer(models_app, name="models")
app.add_typer(slim_app, name="slim")


def _version(value: bool) -> None:
    if value:
        from ..machine import build, versions

        v = versions()
        typer.echo(f"via-edge {v['via_edge']} (llama-cpp-python {v['llama-cpp-python']}, "
                   f"llama.cpp {build()['flavor']} build)")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and the llama.cpp build, then exit.")) -> None:
    """Speculative decoding with intra-model routing (VIA-SD) on llama.cpp."""



def main() -> None:
    try:
        app()
    except ViaEdgeError as exc:
        err(f"error: {exc}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err(f"\ninterrupted: {activity['doing']} stopped; {activity['kept']}")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
