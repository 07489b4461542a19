"""The one voice of the trainer: everything it tells the user goes through here.

- :func:`info`: the run's lines (its path, each logged step, a resume) and a command's answer, on stdout
  (on stderr where stdout is the product: ``trainer sample``'s text).
- :func:`warn`: what the user may want to act on (a setting that cannot take effect, a fallback, skipped data),
  on stderr, ``warning: `` first, yellow on a terminal.
- :func:`error`: a command's failure, on stderr, from every rank (a rank but 0 names itself in the message).
- :func:`progress`: the live step bar, on stderr while it is a terminal.

Under torchrun every rank runs the same code and would say the same line: rank 0 alone speaks unless a call asks
for ``every_rank``. The rank is torch.distributed's once a process group exists, else torchrun's ``RANK``.
Output goes to ``sys.stdout`` and ``sys.stderr`` as they are at the call (pytest's ``capsys`` reads it).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

_said: set[str] = set()  # the messages warn(..., once=True) has said
_quiet = 0  # depth of quiet() blocks


def rank() -> int:
    """This process's rank: the process group's when one exists, else torchrun's ``RANK``, else 0."""
    dist = sys.modules.get("torch.distributed")  # not imported: no process group, and no torch import for it
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _speaks(every_rank: bool) -> bool:
    return not _quiet and (every_rank or rank() == 0)


def info(msg: str | None, *, every_rank: bool = False, stderr: bool = False) -> None:
    """Say ``msg`` on stdout (rank 0 alone unless ``every_rank``); None or "" says nothing. ``stderr``: on stderr,
    for a command whose stdout is its product (``trainer sample``'s text)."""
    if msg and _speaks(every_rank):
        print(msg, file=sys.stderr if stderr else sys.stdout, flush=True)


def warn(msg: str, *, once: bool = False, every_rank: bool = False) -> None:
    """Say ``warning: msg`` on stderr (rank 0 alone unless ``every_rank``); ``once``: only the first time this
    process is given ``msg``."""
    if not msg or not _speaks(every_rank) or (once and msg in _said):
        return
    _said.add(msg)
    _stderr().print(f"warning: {msg}", style="yellow")


def error(msg: str) -> None:
    """Say ``msg`` on stderr, from whichever rank calls (an error ends that rank; the caller names it)."""
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Say nothing from :func:`info` and :func:`warn` inside the block (a probe that builds and steps a model)."""
    global _quiet
    _quiet += 1
    try:
        yield
    finally:
        _quiet -= 1


def _stderr():
    from rich.console import Console

    # Made at each call: it writes to the sys.stderr of that moment, and colours only a terminal.
    return Console(file=sys.stderr, highlight=False, markup=False, emoji=False, soft_wrap=True)


class Progress:
    """A live bar of training steps: the step of the total, the loss, tokens/s, elapsed time and ETA."""

    def __init__(self, total: int, completed: int):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        columns = (
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self._bar = Bar(*columns, console=_stderr())
        self._task = self._bar.add_task("train", total=total, completed=completed, loss="-", tps="-")
        self._bar.start()

    def update(self, step: int, loss: str | None = None, tps: str | None = None) -> None:
        """Move the bar to ``step``; ``loss`` and ``tps`` (already formatted) replace the shown ones if given."""
        fields = {k: v for k, v in (("loss", loss), ("tps", tps)) if v is not None}
        self._bar.update(self._task, completed=step, **fields)

    def close(self) -> None:
        self._bar.stop()


def progress(total: int, completed: int = 0) -> Progress | None:
    """A live bar of ``total`` steps, ``completed`` of them done, when rank 0's stderr is a terminal; else None."""
    if not _speaks(False) or not sys.stderr.isatty():
        return None
    return Progress(total, completed)
