"""Chat prompts rendered from the GGUF's own `tokenizer.chat_template` (Jinja, as HF renders it)."""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from .errors import InvalidParameterError

Message = Mapping[str, Any]


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str):
        raise InvalidParameterError(f"chat template refused the messages: {message}")

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str | None,
    messages: Sequence[Message],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages` (and `tools`, for a template that renders them: see
    tools.template_messages); a model without a template gets plain ChatML."""
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise InvalidParameterError("each chat message needs a 'role' and a 'content'")
    if not template:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    return _compile(template).render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **({"tools": list(tools)} if tools else {}),
    )


def chat_tokens(model, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """`messages` through `model`'s chat template, tokenized as the model expects (BOS once)."""
    bos = model.token_bytes(model.bos, special=True).decode("utf-8", "replace") if model.bos >= 0 else ""
    eos = model.token_bytes(model.eos, special=True).decode("utf-8", "replace") if model.eos >= 0 else ""
    text = render_chat(model.chat_template, messages, bos_token=bos, eos_token=eos, tools=tools)
    add_bos = model.add_bos and not (bos and text.startswith(bos))
    return model.tokenize(text, add_special=add_bos, parse_special=True)
