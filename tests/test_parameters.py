"""Tied, frozen and unused parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from acco import AccoOptimizer
from tests.helpers import TIMEOUT, assert_identical_across_ranks, assert_params_close, this_rank

pytestmark = pytest.mark.timeout(120)
VOCAB, WIDTH = 11, 6


class TiedModel(nn.Module):
    """Embedding tied to the output head, a frozen layer, and a branch used only sometimes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.sometimes = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor, use_branch: bool) -> Tensor:
        h = torch.tanh(self.mix(self.frozen(self.embed(tokens))))
        if use_branch:
            h = h + self.sometimes(h)
        return self.head(h)


def data(round_: int, rank: int, index: int) -> tuple[Tensor, Tensor, bool]:
    g = torch.Generator().manual_seed(7919 * round_ + 97 * rank + index)
    tokens = torch.randint(0, VOCAB, (3, 4), generator=g)
    targets = torch.randint(0, VOCAB, (3, 4), generator=g)
    return tokens, targets, (round_ + index) % 2 == 0  # the branch is unused in half the micro-batches


def loss(model: nn.Module, tokens: Tensor, targets: Tensor, use_branch: bool) -> Tensor:
    return F.cross_entropy(model(tokens, use_branch).flatten(0, 1), targets.flatten())


def train_rank(layout: str, rounds: int) -> dict:
    rank = this_rank()
    model = TiedModel()
    frozen_before = model.frozen.weight.detach().clone()
    params = [p for p in model.parameters()] + [model.head.weight]  # the tied weight listed twice
    opt = AccoOptimizer(params, torch.optim.AdamW, mode="sync", layout=layout, lr=1e-2, timeout=TIMEOUT)
    for r in range(rounds):
        for i in range(2):
            loss(model, *data(r, rank, i)).backward()
            opt.accumulate()
        opt.step()
    opt.finish()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "managed": sum(len(g["params"]) for g in opt.param_groups),
        "frozen_unchanged": torch.equal(model.frozen.weight, frozen_before),
        "tied": model.head.weight is model.embed.weight,
    }


def plain_training(rounds: int, world_size: int) -> dict[str, Tensor]:
    model = TiedModel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for r in range(rounds):
        opt.zero_grad()
        batches = [data(r, rank, i) for rank in range(world_size) for i in range(2)]
        total = sum(loss(model, *b) for b in batches) / len(batches)
        total.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["flat", "tensor"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_tied_frozen_and_unused_parameters(ranks, world_size, layout) -> None:
    """A tied weight is managed once, a frozen layer is left alone and a branch unused in some micro-
    batches counts as zero: sync equals plain training, the same on every rank."""
    rounds = 4
    results = [train_rank(layout, rounds)] if world_size == 1 else ranks(world_size).run(train_rank, layout, rounds)
    expected = plain_training(rounds, world_size)
    for result in results:
        assert result["managed"] == 5  # embed (= head), mix.weight, mix.bias, sometimes.weight, sometimes.bias
        assert result["frozen_unchanged"] and result["tied"]
        assert_params_close(result["params"], expected)
    assert_identical_across_ranks(results)


def test_a_parameter_without_grad_in_a_whole_round_counts_as_zero() -> None:
    """Unlike plain torch optimizers (which skip p.grad None), a sharded flat update sees
    zero: with SGD and no momentum or decay that leaves the parameter unchanged."""
    model = TiedModel()
    before = model.sometimes.weight.detach().clone()
    opt = AccoOptimizer(model, torch.optim.SGD, mode="sync", lr=0.1)
    loss(model, *data(1, 0, 0)).backward()  # (1 + 0) % 2 == 1: the branch is unused
    opt.accumulate()
    assert opt.step()
    assert torch.equal(model.sometimes.weight, before)
    assert not torch.equal(model.mix.weight, TiedModel().mix.weight)


@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_a_zero_size_parameter_is_carried_along(mode: str) -> None:
    """An empty parameter (used or not) never blocks a round: its accumulator view holds no
    memory, so it is told apart by identity, not by address."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.register_parameter("empty", nn.Parameter(torch.zeros(0, 3)))
    opt = AccoOptimizer(model, torch.optim.SGD, mode=mode, lr=0.1)
    for r in range(4):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(r))
        (model(x).sum() + (model.empty @ x.T).sum() * (r % 2)).backward()
        opt.accumulate()
        opt.step()
    with opt.micro_batch(2.0):
        model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.finish()
    assert model.empty.shape == (0, 3) and torch.isfinite(model.weight).all()
