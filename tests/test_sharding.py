"""Property tests for :mod:`acco.sharding`: plans, flat buffers and gradient accumulation.

Every property is checked for both layouts over random lists of shapes (0-4 dims, small
sizes, zero-size dims sometimes, 1..12 tensors) and world sizes 1..8.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from acco.folding import fold_grads
from acco.sharding import Layout, ShardedGroup, ShardPlan, plan_flat, plan_layout, plan_tensor

pytestmark = pytest.mark.timeout(60)
LAYOUTS = [Layout.FLAT, Layout.TENSOR]

# One dimension: mostly 1..4, zero about one time in seven.
dims = st.sampled_from([0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
shape = st.lists(dims, min_size=0, max_size=4).map(tuple)
shape_lists = st.lists(shape, min_size=1, max_size=12)
world_sizes = st.integers(min_value=1, max_value=8)
# Dtypes whose conversion to the fp32 master is exact, so shards compare bit for bit.
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def numel(s: tuple[int, ...]) -> int:
    return math.prod(s)


def make_params(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]


def coverage(plan: ShardPlan) -> torch.Tensor:
    """How many parameter elements sit on each position of the padded buffer."""
    count = torch.zeros(plan.padded_numel, dtype=torch.int64)
    for s in plan.slots:
        count[s.offset : s.offset + s.numel] += 1
    return count


def expected_buffer(plan: ShardPlan, params) -> torch.Tensor:
    out = torch.zeros(plan.padded_numel, dtype=params[0].dtype)
    for s, p in zip(plan.slots, params):
        out[s.offset : s.offset + s.numel] = p.detach().reshape(-1)
    return out


# --------------------------------------------------------------------------- plans


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=150, deadline=None)
@given(shapes=shape_lists, world_size=world_sizes)
def test_every_element_owned_by_exactly_one_rank(layout, shapes, world_size) -> None:
    """Both layouts: rank ranges tile the padded buffer and every parameter element lies in exactly one
    rank's shard."""
    plan = plan_layout(layout, shapes, world_size)
    assert plan.layout is layout
    assert plan.world_size == world_size
    assert len(plan.slots) == len(shapes)

    # Slots describe the parameters they stand for.
    for s, shp in zip(plan.slots, shapes):
        assert s.shape == torch.Size(shp)
        assert s.numel == numel(shp)

    # Rank ranges tile [0, padded_numel) in order, without gaps or overlaps.
    ranges = [plan.rank_range(r) for r in range(world_size)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == plan.padded_numel
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        assert stop == start
    assert all(stop - start == plan.chunk for start, stop in ranges)

    # Every slot lies inside the buffer and no two slots share an element.
    for s in plan.slots:
        assert 0 <= s.offset and s.offset + s.numel <= plan.padded_numel
    count = coverage(plan)
    assert int(count.max()) <= 1
    assert int(count.sum()) == sum(numel(s) for s in shapes)

    # Hence every element of every parameter lies in exactly one rank's range.
    for s in plan.slots:
        for position in range(s.offset, s.offset + s.numel):
            holders = [r for r, (start, stop) in enumerate(ranges) if start <= position < stop]
            assert len(holders) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=150, deadline=None)
@given(shapes=shape_lists, world_size=world_sizes)
def test_padding(layout, shapes, world_size) -> None:
    """The padded buffer is world_size equal chunks; the flat layout pads by less than world_size and
    keeps parameters back to back."""
    plan = plan_layout(layout, shapes, world_size)
    total = sum(numel(s) for s in shapes)
    assert plan.chunk >= 1
    assert plan.padded_numel == world_size * plan.chunk
    assert plan.padded_numel >= total
    if layout is Layout.FLAT:
        assert plan.chunk == max(1, math.ceil(total / world_size))
        if total > 0:
            assert plan.padded_numel - total < world_size
        # Back to back, in parameter order.
        offset = 0
        for s in plan.slots:
            assert s.offset == offset
            offset += s.numel


