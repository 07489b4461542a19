"""trainer's Triton kernels compiled in a second process while the main one compiles the model.

Triton compiles a ``@triton.jit`` kernel at its first launch, in the launching process: the Python front end, the
compiler passes, ptxas, and gcc for the kernel's launcher, a second or so each. Inductor compiles its own kernels
in its worker processes, while the model is compiled; trainer's (the fused add + norm, the cross-entropy) would
wait for the first step, one at a time.

:func:`enable` (called before the model's first compile) arms it: the first call that the compile traces starts a
process that compiles the kernels as the compile discovers them. Each op's fake implementation, which Dynamo and
AOTAutograd call with the exact shapes, strides and dtypes of every call, passes them to :func:`record`; the process
launches the op on zeros of those shapes, on the same device. Triton writes each compiled kernel to its on-disk cache
(``TRITON_CACHE_DIR``, which the process inherits), keyed by the kernel and its specialization, so the main process's
first launch loads it rather than compiling it. The first real launch calls :func:`finish`, which waits for the
process where it has started compiling, or stops it where it is still starting (a compile cache that was already
warm leaves it nothing to do), so it holds no GPU memory by the first step. Nothing depends on it: a kernel it has not
compiled is compiled by the main process as before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

WAIT_S = 60.0
"""How long :func:`finish` waits for a process that has started compiling."""
FREE_SHARE = 0.25
"""The most of the GPU's free memory one call's inputs may take in the process (its outputs take about as much
again); a larger call is left to the main process."""


class _Process:
    """The compiling process and what it has reported (``ready``, ``done``, ``failed``) on its stdout."""

    def __init__(self, device: torch.device):
        self.t0 = time.perf_counter()
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.ops.warm", str(device)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
        )
        self.ready = threading.Event()
        self.sent = self.done = 0
        self.failed: list[str] = []
        self.reader = threading.Thread(target=self._read, name="trainer-warm-kernels", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                word, _, rest = line.rstrip("\n").partition(" ")
                if word == "ready":
                    self.ready.set()
                elif word == "done":
                    self.done += 1
                elif word == "failed":
                    self.failed.append(rest)
        except (OSError, ValueError):
            pass

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            self.sent += 1
        except (BrokenPipeError, OSError, ValueError):
            pass


_device: torch.device | None = None  # armed for this device, until finish()
_process: _Process | None = None
_seen: set[str] = set()
last: dict[str, Any] | None = None
"""What the last process did (:func:`finish`'s return), for the run's compile report; None before one ran."""


def enable(device: torch.device | None) -> None:
    """Arm the compiling process for ``device``: the next call traced starts it (call before the model's first
    compile; the caller decides where it pays: trainer's kernels compile for CUDA, and run on CPU only in Triton's
    interpreter). None disarms it. Either way a process left from before is stopped and :data:`last` cleared."""
    global _device, last
    finish(wait_s=0)
    _device, last = device, None
    _seen.clear()


def running() -> bool:
    """Whether a compiling process runs."""
    return _process is not None


def record(module: str, op: str, args: tuple) -> None:
    """Pass one call of the op ``trainer::<op>`` (registered by ``module``) to the compiling process, once per
    distinct set of argument shapes, strides and dtypes, starting the process at the first; a no-op unless
    :func:`enable` armed it, and for symbolic shapes."""
    global _device, _process
    device = _device
    if device is None:
        return
    try:
        encoded = [_encode(a) for a in args]
        if any(a is _SKIP for a in encoded):
            return
        line = json.dumps({"module": module, "op": op, "args": encoded}, sort_keys=True)
        if line in _seen:
            return
        _seen.add(line)
        if _process is None:
            _process = _Process(device)
        _process.send(line)
    except Exception:  # noqa: BLE001 - a speed-up: never the reason a compile fails
        _device = None


def finish(wait_s: float = WAIT_S) -> dict[str, Any] | None:
    """End the compiling process: wait for it (at most ``wait_s``) where it has started compiling, else stop it.
    Returns what it did (calls sent and compiled, failures, whether it was stopped, seconds since its start), or
    None when none was running; disarms :func:`enable`. Called by the first real launch of an op, and after the first
    step."""
    global _device, _process, last
    p, _process, _device = _process, None, None
    if p is None:
        return None
    try:  # the end, also where a forked process holds the pipe open
        p.proc.stdin.write("end\n")
        p.proc.stdin.flush()
    except (OSError, ValueError):
        pass
    try:
        p.proc.stdin.close()
    except OSError:
        pass
    stopped = not p.ready.is_set()
    if not stopped:
        try:
            p.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            stopped = True
    if stopped:
        p.proc.kill()
        p.proc.wait(timeout=10)
    p.reader.join(timeout=5)
    last = {
        "sent": p.sent,
        "done": p.done,
        "failed": list(p.failed),
        "stopped": stopped,
        "seconds": round(time.perf_counter() - p.t0, 3),
    }
    return last


# ---- the encoding of a call -----------------------------------------------------------------------

_SKIP = object()


def _encode(a: Any) -> Any:
    """A JSON form of one argument: tensors by shape, stride, offset and dtype; dtypes by name; scalars as
    themselves; ``_SKIP`` for what cannot be rebuilt (a symbolic size, a tensor subclass such as a ``DTensor``,
    whose shape is not what the kernel sees, an object)."""
    if isinstance(a, torch.Tensor):
        if is_traceable_wrapper_subclass(a):
            return _SKIP
        sizes = (*a.shape, *a.stride(), a.storage_offset())
        if not all(isinstance(s, int) for s in sizes):
            return _SKIP
        return {"tensor": [list(a.shape), list(a.stride()), a.storage_offset(), str(a.dtype).removeprefix("torch.")]}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, (list, tuple)):
        items = [_encode(x) for x in a]
        return _SKIP if any(x is _SKIP for x in items) else {"list": items}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    return _SKIP


def _extent(shape: list[int], stride: list[int], offset: int) -> int:
    """The elements of storage a tensor of this layout reaches."""
    return 0 if 0 in shape else offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))


def _decode(a: Any, device: torch.device) -> Any:
    """The argument :func:`_encode` describes: tensors of zeros with its layout, on ``device``."""
    if isinstance(a, dict) and "tensor" in a:
        shape, stride, offset, dtype = a["tensor"]
        zeros = torch.zeros(_extent(shape, stride, offset), dtype=getattr(torch, dtype), device=device)
        return zeros.as_strided(shape, stride, offset)
    if isinstance(a, dict) and "dtype" in a:
        return getattr(torch, a["dtype"])
    if isinstance(a, dict) and "list" in a:
        return [_decode(x, device) for x in a["list"]]
    return a


def _input_bytes(spec: dict[str, Any]) -> int:
    """The bytes of a recorded call's tensor arguments."""

    def size(a: Any) -> int:
        if isinstance(a, dict) and "tensor" in a:
            shape, stride, offset, dtype = a["tensor"]
            return _extent(shape, stride, offset) * getattr(torch, dtype).itemsize
        if isinstance(a, dict) and "list" in a:
            return sum(size(x) for x in a["list"])
        return 0

    return sum(size(a) for a in spec["args"])


def run_call(spec: dict[str, Any], device: torch.device) -> None:
    """Launch the op a recorded call names on zeros of its arguments' layouts (what the compiling process does)."""
    import importlib

    importlib.import_module(spec["module"])
    op = getattr(torch.ops.trainer, spec["op"])
    op(*[_decode(a, device) for a in spec["args"]])


def main(argv: list[str]) -> int:
    """The compiling process: ``python -m trainer.ops.warm DEVICE``, one recorded call a line on stdin."""
    device = torch.device(argv[0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # the context, before the first call arrives
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "end":
            break
        spec = json.loads(line)
        try:
            if device.type == "cuda" and _input_bytes(spec) > FREE_SHARE * torch.cuda.mem_get_info(device)[0]:
                raise MemoryError("its inputs would take more of the GPU's free memory than this process may")
            run_call(spec, device)
            print("done", flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the main process, which compiles the kernel itself
            print("failed", spec["op"], type(e).__name__, str(e).replace("\n", " ")[:300], flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
