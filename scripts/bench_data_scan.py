"""The token-file check at load: one vectorised pass for the largest id, over 1 GB uint16 and uint32 files.

    python scripts/bench_data_scan.py                  # 1 GB per dtype (~1 min on 2 cores, 2 GB of temp disk)
    python scripts/bench_data_scan.py --gb 0.05        # a quick check that the script runs

``trainer fit`` maps every token file (``data.path``: a prepared directory or a ``.bin``) and checks it before
training: a whole number of tokens, every id below the vocabulary (:func:`trainer.data.read_tokens`). This
measures that check on a file of random ids, written to a temporary directory:

- ``warm``: the file in the page cache (just written or read): the scan's own speed, bounded by memory bandwidth.
- ``cold``: the file's pages dropped from the cache first (``posix_fadvise(DONTNEED)``, no root needed): the scan
  as the first load of a run sees it, bounded by the disk.
- ``np.max whole``: one ``np.max`` over the whole memmap, the reference the chunked scan should match.

Each row is the median of --repeat runs. Writes JSON (--out) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import _meta  # noqa: E402
from trainer.data import TOKEN_DTYPES, read_tokens  # noqa: E402

VOCAB = {"uint16": 50_257, "uint32": 200_019}  # GPT-2's and o200k's vocabularies


def write_tokens(path: Path, dtype: str, n_bytes: int) -> None:
    """``n_bytes`` of random ids below ``VOCAB[dtype]``, written in 64 MiB pieces (bounded memory), fsynced."""
    rng = np.random.default_rng(0)
    n = n_bytes // np.dtype(TOKEN_DTYPES[dtype]).itemsize
    piece = (64 << 20) // np.dtype(TOKEN_DTYPES[dtype]).itemsize
    with open(path, "wb") as f:
        for start in range(0, n, piece):
            rng.integers(0, VOCAB[dtype], size=min(piece, n - start), dtype=TOKEN_DTYPES[dtype]).tofile(f)
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def timed(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(dtype: str, n_bytes: int, repeat: int, tmp: Path) -> list[dict]:
    path = tmp / f"{dtype}.bin"
    write_tokens(path, dtype, n_bytes)
    size = path.stat().st_size
    vocab = VOCAB[dtype]
    read_tokens(path, dtype, vocab)  # warm the cache and check that the file passes
    rows = [
        ("read_tokens warm", timed(lambda: read_tokens(path, dtype, vocab), repeat)),
        ("read_tokens cold", timed(lambda: read_tokens(path, dtype, vocab), repeat, before=lambda: drop_cache(path))),
        ("np.max whole, warm", timed(lambda: np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r").max(), repeat)),
    ]
    path.unlink()
    return [{"dtype": dtype, "what": w, "bytes": size, "seconds": s, "gb_per_s": size / s / 1e9} for w, s in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="file size per dtype, in GB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the median is reported (default 3)")
    ap.add_argument("--dir", default=None, help="where to write the files (default: the system temp directory)")
    ap.add_argument("--out", default=str(ROOT / "scripts/results/bench_data_scan/result.json"), help="JSON path")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_data_scan_", dir=args.dir) as tmp:
        rows = [r for dtype in TOKEN_DTYPES for r in bench(dtype, int(args.gb * 1e9), args.repeat, Path(tmp))]
    result = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "numpy": np.__version__,
        "git_sha": _meta.git_sha(),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    print(f"{'dtype':<8} {'what':<20} {'GB':>6} {'s':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['dtype']:<8} {r['what']:<20} {r['bytes'] / 1e9:>6.2f} {r['seconds']:>8.3f} {r['gb_per_s']:>7.2f}")


if __name__ == "__main__":
    main()
