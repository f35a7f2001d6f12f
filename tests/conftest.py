from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

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
