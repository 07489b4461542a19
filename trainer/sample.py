"""``trainer sample RUN_DIR``: generate text from a run's checkpoint.

The run's model is rebuilt from its ``config.yaml`` as ``trainer export`` does (the built-in GPT, a
``model.target`` model or a ``model.hf`` model, at the vocabulary its data had), the checkpoint's weights are
loaded into it, and tokens are drawn one at a time from its forward: the context cropped to ``data.seq_len``,
the logits scaled by the temperature (0: greedy) and cut to the ``top_k`` likeliest, from a generator seeded by
``--seed`` (the same seed, checkpoint and device give the same text). No KV cache: each token is one forward
over the window. The text goes through the codec the data was written with (:mod:`trainer.codec`): bytes for
the embedded corpus and text files, the prepared directory's tokenizer otherwise.

stdout holds the prompt and its continuation, then a newline; stderr a one-line header.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

from trainer import checkpoint, console
from trainer.distributed.env import resolve_device


def main(args) -> int:
    """Run ``trainer sample`` (``args``: the CLI's parsed arguments). Returns the exit status.

    Raises:
        ValueError, FileNotFoundError, CheckpointError: a user error (the CLI exits 2 with the message).
    """
    run = Path(args.run_dir)
    cfg = run_config(run, "sample")
    codec = _run_codec(cfg, run)
    path = _checkpoint(args.checkpoint, run)
    device = resolve_device(args.device, 0, key="--device")
    model = _run_model(cfg, run)
    meta = checkpoint.load_model_weights(path, model)
    model.to(device).eval()
    chat = None if args.raw or not args.prompt else chat_template(cfg.data.path)
    if chat is not None:  # the prompt is a user's turn; the reply is the assistant's
        from trainer.chat import render

        turn = render(chat[0], [{"role": "user", "content": args.prompt}], add_generation_prompt=True, **chat[1])
        context = codec.encode(turn, special=True)
    else:
        context = codec.encode(args.prompt) if args.prompt else _start(codec)
    how = (
        f", the prompt as a user's turn of {Path(cfg.data.path).name}'s chat template (--raw: as text)" if chat else ""
    )
    console.info(f"sampling {args.tokens} tokens from {path} (step {meta.get('step')}){how}", stderr=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    new = generate(
        model,
        context,
        args.tokens,
        context_len=cfg.data.seq_len,
        vocab_size=codec.vocab_size,
        temperature=args.temperature,
        top_k=args.top_k,
        generator=generator,
    )
    if codec.eos_id is not None and codec.eos_id in new:
        new = new[: new.index(codec.eos_id)]
        console.info(f"stopped at the end-of-text token after {len(new)} tokens", stderr=True)
    if chat is None:
        console.info(args.prompt + continuation(codec, context, new))
        return 0
    end = end_of_turn(*chat)
    stop = codec.encode(end, special=True) if end else []
    cut = len(stop) == 1 and stop[0] in new  # one token (a special one): cut the ids there
    new = new[: new.index(stop[0])] if cut else new
    reply = continuation(codec, context, new)
    if end and end in reply:  # several tokens: cut the text
        reply, cut = reply[: reply.index(end)], True
    if cut:
        console.info(f"stopped at the end of the assistant's turn ({end})", stderr=True)
    console.info(reply.strip("\n"))
    return 0


def chat_template(data_path: str | None) -> tuple[str, dict] | None:
    """The chat template (and its variables) that ``trainer prepare`` wrote beside chat data; None for other data."""
    from trainer.data import META, _data_path

    d = _data_path(data_path)
    if d is None or not d.is_dir() or not (d / META).is_file():
        return None
    meta = json.loads((d / META).read_text())
    name = meta.get("chat_template")
    if meta.get("format") != "chat" or not isinstance(name, str) or not (d / name).is_file():
        return None
    return (d / name).read_text(), dict(meta.get("chat_template_variables") or {})


def end_of_turn(template: str, variables: dict) -> str:
    """The text a template puts after an assistant's message (ChatML's ``<|im_end|>``), stripped; "" if none."""
    from trainer.chat import render

    user = [{"role": "user", "content": "u"}]
    head = render(template, user, add_generation_prompt=True, **variables)
    full = render(template, [*user, {"role": "assistant", "content": "\x00"}], **variables)
    if not full.startswith(head) or "\x00" not in full:
        return ""
    return full[full.index("\x00") + 1 :].strip()


def run_config(run: Path, command: str):
    """The config of the run in ``run`` (its ``config.yaml``), its relative paths read as the run read them.

    A relative ``data.path`` or ``model.hf`` is relative to the directory the run was launched from, which the run's
    ``plan.json`` records (``cwd``): each is read from there where it exists there, else as given (from the working
    directory). A ``model.target`` module in that directory is imported from there. So ``trainer sample`` and
    ``trainer export`` (``command``, for the messages) work from any directory.

    Raises:
        FileNotFoundError: ``run`` is not a run directory.
        ConfigError: its config.yaml does not load.
    """
    from trainer.config import load_config

    if not run.is_dir():
        raise FileNotFoundError(f"{command}: no such run directory: {run}")
    config = run / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{command}: {run} is not a run directory (no config.yaml); pass the run.dir of a run")
    cfg = load_config(config)
    launch = _launch_dir(run)
    if launch is None:
        return cfg
    cfg.data.path = _from(launch, cfg.data.path)
    cfg.model.hf = _from(launch, cfg.model.hf)
    top = (cfg.model.target or "").partition(":")[0].partition(".")[0]
    if top and ((launch / top).is_dir() or (launch / f"{top}.py").is_file()) and str(launch) not in sys.path:
        sys.path.insert(0, str(launch))
    return cfg


def _launch_dir(run: Path) -> Path | None:
    """The working directory the run in ``run`` was launched from (``cwd`` in its plan.json), if it still exists."""
    try:
        cwd = json.loads((run / "plan.json").read_text()).get("cwd")
    except (OSError, ValueError, AttributeError):  # no plan.json, or not a JSON object
        return None
    return Path(cwd) if isinstance(cwd, str) and Path(cwd).is_dir() else None


def _from(launch: Path, path: str | None) -> str | None:
    """``path`` read from ``launch`` where it is relative and exists there; as given otherwise."""
    if path is None or Path(path).expanduser().is_absolute() or not (launch / path).exists():
        return path
    return str(launch / path)


def _run_codec(cfg, run: Path):
    """The codec of the run's data; a run on a bare ``.bin`` has none."""
    from trainer.codec import codec_for_data

    try:
        return codec_for_data(cfg.data.path)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(
            f"sample: {run} trained on data.path={cfg.data.path}, whose tokenizer is needed to turn "
            f"text into tokens and back: {e}"
        ) from None


