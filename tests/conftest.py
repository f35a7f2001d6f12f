from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.ranks import RankPool

_pools: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or pool.broken:
        pool = _pools[world_size] = RankPool(world_size)
    return pool


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], RankPool]]:
    """``ranks(n)``: the session's pool of ``n`` gloo ranks (re-created if a test broke it)."""
    yield _pool
    for pool in _pools.values():
        pool.close()
