"""Write tests/slow.txt, the tests the quick run leaves out, from a pytest log with ``--durations=0``.

    python -m pytest -q -n 2 --durations=0 | tee /tmp/suite.log
    python scripts/slow_tests.py /tmp/suite.log            # tests of 5 s or more (setup, call and teardown)

The quick run (``pytest -m "not slow"``) keeps every test below the threshold and the few in :data:`KEEP`, one for
each thing a change most often breaks that no quick test covers; the full run (``pytest``, what CI runs) has them all.
Each line of tests/slow.txt is ``seconds node-id``: tests/conftest.py marks those tests ``slow`` and starts the
longest first.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "slow.txt"

KEEP = {
    "tests/test_distributed.py::test_two_ranks_reproduce_one_process[fsdp-compiled]": "two gloo ranks under fsdp",
    "tests/test_compile.py::test_compiled_training_matches_eager": "the compiled step against eager",
    "tests/test_fit.py::test_resume_is_bitwise_exact": "a resume, bit for bit",
    "tests/test_mesh.py::test_each_layout_reproduces_one_process[tp-2-gpt]": "tensor parallel on the mesh",
}


def durations(log: str) -> dict[str, float]:
    """Seconds per node id (setup, call and teardown added) from pytest's ``--durations`` lines."""
    total: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = re.match(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)$", line.strip())
        if m:
            total[m.group(3)] += float(m.group(1))
    return dict(total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="a pytest log made with --durations=0")
    p.add_argument("--threshold", type=float, default=5.0, help="seconds from which a test is slow (default 5)")
    p.add_argument("--out", type=Path, default=OUT, help="where the list goes (default tests/slow.txt)")
    a = p.parse_args(argv)
    times = durations(Path(a.log).read_text())
    if not times:
        print(f"{a.log}: no --durations lines (run pytest with --durations=0)", file=sys.stderr)
        return 2
    slow = sorted(((t, n) for n, t in times.items() if t >= a.threshold and n not in KEEP), reverse=True)
    head = '# seconds node-id: the tests `pytest -m "not slow"` leaves out (scripts/slow_tests.py writes this)\n'
    a.out.write_text(head + "".join(f"{t:.1f} {n}\n" for t, n in slow))
    names = {n for _, n in slow}
    quick = sum(t for n, t in times.items() if n not in names)
    print(
        f"{a.out}: {len(slow)} slow tests, {sum(t for t, _ in slow):.0f} s; "
        f"the quick run {len(times) - len(slow)} tests, {quick:.0f} s (test seconds, summed over workers)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
