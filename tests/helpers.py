"""What many test files share: the optimizer's timeout, the rank, and parameter comparisons.

Parameters are compared as ``{name: tensor}`` dicts (``tests.reference.params_of``), so a
failure names the parameter that differs.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CUDA_TIMEOUT",
    "TIMEOUT",
    "assert_identical_across_ranks",
    "assert_params_close",
    "assert_params_equal",
    "inside",
    "this_rank",
]

# The ``timeout=`` handed to AccoOptimizer in tests: a hung collective or comm lane fails
# the test in seconds instead of the default's minutes, yet a loaded 2-core machine running
# 3 gloo ranks never reaches it in a healthy round.
TIMEOUT = datetime.timedelta(seconds=30)
# On CUDA the first rounds also create the CUDA context, the side stream and cuBLAS handles.
CUDA_TIMEOUT = 2 * TIMEOUT


def this_rank() -> int:
    """This process's rank, 0 without a process group (world size 1)."""
    return dist.get_rank() if dist.is_initialized() else 0


def assert_params_equal(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
    """The same parameter names, and every tensor equal bit for bit."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name} differs"


def assert_identical_across_ranks(results: Sequence[Mapping[str, Any]], key: str = "params") -> None:
    """Every rank's ``result[key]`` equals rank 0's bit for bit: the ranks hold one model."""
    for rank, other in enumerate(results[1:], start=1):
        first = results[0][key]
        assert other[key].keys() == first.keys(), f"rank {rank} holds other parameters than rank 0"
        for name, value in first.items():
            assert torch.equal(value, other[key][name]), f"{name} differs across ranks (rank {rank})"


def assert_params_close(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor],
                        rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """The same parameter names, and every tensor within ``torch.testing.assert_close``'s
    ``rtol``/``atol`` of the reference (dtype and device must match too)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def inside(t: Tensor, buffer: Tensor) -> bool:
    """Whether ``t``'s memory lies within ``buffer``'s (a view of it, or of a part of it)."""
    start, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + size
