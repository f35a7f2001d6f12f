from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

# torchft's Rust logging reads RUST_LOG when its library first loads, in whichever test module
# imports it first: at its default (info) every lighthouse served from this process logs each
# quorum tick (2,110 lines before the elastic tests in one loaded run).
os.environ.setdefault("RUST_LOG", "warn")

from tests.ranks import RankPool

_pools: dict[int, RankPool] = {}
# Tasks a pool runs before it is replaced by new processes. Every optimizer a test builds
# makes process groups that live until the default group is destroyed (acco gives them back
# as torch does); in long-lived ranks their gloo threads pile up (hundreds per process after
# the suite) and slow every later test on 2 cores.
TASKS_PER_POOL = 30


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is not None and not pool.broken and pool.tasks >= TASKS_PER_POOL:
        pool.close()
    if pool is None or pool.broken:
        pool = _pools[world_size] = RankPool(world_size)
    return pool


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], RankPool]]:
    """``ranks(n)``: the session's pool of ``n`` gloo ranks (re-created if a test broke it)."""
    yield _pool
    for pool in _pools.values():
        pool.close()


@pytest.fixture(autouse=True, scope="module")
def _close_pools_after_each_module() -> Iterator[None]:
    """Each module's rank pools end with it. Idle pools of earlier modules starved later
    multi-process tests beside two busy loops: the jobs of examples/elastic_local.py that
    tests/test_elastic.py launches stalled past their 120 s (3 failed after the modules before
    it; the same modules with their pools closed: 83 passed in 3:26, beside the same loops)."""
    yield
    for pool in _pools.values():
        pool.close()
    _pools.clear()
