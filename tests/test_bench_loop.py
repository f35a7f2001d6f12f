"""The benchmarks' shared round loop and memory formula, which their tables rest on: the
``ready()`` loop's cap, the slow rank's emulation, and gpu_overlap.py's README formula
against acco's own accounting (real gloo ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import gpu_overlap  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TINY = common.ModelConfig(n_layer=1, n_embd=32, n_head=2, seq_len=16, batch_size=2)


class NeverLands(common.Roofline):
    """A ready() loop whose round in flight never lands: only the cap ends its rounds."""

    def ready(self) -> bool:
        return False


def tiny_batches() -> common.Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    return common.batches(data, TINY, seed=0)


def test_the_cap_ends_a_round_that_never_lands() -> None:
    method = NeverLands("acco-aww", TINY, 2, common.build_model(TINY))  # 2 micro-batches per round
    for cap in (2, 5):
        record = common.train_round(method, tiny_batches(), max_micro_batches=cap)
        assert len(record.losses) == cap
        assert not record.landed


def test_the_cap_never_cuts_a_round_below_its_micro_batches() -> None:
    method = NeverLands("acco-aww", TINY, 4, common.build_model(TINY))  # 4 micro-batches per round
    record = common.train_round(method, tiny_batches(), max_micro_batches=1)
    assert len(record.losses) == method.micro_batches_per_round == 4


def test_a_slow_rank_sleeps_factor_minus_one_times_its_cpu_time() -> None:
    method = common.build_method("roofline", TINY, 4)
    fast = common.train_round(method, tiny_batches())
    slow = common.train_round(method, tiny_batches(), slowdown=3.0)
    assert len(slow.losses) == len(fast.losses) == 4
    for wall, cpu in zip(slow.micro_batch_s, slow.micro_batch_cpu_s):
        assert wall >= 3.0 * cpu * 0.95, (wall, cpu)  # the sleep (2 x CPU) comes on top of the compute


def formula_rank(name: str, mixed: torch.dtype | None) -> tuple[dict[str, int], dict[str, int]]:
    method = common.build_method(name, TINY, 4, mixed=mixed)  # bf16: parameters and reduction in it
    batches = tiny_batches()
    for _ in range(4):  # both kinds of rounds have run: every buffer exists
        common.train_round(method, batches)
    params = list({id(p): p for p in method.module.parameters()}.values())
    mode = common.method_spec(name).mode
    width = params[0].element_size()
    formula = gpu_overlap.formula_bytes(mode, sum(p.numel() for p in params), 2, width, width)
    accounting = gpu_overlap.acco_accounting(method)
    method.finish()
    return formula, accounting


@pytest.mark.parametrize("mixed", [None, torch.bfloat16])
@pytest.mark.parametrize("name", ["acco-sync", "acco-dpu", "acco"])
def test_the_readme_formula_is_what_acco_holds_at_two_ranks(ranks, name, mixed) -> None:
    for formula, accounting in ranks(2).run(formula_rank, name, mixed):
        # the AdamW step counters are a few bytes of state the formula leaves out
        assert sum(formula.values()) <= sum(accounting.values()) <= sum(formula.values()) + 64, (formula, accounting)
