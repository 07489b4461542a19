"""Chat templates: the Jinja templates that turn a conversation into text, as Hugging Face tokenizers ship them.

``load_template`` finds a tokenizer's template (or ChatML, ``DEFAULT_TEMPLATE``), ``render`` renders a conversation
the way ``transformers``' ``apply_chat_template`` does, and ``segments`` cuts the rendering into the pieces a model
is trained on (the assistant turns) and the pieces it only reads.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

from trainer.codec import EOS_TOKEN

DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML: each turn between ``<|im_start|>ROLE\\n`` and ``<|im_end|>\\n``; the template of a tokenizer without one."""

TEMPLATE_FILE = "chat_template.jinja"
"""The file name a tokenizer directory (and a prepared data directory) keeps its template under."""


def load_template(tokenizer_spec: str, override_path: str | Path | None = None) -> tuple[str, dict]:
    """The chat template of a tokenizer and the variables it is rendered with.

    Looked for in this order: ``override_path``; the tokenizer directory's ``chat_template.jinja``; its
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name, template}`` of which the one named
    ``default``); else ``DEFAULT_TEMPLATE``. A tokenizer directory is the directory named by ``tokenizer_spec`` or the
    one holding the ``tokenizer.json`` it names; ``bpe:N`` and ``tiktoken:NAME`` have none.

    Args:
        tokenizer_spec: the ``--tokenizer`` of ``trainer prepare``.
        override_path: a ``.jinja`` file (``--chat-template``), or None.

    Returns:
        ``(template, variables)``: ``variables`` holds ``bos_token`` and ``eos_token`` where they are known (from
        tokenizer_config.json, or ``<|endoftext|>`` for ``bpe:N`` and tiktoken encodings).

    Raises:
        FileNotFoundError: ``override_path`` does not exist.
        ValueError: a tokenizer_config.json whose ``chat_template`` is neither a string nor a list holding a
            ``default`` template.
    """
    d = _tokenizer_dir(tokenizer_spec)
    config = _read_config(d / "tokenizer_config.json") if d is not None else {}
    variables = {}
    for name in ("bos_token", "eos_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            variables[name] = token
    if tokenizer_spec.startswith(("bpe:", "tiktoken:")):
        variables["eos_token"] = EOS_TOKEN
    if override_path is not None:
        path = Path(override_path)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {override_path}: no such file")
        return path.read_text(encoding="utf-8"), variables
    if d is not None and (d / TEMPLATE_FILE).is_file():
        return (d / TEMPLATE_FILE).read_text(encoding="utf-8"), variables
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise ValueError(
                f"tokenizer {tokenizer_spec}: tokenizer_config.json lists chat templates named "
                f"{', '.join(map(str, named)) or 'nothing'} but none named 'default'; pass --chat-template PATH"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(
            f"tokenizer {tokenizer_spec}: tokenizer_config.json's chat_template is a {type(template).__name__}, not "
            "a template; pass --chat-template PATH"
        )
    return template or DEFAULT_TEMPLATE, variables


def _tokenizer_dir(spec: str) -> Path | None:
    if spec.startswith(("bpe:", "tiktoken:")):
        return None
    p = Path(spec).expanduser()
    return p if p.is_dir() else p.parent if p.is_file() else None


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def render(template: str, messages: list[dict], add_generation_prompt: bool = False, **variables) -> str:
    """The text of a conversation, as ``transformers``' ``apply_chat_template(..., tokenize=False)`` renders it.

    Args:
        template: a Jinja chat template.
        messages: ``{"role": ..., "content": ...}`` dicts.
        add_generation_prompt: end with the template's opening of an assistant turn.
        **variables: further template variables (``bos_token``, ``eos_token``).

    Raises:
        ValueError: the template does not parse, or fails on this conversation (its ``raise_exception``).
    """
    from jinja2 import TemplateError

    compiled = compile_template(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from None


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    """The template compiled in a sandbox with the globals and filters transformers gives chat templates.

    Raises:
        ValueError: the template does not parse.
    """
    import jinja2.ext
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ValueError(f"the chat template does not parse: {e}") from None


def segments(
    template: str, messages: list[dict], train_on: str, variables: dict, where: str = "a conversation"
) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive ``(text, is_target)`` pieces, which concatenate to its rendering.

    With ``train_on="completion"`` the targets are the assistant turns: for assistant message ``i``, the text from
    ``render(messages[:i], add_generation_prompt=True)`` to ``render(messages[:i + 1])`` (its content and the
    template's end-of-turn marker). With ``train_on="all"`` the whole rendering is one target piece.

    Args:
        template: a Jinja chat template.
        messages: ``{"role": ..., "content": ...}`` dicts.
        train_on: ``completion`` or ``all``.
        variables: further template variables (``bos_token``, ``eos_token``).
        where: the record, named in errors.

    Raises:
        ValueError: the template fails on the conversation, or renders a conversation's beginning as something
            other than a prefix of the whole (then its assistant turns cannot be told apart).
    """
    try:
        whole = render(template, messages, **variables)
        if train_on == "all":
            return [(whole, True)] if whole else []
        pieces, end = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            head = render(template, messages[:i], add_generation_prompt=True, **variables)
            full = render(template, messages[: i + 1], **variables)
            for shorter, longer, what in ((end, head, "the generation prompt"), (head, full, "the turn")):
                if not longer.startswith(shorter):
                    raise ValueError(
                        f"the chat template renders the conversation up to assistant message {i} ({what}) as text "
                        "that does not extend its rendering of the messages before it, so the assistant turns "
                        "cannot be cut out; use a template whose renderings are prefixes of each other "
                        "(--chat-template PATH), or --train-on all"
                    )
            pieces += [(head[len(end) :], False), (full[len(head) :], True)]
            end = full
        if not whole.startswith(end):
            raise ValueError(
                "the chat template renders the whole conversation as text that does not extend its rendering up to "
                "the last assistant message; use a template whose renderings are prefixes of each other "
                "(--chat-template PATH), or --train-on all"
            )
        pieces.append((whole[len(end) :], False))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return [(text, target) for text, target in pieces if text]
