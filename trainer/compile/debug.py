"""What to do when compiling goes wrong: the code Inductor generated, and a compile failure's next steps.

``trainer explain --dump-code DIR`` writes the generated code (:func:`dump_code`); a failed compile's message ends
with :func:`compile_error_hint`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from trainer.compile.report import _Capture, _summary


@contextlib.contextmanager
def dump_code(directory: str | os.PathLike) -> Iterator[list[Path]]:
    """Copy the code Inductor generates for each graph (Triton on GPU, C++ on CPU) into ``directory``.

    One file per graph, ``graph_<n>_<compile id>_<forward|backward|inference>.py``, copied from the path Inductor logs
    to its ``output_code`` artifact ("Output code written to: ...") when it compiles a graph or loads one from the FX
    graph cache. Yields the list of files written so far.
    """
    import torch._inductor.codecache  # noqa: F401  (registers the output_code loggers)
    import torch._inductor.graph  # noqa: F401
    from torch._functorch._aot_autograd import logging_utils
    from torch._guards import CompileContext

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    done: set[str] = set()

    def on_record(record: logging.LogRecord) -> None:
        if not (isinstance(record.msg, str) and record.msg.endswith("code written to: %s") and record.args):
            return
        src = str(record.args[0])
        if src in done or not os.path.isfile(src):
            return
        done.add(src)
        # Which graph: the wrapper's first line names it ("# AOT ID: ['0_forward']"), also when it comes from a cache;
        # while AOTAutograd compiles, logging_utils.graph_being_compiled does too.
        with open(src, errors="replace") as f:
            head = f.readline()
        names = re.findall(r"'\d+_(forward|backward|inference)'", head) or [
            n.partition("_")[2] for n in logging_utils.graph_being_compiled
        ]
        cid = CompileContext.current_compile_id()
        parts = [f"graph_{len(written):03d}", str(cid).replace("/", "-") if cid else "", names[0] if names else ""]
        dst = out / ("_".join(p for p in parts if p) + os.path.splitext(src)[1])
        shutil.copyfile(src, dst)
        written.append(dst)

    capture = _Capture("output_code", on_record)
    capture.attach()
    try:
        yield written
    finally:
        capture.detach()


def compile_error_hint(exc: BaseException) -> str:
    """A few lines on what to do about a compile failure: a minified reproducer where one applies, and the logs."""
    import torch._dynamo.config as dcfg
    from torch._dynamo.exc import BackendCompilerFailed  # InductorError is one (torch 2.11 and 2.13)

    lines = [f"torch.compile failed: {type(exc).__name__}: {_summary(str(exc))}"]
    if isinstance(exc, BackendCompilerFailed):
        # Dynamo produced a graph and the backend failed on it: the minifier can shrink that graph. "aot" minifies
        # the graph AOTAutograd hands to Inductor; "dynamo" the one Dynamo hands to any backend.
        after = "aot" if exc.backend_name == "inductor" else "dynamo"
        lines += [
            f"Minified reproducer: rerun with TORCHDYNAMO_REPRO_AFTER={after} TORCHDYNAMO_REPRO_LEVEL=2 in the "
            f"environment{' (dynamo if it does not reproduce)' if after == 'aot' else ''}; "
            "TORCHDYNAMO_REPRO_LEVEL=4 minifies wrong results instead of crashes.",
            f"  It writes {dcfg.debug_dir_root}/run_<time>-pid_<pid>/minifier/minifier_launcher.py; "
            "`python minifier_launcher.py` shrinks the graph into repro.py, a file to attach to a PyTorch issue.",
        ]
        if path := getattr(exc, "minifier_path", None):
            lines.append(f"  This failure already wrote {path}.")
    else:
        # Dynamo failed while tracing the user's code: there is no graph to minify; the message names the user line.
        lines.append(
            "Dynamo failed while tracing your code (the message above names the line). A graph break under "
            "compile.fullgraph=true is one: remove it or set compile.fullgraph=false."
        )
    lines += [
        'Logs: TORCH_LOGS="+dynamo,graph_breaks,recompiles" prints what Dynamo did; TORCH_TRACE=/tmp/trace keeps a '
        "structured trace that `tlparse` (pip install tlparse) turns into an HTML report.",
        "To keep training without compiling, set compile.fallback=eager (the failure is logged).",
    ]
    return "\n".join(lines)