def _checkpoint(spec: str, run: Path) -> Path:
    """The checkpoint directory ``--checkpoint`` names: ``last`` in ``run`` (or the newest intact one before it,
    with a warning), or a path, refused if damaged (:func:`trainer.checkpoint.integrity.resolve`)."""
    if spec == "last" and not (run / "checkpoints" / checkpoint.LAST).is_file():
        raise checkpoint.CheckpointError(
            f"sample: no complete checkpoint in {run / 'checkpoints'} (the run saved none: checkpoint.enabled=false, "
            f"or it stopped before its first save); train with checkpoints on (`trainer fit {run / 'config.yaml'} "
            "checkpoint.enabled=true`: one is saved at the end), or pass --checkpoint PATH"
        )
    if spec != "last" and not Path(spec).exists():
        raise checkpoint.CheckpointError(f"sample: --checkpoint {spec}: no such checkpoint directory")
    return checkpoint.resolve(spec, run, asked="sample" if spec == "last" else f"sample: --checkpoint {spec}")


def _run_model(cfg, run: Path) -> nn.Module:
    """The run's model, on the CPU, initialised at random (the checkpoint's weights replace it): the shape its
    config gives, at the vocabulary its data had. A ``model.hf`` model is built from its config, never downloaded
    weights; the attention kernel is torch's choice (``model.attention`` does not change the weights)."""
    from trainer.data import data_vocab_size
    from trainer.model_setup import build_model_of

    try:
        return build_model_of(cfg, data_vocab_size(cfg.data.path, cfg.data.vocab_size), False, attention="auto")
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"sample: rebuilding the model of {run / 'config.yaml'}: {e}") from None


def _start(codec) -> list[int]:
    """The context without a prompt: the end-of-text token (a document starts after it), else a newline."""
    return [codec.eos_id] if codec.eos_id is not None else codec.encode("\n")


def continuation(codec, context: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``context``: decoded together, so that a token that joins the context's last
    (a space, a multi-byte character) reads as it does in the whole, then cut after the context's own text."""
    before, whole = codec.decode(context), codec.decode(context + new)
    return whole[len(before) :] if whole.startswith(before) else codec.decode(new)


@torch.no_grad()
def generate(
    model: nn.Module,
    context: list[int],
    n: int,
    *,
    context_len: int,
    vocab_size: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
) -> list[int]:
    """Draw ``n`` tokens after ``context``, one forward per token over the last ``context_len`` tokens.

    Args:
        model: in eval mode, on ``generator``'s device; ``forward(idx)`` gives the logits (:func:`next_logits`).
        context: the token ids to continue (at least one).
        vocab_size: the codec's; ids past it (a padded embedding's) are never drawn.
        temperature: 0 for greedy, else the logits' divisor.
        top_k: draw from the ``top_k`` likeliest ids (0: from all).
        generator: the seeded generator the draws use.

    Returns:
        The ``n`` new ids.
    """
    device = generator.device
    buf = torch.empty(1, len(context) + n, dtype=torch.long, device=device)  # (1, T + n): the whole text so far
    buf[0, : len(context)] = torch.tensor(context, dtype=torch.long)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    for t in range(len(context), len(context) + n):
        with amp:
            logits = next_logits(model, buf[:, max(0, t - context_len) : t])  # (1, V)
        buf[:, t] = pick(logits[:, :vocab_size].float(), temperature, top_k, generator)
    return buf[0, len(context) :].tolist()


def next_logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The logits of the token after ``idx`` (B, T): ``forward(idx)`` without targets gives them as (B, T, V),
    or a tuple starting with them (nanoGPT's ``(logits, loss)``, whose logits are (B, 1, V)). Returns (B, V).

    Raises:
        ValueError: the model's forward needs targets, or returns no logits.
    """
    expected = (
        "sampling calls forward(idx) without targets and expects the logits, (B, T, V), or a tuple "
        "starting with them like nanoGPT's (logits, loss)"
    )
    try:
        out = model(idx)
    except TypeError as e:
        raise ValueError(f"sample: {type(model).__name__}.forward(idx) failed ({e}); {expected}") from None
    logits = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.size(0) != idx.size(0):
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"sample: {type(model).__name__}.forward(idx) returned {got}; {expected}")
    return logits[:, -1, :]


def pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """The next id of each row of ``logits`` (B, V): the likeliest for temperature 0, else a draw from the softmax
    of ``logits / temperature`` over the ``top_k`` likeliest (0: all). Returns (B,)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
