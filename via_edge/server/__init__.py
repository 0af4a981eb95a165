"""`via-edge serve`: the OpenAI-compatible HTTP server (see app.py)."""

from .app import MAX_BODY, bind, create_app, run

__all__ = ["MAX_BODY", "bind", "create_app", "run"]
