"""The update's kernels: the clipping norm in pieces against float64 and torch's
``clip_grad_norm_``, and the base optimizer built fused where the user chose no implementation.
Speed lives in benchmarks/update_cost.py; these check what the fast paths compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from acco import AccoOptimizer
from acco.sharding import NORM_PIECE, squared_norm

MAX_NORM = 0.05  # small enough that every update is clipped


def wide_model() -> nn.Module:
    """More elements than a few norm pieces, so the pieces and their sum in float64 are exercised."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 400), nn.Tanh(), nn.Linear(400, 300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_squared_norm_in_pieces_equals_float64(dtype: torch.dtype) -> None:
    values = (torch.randn(3 * NORM_PIECE + 17, generator=torch.Generator().manual_seed(1)) * 1e3).to(dtype)
    expected = values.double().square().sum()
    got = squared_norm(values)
    assert got.dtype == torch.float64 and got.dim() == 0
    # each piece's squares add up in float32 (as in torch's clip_grad_norm_, over whole tensors)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=0.0)
    assert float(squared_norm(values[:0])) == 0.0


@pytest.mark.parametrize("implementation", [{}, {"foreach": True}])
def test_clipping_equals_clip_grad_norm_(implementation: dict) -> None:
    """One process, sync: acco's clipped update equals torch's AdamW after ``clip_grad_norm_`` with
    the same kernel (fused at acco's default), and the norm it records is the one torch returns."""
    model, reference = wide_model(), wide_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="sync", max_grad_norm=MAX_NORM, lr=1e-2, **implementation)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, **(implementation or {"fused": True}))
    data = torch.Generator().manual_seed(2)
    norms = []
    for _ in range(5):
        x = torch.randn(16, 300, generator=data)
        model(x).square().mean().backward()
        opt.accumulate()
        opt.step()
        reference(x).square().mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)))
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
    opt.finish()
    assert all(norm > MAX_NORM for norm in norms)
    recorded = [stats.grad_norm for stats in opt.round_stats]
    torch.testing.assert_close(torch.tensor(recorded), torch.tensor(norms), rtol=1e-5, atol=0.0)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs)


def test_fused_is_chosen_where_the_user_chose_no_implementation() -> None:
    model = nn.Linear(8, 8)
    for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        opt = AccoOptimizer(model, cls, mode="sync", lr=0.1)
        assert opt.param_groups[0]["fused"] is True
        assert opt.base_optimizers[0].param_groups[0]["fused"] is True
        opt.finish()
    chosen = [({"foreach": True}, None, True), ({"fused": False}, False, None), ({"foreach": False}, None, False)]
    for given, fused, foreach in chosen:
        opt = AccoOptimizer(model, torch.optim.AdamW, mode="dpu", **given)
        assert (opt.param_groups[0]["fused"], opt.param_groups[0]["foreach"]) == (fused, foreach)
        opt.finish()
    opt = AccoOptimizer(model, torch.optim.RMSprop, mode="sync")  # no fused kernel: torch's own default
    assert "fused" not in opt.param_groups[0]
    opt.finish()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="local")  # the inner optimizer runs on the live parameters
    assert opt.param_groups[0]["fused"] is None
    opt.finish()


def test_a_state_that_chose_no_kernel_loads_fused_and_continues_alike() -> None:
    """A state saved before acco chose a kernel (``fused`` and ``foreach`` None) loads into a fused
    optimizer, which goes on as the saving one does."""
    model = wide_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="sync", max_grad_norm=MAX_NORM, lr=1e-2)
    data = torch.Generator().manual_seed(3)
    batches = [torch.randn(16, 300, generator=data) for _ in range(4)]
    for x in batches[:2]:
        model(x).square().mean().backward()
        opt.accumulate()
        opt.step()
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        group["fused"] = None
    resumed = wide_model()
    resumed.load_state_dict(model.state_dict())
    again = AccoOptimizer(resumed, torch.optim.AdamW, mode="sync", max_grad_norm=MAX_NORM, lr=1e-2)
    again.load_state_dict(saved)
    assert again.param_groups[0]["fused"] is True
    for x in batches[2:]:
        for net, optimizer in ((model, opt), (resumed, again)):
            net(x).square().mean().backward()
            optimizer.accumulate()
            optimizer.step()
    opt.finish()
    again.finish()
    for mine, theirs in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0.0, atol=0.0)


def test_sync_gathers_into_the_parameters_and_follows_a_replaced_tensor() -> None:
    """sync with fp32 parameters: they are views of the all-gather's target (a landed round copies
    nothing), and a parameter whose ``.data`` the user replaced is updated from its new values."""
    model, reference = wide_model(), wide_model()
    opt = AccoOptimizer(model, torch.optim.AdamW, mode="sync", lr=1e-2)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    group = opt.sharded_groups[0]
    assert group.gathers_into_params
    start = group.gathered.data_ptr()
    end = start + group.gathered.nbytes
    assert all(start <= p.data_ptr() < end for p in model.parameters())
    data = torch.Generator().manual_seed(4)
    for step in range(3):
        if step == 1:
            replaced = torch.randn(model[0].weight.shape, generator=data)
            model[0].weight.data = replaced.clone()
            reference[0].weight.data = replaced.clone()
        x = torch.randn(16, 300, generator=data)
        for net in (model, reference):
            net(x).square().mean().backward()
        opt.accumulate()
        opt.step()
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
    opt.finish()
    assert start <= model[0].weight.data_ptr() < end  # seated again
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs)
