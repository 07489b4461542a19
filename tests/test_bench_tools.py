"""The benchmark scripts' job scheduling and variant parsing (scripts/bench_ddp.py, scripts/_variants.py)."""

import threading
import time

import pytest

from scripts._variants import parse_variant
from scripts.bench_ddp import VARIANTS, GpuPool


def test_pool_places_jobs_on_disjoint_gpus_in_order_and_says_which_ran_alone():
    pool = GpuPool(4, max_jobs=4)
    jobs = [(2, False), (2, False), (1, True), (1, False)]  # (GPUs, the machine to itself)
    held, events, lock = set(), [], threading.Lock()

    def run(ticket, world, solo):
        gpus, token = pool.take(ticket, 4 if solo else world)
        with lock:
            assert not held & set(gpus)  # nobody else holds them
            held.update(gpus)
            events.append(("start", ticket))
        time.sleep(0.2)
        with lock:
            held.difference_update(gpus)
        events.append(("end", ticket, pool.give(gpus, token)))

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    starts = [e[1] for e in events if e[0] == "start"]
    alone = {e[1]: e[2] for e in events if e[0] == "end"}
    assert starts == [0, 1, 2, 3]  # ticket order
    assert alone == {0: False, 1: False, 2: True, 3: True}  # 0 and 1 shared the machine; 2 had it to itself
    assert events.index(("start", 2)) > max(events.index(("end", 0, False)), events.index(("end", 1, False)))


def test_variant_overrides():
    spec = parse_variant("ours-ddp@distributed.split_tail=false", VARIANTS)
    assert spec["overrides"][-1] == "distributed.split_tail=false"
    assert "distributed.split_tail=false" not in VARIANTS["ours-ddp"]["overrides"]  # the table is not changed
    with pytest.raises(SystemExit, match="unknown variant 'bogus'"):
        parse_variant("bogus", VARIANTS)
    with pytest.raises(SystemExit, match="ours-\\* variants only"):
        parse_variant("eager-ddp@x=1", VARIANTS)
