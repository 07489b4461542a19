"""torchrun for the tests, without its imports: started once per test process by tests/conftest.py's torchrun().

It imports torch.distributed.run once, then for each request (a JSON line on stdin: argv, env, cwd, stdout and
stderr files) forks a launcher that runs ``python -m torch.distributed.run ARGV`` as the interpreter would: the
module as ``__main__``, an uncaught exception printed by sys.excepthook and exit status 1, atexit handlers run.
The launcher's file descriptors 0-2 are /dev/null and the two files, which the ranks it starts inherit, as they
inherit its environment and working directory. This process answers ``{"pid": ...}`` when the launcher started
and ``{"returncode": ...}`` when it ended (``-N`` for signal N, as subprocess gives). The ranks are new
processes, started by torchrun as from the command line; only the launcher's ~1.5 s of imports are saved.

Not a test module itself (no ``test_`` prefix). This process starts no thread, so forking it is safe.
"""

import atexit
import io
import json
import os
import runpy
import sys

import torch.distributed.run  # noqa: F401  (what a launcher imports)


def _launch(request: dict) -> None:
    """In the forked child: become ``python -m torch.distributed.run ARGV``; never returns."""
    code = 1
    try:
        fds = [os.open(os.devnull, os.O_RDONLY)] + [
            os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in ("stdout", "stderr")
        ]
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        # Unbuffered, as PYTHONUNBUFFERED=1 (the tests' launchers) makes them.
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), write_through=True)  # noqa: SIM115
            for fd in (1, 2)
        )
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["torchrun", *request["argv"]]  # runpy sets argv[0] to the module's file
        try:
            runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main() -> None:
    requests, answers = sys.stdin, sys.stdout
    for line in requests:
        pid = os.fork()
        if pid == 0:
            _launch(json.loads(line))
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        answers.write(json.dumps({"returncode": code}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