@settings(max_examples=150, deadline=None)
@given(shapes=shape_lists, world_size=world_sizes)
def test_tensor_layout_whole_tensors_and_balance(shapes, world_size) -> None:
    """The tensor layout puts each tensor whole in one rank's shard, owned() partitions the tensors,
    and the largest load is within the greedy bound."""
    plan = plan_tensor(shapes, world_size)
    total = sum(numel(s) for s in shapes)
    largest = max(numel(s) for s in shapes)

    loads = [0] * world_size
    owners = []
    for i, s in enumerate(plan.slots):
        owner = plan.owner(i)
        assert owner is not None, f"slot {i} straddles ranks"
        owners.append(owner)
        if s.numel > 0:
            start, stop = plan.rank_range(owner)
            assert start <= s.offset and s.offset + s.numel <= stop
            loads[owner] += s.numel

    # owned() agrees with owner() and, over the ranks, partitions the indices.
    assert all(0 <= owner < world_size for owner in owners)
    seen: list[int] = []
    for r in range(world_size):
        owned = plan.owned(r)
        assert owned == sorted(owned)
        assert all(owners[i] == r for i in owned)
        seen.extend(owned)
    assert sorted(seen) == list(range(len(shapes)))

    # Greedy list-scheduling bound, and the chunk is exactly the largest load.
    assert max(loads) <= math.ceil(total / world_size) + largest
    assert plan.chunk == max(1, max(loads))
    assert plan.chunk <= max(1, math.ceil(total / world_size) + largest)
    if total > 0:
        assert plan.chunk <= math.ceil(total / world_size) + largest


@settings(max_examples=150, deadline=None)
@given(shapes=shape_lists, world_size=world_sizes)
def test_flat_layout_owner_matches_chunk_boundaries(shapes, world_size) -> None:
    """In the flat layout a tensor has an owner exactly when it lies within one chunk."""
    plan = plan_flat(shapes, world_size)
    for i, s in enumerate(plan.slots):
        if s.numel == 0:
            assert plan.owner(i) in range(world_size)
            continue
        first, last = s.offset // plan.chunk, (s.offset + s.numel - 1) // plan.chunk
        assert plan.owner(i) == (first if first == last else None)
        if first == last:
            assert i in plan.owned(first)
        else:
            assert all(i not in plan.owned(r) for r in range(world_size))


@pytest.mark.parametrize(
    "layout, shapes, world_size",
    [
        # tensor, one rank: slot 1 sits at offset 2 == chunk, owner(1) == 1, owned(0) == [0]
        (Layout.TENSOR, [(2,), (0,)], 1),
        (Layout.TENSOR, [(0,), (3, 2), (0, 5)], 1),
        # flat: total divisible by world_size, the empty slot at offset == padded_numel
        (Layout.FLAT, [(4,), (0,)], 2),
        (Layout.FLAT, [(2, 3), (0,)], 3),
    ],
)
def test_zero_size_tensor_owner_is_a_real_rank(layout, shapes, world_size) -> None:
    """Regression: an empty slot starting where the buffer ends used to get owner() ==
    world_size, a rank that does not exist, so every rank's owned() left it out."""
    plan = plan_layout(layout, shapes, world_size)
    for i in range(len(plan.slots)):
        owner = plan.owner(i)
        assert owner is None or 0 <= owner < world_size, f"owner({i}) == {owner}"
    if layout is Layout.TENSOR:
        owned = sorted(i for r in range(world_size) for i in plan.owned(r))
        assert owned == list(range(len(shapes)))


# --------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=60, deadline=None)
@given(shapes=shape_lists, world_size=world_sizes, dtype=dtypes, seed=st.integers(0, 2**16))
def test_flatten_unflatten_round_trip(layout, shapes, world_size, dtype, seed) -> None:
    """Parameters go into the flat buffer and back unchanged (padding zero), and the ranks' fp32 master
    shards rebuild the buffer."""
    params = make_params(shapes, dtype, seed)
    originals = [p.detach().clone() for p in params]
    plan = plan_layout(layout, shapes, world_size)
    groups = [ShardedGroup(params, plan, rank) for rank in range(world_size)]
    group = groups[0]

    initial = group.initial_values()
    assert initial.shape == (plan.padded_numel,)
    assert initial.dtype == torch.float32
    expected = expected_buffer(plan, originals)
    assert torch.equal(initial, expected.float())
    group.gathered.copy_(initial)

    # Padding (positions no parameter covers) stays zero.
    padding = coverage(plan) == 0
    assert int(padding.sum()) == plan.padded_numel - sum(numel(s) for s in shapes)
    assert torch.equal(group.gathered[padding], torch.zeros(int(padding.sum()), dtype=dtype))

    # Zero the live parameters, then load them back from the buffer.
    with torch.no_grad():
        for p in params:
            p.zero_()
    assert all(not p.any() for p in params)
    group.load_params_from_buffer()
    for p, original in zip(params, originals):
        assert p.is_leaf and p.requires_grad
        assert p.dtype == dtype and p.shape == original.shape
        assert torch.equal(p.detach(), original)

    # Each rank's master shard, concatenated, rebuilds the padded buffer.
    for g in groups:
        g.set_initial_values(g.initial_values())
        assert g.master.dtype == torch.float32
        assert g.master.shape == (plan.chunk,)
    rebuilt = torch.cat([g.master for g in groups])
    assert torch.equal(rebuilt, expected.float())


@settings(max_examples=60, deadline=None)
@given(shapes=shape_lists, world_size=world_sizes, dtype=dtypes, seed=st.integers(0, 2**16))
def test_tensor_layout_shard_views(shapes, world_size, dtype, seed) -> None:
    """Tensor layout: the master views have the owned parameters' shapes and values and alias the
    master shard."""
    params = make_params(shapes, dtype, seed)
    plan = plan_tensor(shapes, world_size)
    for rank in range(world_size):
        group = ShardedGroup(params, plan, rank)
        group.set_initial_values(group.initial_values())
        owned = plan.owned(rank)
        views = group.master_views
        assert len(views) == len(owned)
        for view, i in zip(views, owned):
            assert view.shape == params[i].shape
            assert view.dtype == torch.float32
            assert torch.equal(view, params[i].detach().float())
        # shard_views of another chunk-sized tensor: same shapes, views into that tensor.
        other = torch.arange(plan.chunk, dtype=torch.float32)
        start, _ = plan.rank_range(rank)
        for view, i in zip(group.shard_views(other), owned):
            s = plan.slots[i]
            assert view.shape == s.shape
            assert torch.equal(view.reshape(-1), other[s.offset - start : s.offset - start + s.numel])
        # master_views alias master: the base optimizer's writes land in the shard.
        for view in views:
            view.fill_(7.0)
        for i in owned:
            s = plan.slots[i]
            assert (group.master[s.offset - start : s.offset - start + s.numel] == 7.0).all()


@settings(max_examples=60, deadline=None)
@given(shapes=shape_lists, world_size=world_sizes, seed=st.integers(0, 2**16))
def test_flat_layout_shard_views_is_the_single_chunk(shapes, world_size, seed) -> None:
    """Flat layout: the shard's single view is the whole chunk, aliasing the master shard."""
    params = make_params(shapes, torch.float32, seed)
    plan = plan_flat(shapes, world_size)
    for rank in range(world_size):
        group = ShardedGroup(params, plan, rank)
        shard = torch.randn(plan.chunk)
        views = group.shard_views(shard)
        assert len(views) == 1
        assert views[0] is shard or (views[0].data_ptr() == shard.data_ptr() and views[0].shape == shard.shape)
        assert views[0].dim() == 1 and views[0].numel() == plan.chunk
        assert len(group.master_views) == 1
        assert group.master_views[0].data_ptr() == group.master.data_ptr()
        assert group.master_views[0].shape == (plan.chunk,)


# --------------------------------------------------------------------------- gradients


@st.composite
def grad_rounds(draw):
    """Shapes, world size, and a few micro-batches: (weight, which params have a grad)."""
    shapes = draw(shape_lists)
    world_size = draw(world_sizes)
    batches = draw(
        st.lists(
            st.tuples(
                st.floats(-4, 4, allow_nan=False, width=32),
                st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)),
            ),
            min_size=1,
            max_size=3,
        )
    )
    return shapes, world_size, batches


def run_batches(group, params, batches, gen, expected):
    """Give params random grads, accumulate, and update ``expected`` the same way."""
    for weight, has_grad in batches:
        for p, s, present in zip(params, group.plan.slots, has_grad):
            if present:
                p.grad = torch.randn(p.shape, generator=gen)
                expected[s.offset : s.offset + s.numel] += weight * p.grad.reshape(-1)
            else:
                p.grad = None
        assert fold_grads(group, weight) is any(has_grad)
        assert all(p.grad is None for p in params), "grads are consumed"


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=60, deadline=None)
@given(case=grad_rounds(), seed=st.integers(0, 2**16))
def test_accumulate_and_hand_over(layout, case, seed) -> None:
    """Accumulated gradients are the weighted sum (zero for missing grads and padding); an estimate
    round's hand-over is a copy while accumulation goes on, a commit round's takes everything and
    restarts at zero."""
    shapes, world_size, batches = case
    gen = torch.Generator().manual_seed(seed)
    params = make_params(shapes, torch.float32, seed)
    plan = plan_layout(layout, shapes, world_size)
    group = ShardedGroup(params, plan, rank=world_size - 1)
    padding = coverage(plan) == 0

    # Batches 1: accumulate; padding and grad-less params contribute zero.
    expected = torch.zeros(plan.padded_numel)
    run_batches(group, params, batches, gen, expected)
    torch.testing.assert_close(group.grad_accumulator, expected)
    assert not group.grad_accumulator[padding].any()

    # An estimate round: the handover holds a copy, the accumulator keeps its contents.
    accumulator = group.grad_accumulator
    handed = group.hand_over(keep_accumulating=True)
    assert handed is group.grad_handover
    assert handed.data_ptr() != group.grad_accumulator.data_ptr()
    assert group.grad_accumulator is accumulator
    torch.testing.assert_close(handed, expected)
    torch.testing.assert_close(group.grad_accumulator, expected)

    # Batches 2 add on top of batches 1 without touching the handed-over copy.
    snapshot = handed.clone()
    run_batches(group, params, batches, gen, expected)
    torch.testing.assert_close(group.grad_accumulator, expected)
    assert torch.equal(handed, snapshot)

    # A commit round: returns everything accumulated, the accumulator restarts at zero.
    handed = group.hand_over(keep_accumulating=False)
    assert handed is group.grad_handover
    torch.testing.assert_close(handed, expected)
    assert handed.data_ptr() != group.grad_accumulator.data_ptr()
    assert group.grad_accumulator.shape == (plan.padded_numel,)
    assert not group.grad_accumulator.any()

    # Accumulating afterwards writes into the new accumulator only.
    snapshot = handed.clone()
    fresh = torch.zeros(plan.padded_numel)
    run_batches(group, params, batches, gen, fresh)
    torch.testing.assert_close(group.grad_accumulator, fresh)
    assert torch.equal(handed, snapshot)
    assert not group.grad_accumulator[padding].any()


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=40, deadline=None)
@given(shapes=shape_lists, world_size=world_sizes, weight=st.floats(-4, 4, allow_nan=False, width=32))
def test_accumulate_without_grads_is_a_no_op(layout, shapes, world_size, weight) -> None:
    """accumulate_grads() with no gradient anywhere changes nothing and returns False."""
    params = make_params(shapes)
    plan = plan_layout(layout, shapes, world_size)
    group = ShardedGroup(params, plan, rank=0)
    group.grad_accumulator.fill_(1.5)
    assert fold_grads(group, weight) is False
    assert torch.equal(group.grad_accumulator, torch.full((plan.padded_numel,), 1.5))
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulate_grads_from_backward(layout) -> None:
    """Gradients from a real backward land weighted in their slots; an unused parameter contributes
    zero."""
    shapes = [(2, 3), (), (0, 4), (5,)]
    params = make_params(shapes)
    plan = plan_layout(layout, shapes, 3)
    group = ShardedGroup(params, plan, rank=1)
    coefficients = [torch.randn(s) for s in shapes]
    # The scalar param is unused: it gets no grad and contributes zero.
    loss = sum((p * c).sum() for i, (p, c) in enumerate(zip(params, coefficients)) if i != 1)
    loss.backward()
    assert params[1].grad is None
    assert fold_grads(group, 0.5) is True
    for i, (s, c) in enumerate(zip(plan.slots, coefficients)):
        got = group.grad_accumulator[s.offset : s.offset + s.numel].view(s.shape)
        torch.testing.assert_close(got, torch.zeros_like(c) if i == 1 else 0.5 * c)
    assert all(p.grad is None for p in params)


def test_sparse_gradients_are_rejected() -> None:
    """A sparse gradient is a TypeError."""
    params = make_params([(3, 2)])
    group = ShardedGroup(params, plan_flat([(3, 2)], 2), rank=0)
    params[0].grad = torch.eye(3, 2).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        fold_grads(group, 1.0)
