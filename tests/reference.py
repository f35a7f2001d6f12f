"""One-process references: the model, the data, and the recurrences of docs/design.md, "The algorithm".

Written from the design's equations, independently of acco's round logic: a full
(unsharded) torch optimizer on a copy of the parameters, gradients recomputed from the
data each rank saw.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Params = dict[str, Tensor]
# One round's micro-batches over all ranks: (inputs, targets, weight) triples.
RoundData = list[tuple[Tensor, Tensor, float]]

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}),
}


def make_model(seed: int = 0, hidden: int = 7) -> nn.Module:
    # Odd sizes: flat chunks cut tensors mid-way and the last chunk is padded.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def micro_batch(round_: int, rank: int, index: int, size: int = 4) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100_000 * round_ + 1_000 * rank + index)
    return torch.randn(size, 5, generator=g), torch.randn(size, 3, generator=g)


def micro_batches_per_round(round_: int, rank: int, uneven: bool) -> int:
    """2 per round, or 2 and 3 in turn (ranks out of step) when ``uneven``."""
    return 2 + ((round_ + rank) % 2 if uneven else 0)


def round_data(rounds: int, world_size: int, uneven: bool) -> list[RoundData]:
    """Every rank's micro-batches of each round at weight 1 (:func:`micro_batches_per_round`)."""
    return [
        [
            (*micro_batch(r, rank, i), 1.0)
            for rank in range(world_size)
            for i in range(micro_batches_per_round(r, rank, uneven))
        ]
        for r in range(rounds)
    ]


def weighted_micro_batch(round_: int, rank: int, index: int) -> tuple[Tensor, Tensor, float]:
    """A micro-batch of 1-6 samples; its gradient is a mean over them, so weight = size."""
    size = 1 + (7 * round_ + 3 * rank + index) % 6
    x, y = micro_batch(round_, rank, index, size=size)
    return x, y, float(size)


def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(model(x), y)


def params_of(model: nn.Module) -> Params:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
# Called with (update number, full optimizer, "estimate" or "commit") before update t's
# estimate and before update t is applied: sets the lr each uses.
UpdateHook = Callable[[int, torch.optim.Optimizer, str], None]


def _factory(optimizer: str | OptimizerFactory) -> OptimizerFactory:
    if callable(optimizer):
        return optimizer
    cls, hp = OPTIMIZERS[optimizer]
    return lambda model: cls(model.parameters(), **hp)


class Reference:
    """A model and a full base optimizer, stepped by hand."""

    def __init__(self, init: Params, optimizer: str | OptimizerFactory, max_norm: float | None = None) -> None:
        self.model = make_model(hidden=init["0.weight"].shape[0])
        self.load(init)
        self.optimizer = _factory(optimizer)(self.model)
        self.max_norm = max_norm
        self.norms: list[float] = []

    def load(self, params: Params) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])

    def params(self) -> Params:
        return params_of(self.model)

    def weighted_grad_sum(self, at: Params, data: RoundData) -> tuple[Params, float]:
        """sum_i w_i * grad(loss_i) at parameters ``at``, and sum_i w_i."""
        model = copy.deepcopy(self.model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(at[name])
        total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        weight = 0.0
        for x, y, w in data:
            model.zero_grad()
            loss_fn(model, x, y).backward()
            for name, p in model.named_parameters():
                total[name] += w * p.grad
            weight += w
        return total, weight

    def apply(self, grad: Params) -> None:
        for name, p in self.model.named_parameters():
            p.grad = grad[name].clone()
        if self.max_norm is not None:
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)))
        self.optimizer.step()

    def estimate(self, grad: Params) -> Params:
        """Opt(theta, grad) on a copy: this reference's parameters and state unchanged."""
        scratch = copy.deepcopy(self)
        scratch.apply(grad)
        return scratch.params()


def _scale(grad: Params, weight: float) -> Params:
    return {k: v / weight for k, v in grad.items()}


def _add(a: Params, b: Params) -> Params:
    return {k: a[k] + b[k] for k in a}


def _hook(on_update: UpdateHook | None, t: int, ref: Reference, kind: str = "commit") -> None:
    if on_update is not None:
        on_update(t, ref.optimizer, kind)


def sync_reference(init: Params, optimizer: str | OptimizerFactory, rounds: Sequence[RoundData],
                   max_norm: float | None = None, on_update: UpdateHook | None = None) -> Params:
    """theta(r+1) = Opt(theta(r), g(r)), g(r) at theta(r)."""
    ref = Reference(init, optimizer, max_norm)
    for r, data in enumerate(rounds):
        grad, weight = ref.weighted_grad_sum(ref.params(), data)
        _hook(on_update, r, ref)
        ref.apply(_scale(grad, weight))
    return ref.params()


def dpu_reference(init: Params, optimizer: str | OptimizerFactory, rounds: Sequence[RoundData],
                  max_norm: float | None = None, on_update: UpdateHook | None = None) -> Params:
    """theta(r+1) = Opt(theta(r), g(r)) where round r's gradient was taken at theta(r-1)."""
    ref = Reference(init, optimizer, max_norm)
    held = ref.params()  # the model's parameters during the round
    for r, data in enumerate(rounds):
        grad, weight = ref.weighted_grad_sum(held, data)
        held = ref.params()
        _hook(on_update, r, ref)
        ref.apply(_scale(grad, weight))
    return ref.params()


def acco_reference(init: Params, optimizer: str | OptimizerFactory, rounds: Sequence[RoundData],
                   max_norm: float | None = None, on_update: UpdateHook | None = None,
                   estimates: Sequence[Params] | None = None) -> Params:
    """Per update t over rounds 2t (estimate) and 2t+1 (commit):

    g~(t) at theta~(t) (theta~(0) = theta(0)), theta~(t+1) = Opt(theta(t), g~(t)) on a copy;
    g(t) at theta(t); theta(t+1) = Opt(theta(t), g~(t) + g(t)) weighted over both rounds.
    A trailing estimate round without its commit is dropped.

    ``estimates``: the look-ahead points actually used (e.g. decompressed from a light
    estimate round); ``estimates[t]`` replaces the computed theta~(t+1).
    """
    ref = Reference(init, optimizer, max_norm)
    estimate = ref.params()
    for t in range(len(rounds) // 2):
        grad_estimate, weight_estimate = ref.weighted_grad_sum(estimate, rounds[2 * t])
        _hook(on_update, t, ref, "estimate")
        next_estimate = ref.estimate(_scale(grad_estimate, weight_estimate))
        if estimates is not None and t < len(estimates):
            next_estimate = estimates[t]
        grad, weight = ref.weighted_grad_sum(ref.params(), rounds[2 * t + 1])
        _hook(on_update, t, ref, "commit")
        ref.apply(_scale(_add(grad_estimate, grad), weight_estimate + weight))
        estimate = next_estimate
    return ref.params()


def flat(tensors: Sequence[Tensor], size: int) -> Tensor:
    """``tensors`` back to back, zero padded to ``size`` (fp32)."""
    out = torch.zeros(size)
    values = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    out[: values.numel()] = values
    return out


def unflat(values: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    out, start = [], 0
    for shape in shapes:
        out.append(values[start : start + shape.numel()].view(shape).clone())
        start += shape.numel()
    return out


def quantised(values: Tensor, bits: int, sizes: Sequence[int], row: int, block: int = 64) -> Tensor:
    """``values`` (the flat layout's padded buffer, fp32) as an outer round of
    ``outer_bits=bits`` delivers them (docs/design.md, "Lighter outer rounds"): 16 is bf16;
    8 and 4 are integer levels in [-L, L] (L = 127, 7) times one scale per block, the block's
    largest magnitude over L rounded to bf16, levels rounded half to even, a block whose scale
    is 0 being 0. Blocks of ``block`` values start at each parameter's first value (``sizes``:
    the parameters', back to back) and again at each row's (one row per replica, ``row``
    values); the padding is 0."""
    if bits == 16:
        return values.bfloat16().float()
    levels = 2 ** (bits - 1) - 1
    out = torch.zeros_like(values)
    cuts = sorted(c for c in {0, *itertools.accumulate(sizes), *range(0, values.numel(), row)} if c <= sum(sizes))
    for start, stop in zip(cuts, cuts[1:]):
        for first in range(start, stop, block):
            part = values[first : min(first + block, stop)]
            scale = (part.abs().max() / levels).bfloat16().float()
            if scale > 0:
                out[first : first + part.numel()] = torch.round(part / scale).clamp(-levels, levels) * scale
    return out


def sparsified(values: Tensor, fraction: float, bits: int, sizes: Sequence[int], row: int, block: int = 4096) -> Tensor:
    """``values`` (the flat layout's padded buffer, fp32) as a sparse outer round
    (``outer_topk=fraction, outer_bits=bits``; docs/design.md, "Sparse outer rounds") delivers
    them: blocks cut as ``quantised``'s (of ``block`` values), each keeping its
    ``ceil(fraction n)`` (at least 1) values largest in magnitude but zeros, the rest 0; kept values
    exact at 32 bits, bf16 at 16, and below, with s the block's largest magnitude rounded to
    bf16 and L = 2 ** (bits - 1), the middle of their step: (floor(v / (s / L)) clipped to
    [-L, L - 1] + 1/2) s / L (0 where s is 0)."""
    out = torch.zeros_like(values)
    cuts = sorted(c for c in {0, *itertools.accumulate(sizes), *range(0, values.numel(), row)} if c <= sum(sizes))
    for start, stop in zip(cuts, cuts[1:]):
        for first in range(start, stop, block):
            part = values[first : min(first + block, stop)]
            order = sorted(range(part.numel()), key=lambda i: -abs(part[i].item()))
            kept = [i for i in order[: max(1, math.ceil(fraction * part.numel()))] if part[i] != 0]
            if not kept:
                continue
            scale = torch.tensor(max(abs(part[i].item()) for i in kept)).bfloat16().float()
            for i in kept:
                if bits == 32:
                    out[first + i] = part[i]
                elif bits == 16:
                    out[first + i] = part[i].bfloat16().float()
                elif scale > 0:
                    half = 2 ** (bits - 1)
                    step = scale / half
                    out[first + i] = (torch.floor(part[i] / step).clamp(-half, half - 1) + 0.5) * step
    return out


RECURRENCES: dict[str, Callable[..., Params]] = {
    "sync": sync_reference,
    "dpu": dpu_reference,
    "acco": acco_reference,
}


def local_reference(init: Params, optimizer: str | OptimizerFactory, steps: Sequence[Sequence[RoundData]],
                    sync_every: int, sync_delay: int, overlap: str = "estimate", max_norm: float | None = None,
                    outer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None, outer_bits: int = 32,
                    error_feedback: bool = True, weighting: str = "tokens", paced: bool = False,
                    outer_topk: float | None = None) -> list[Params]:
    """mode="local" (docs/design.md, "Local steps"), every replica's parameters at the end.

    ``steps[t][m]``: replica m's micro-batches of inner step t, or None: replica m takes no
    step there (a paced replica that took its round's steps; ``sync_delay`` 0 only). Replica m
    starts from ``init`` with its own inner optimizer; after its update of step t (1-based
    count t + 1 = n):
    - a round launched at step n0 lands when n - n0 >= sync_delay: theta_m = x (+ theta_m -
      handed_m with overlap "keep" and sync_delay > 0);
    - when n % sync_every == 0: handed_m = theta_m; x = OuterOpt(x, x - sum_m f_m theta_m / R)
      (the outer optimizer on a whole copy of x, with the library's default Nesterov SGD); with
      sync_delay 0 it lands at once. f_m (docs/design.md, "Replicas of different speeds"):
      with n_m the weights replica m's steps since its last hand-over trained on and N their
      sum, f_m = R n_m / N ("tokens"), 1 ("equal", or every n_m and step count equal), or
      R (n_m / N) tau / tau_m with tau_m its steps and tau = sum_m (n_m / N) tau_m
      ("normalized", FedNova). With N = 0, or no replica having stepped since its hand-over,
      the round leaves x as it is (no outer step: the momentum does not move it either).
    At the end a round in flight lands, then a last one (landing without "keep") over any
    inner step since (``paced``: always), so every replica ends at x.

    ``overlap="estimate"`` (sync_delay > 0; docs/design.md, "The estimate rule") lands as
    "keep" does, and at the launch each replica moves to its start
    s_m = y - lr a P_m, y = x * (1 - lr * a * wd) - lr * b * momentum (x and the outer SGD's
    momentum before this round's step; a = 1 + mu, b = mu^2 with Nesterov, else 1 and mu),
    what the outer step would give if every replica's pseudo-gradient were its own,
    P_m = c - theta_m - A (j / H) d_m: d_m its last start minus the x that corrected it, j the
    steps it took from that start, A = min(1, 0.7 / (lr a)); the landing then adds x_new - s_m.
    Below 32 bits y travels as x does, quantised against a copy.

    Below 32 bits (docs/design.md, "Lighter outer rounds") the replicas land at c, a copy of x
    every rank holds, and the flat layout's rows (one per replica, ceil(P / R) values, zero
    padded) are quantised by ``quantised``: at the launch p_m = c - theta_m + e_m,
    e_m = p_m - Q(p_m) (error feedback; else e_m = 0), x.grad = mean_m Q(p_m) (summed in fp32
    in replica order), the outer step, then c = c + Q(x - c).
    (p_m = e_m + c - theta_m in that order, as acco computes it: a level is a rounding.)
    With ``outer_topk`` Q is ``sparsified`` (at every ``outer_bits``; error feedback at 32 too).
    """
    replicas = [Reference(init, optimizer, max_norm) for _ in steps[0]]
    x = [p.detach().clone().requires_grad_(True) for p in init.values()]
    names = list(init)
    outer_opt = (outer or (lambda ps: torch.optim.SGD(ps, lr=1.0)))(x)  # the default
    in_flight: tuple[int, Params, list[Params]] | None = None  # (launched at, new x, handed)
    unsynced = False

    shapes = [p.shape for p in init.values()]
    sizes = [p.numel() for p in init.values()]
    rows = len(steps[0])
    chunk = -(-sum(p.numel() for p in init.values()) // rows)
    copy_of_x = flat(list(init.values()), rows * chunk)  # c
    residuals = [torch.zeros(rows * chunk) for _ in replicas]
    estimates = overlap == "estimate" and sync_delay > 0
    hp = outer_opt.param_groups[0]
    nesterov = hp.get("nesterov", False) and hp.get("momentum", 0) != 0
    mu = hp.get("momentum", 0.0)
    a, b = (1 + mu, mu * mu) if nesterov else (1.0, mu)

    def common_part() -> Tensor:
        """y, flat and padded like c."""
        parts = []
        for p in x:
            momentum = outer_opt.state[p].get("momentum_buffer") if outer_opt.state.get(p) else None
            value = p.detach() * (1 - hp["lr"] * a * hp.get("weight_decay", 0.0))
            parts.append(value if momentum is None else value - hp["lr"] * b * momentum)
        return flat(parts, rows * chunk)

    copy_of_y = common_part()

    def delivered(values: Tensor) -> Tensor:
        """What one leg of an outer round delivers of ``values`` (flat, padded like c)."""
        if outer_topk is not None:
            return sparsified(values, outer_topk, outer_bits, sizes, chunk)
        return quantised(values, outer_bits, sizes, chunk)

    # The share of a replica's last start offset (start - the x that corrected it) its next
    # estimate takes out of its pseudo-gradient: min(1, 0.7 / (lr a)) for a whole round of steps
    # from that start, j/H of it after j steps (docs/design.md, "The estimate rule").
    recovery = min(1.0, 0.7 / (hp["lr"] * a))
    offsets: list[tuple[int, Params] | None] = [None for _ in replicas]  # (steps from the start, offset)

    def starts(handed: list[Params]) -> list[Params]:
        """Each replica's estimate of the outer step, from its own pseudo-gradient."""
        out, c, y = [], unflat(copy_of_x, shapes), unflat(copy_of_y, shapes)
        for own, offset in zip(handed, offsets):
            start = {}
            for i, k in enumerate(names):
                pseudo_grad = c[i] - own[k]
                if offset is not None:
                    pseudo_grad = pseudo_grad - recovery * offset[0] / sync_every * offset[1][k]
                start[k] = y[i] - hp["lr"] * a * pseudo_grad
            out.append(start)
        return out

    since = [[0.0, 0] for _ in replicas]  # per replica: weights and steps since its hand-over

    def factors() -> list[float] | None:
        weights, counts = [w for w, _ in since], [c for _, c in since]
        for entry in since:
            entry[0], entry[1] = 0.0, 0
        total = sum(weights)
        if not any(counts) or total == 0 and weighting != "equal":
            return [0.0] * len(weights)  # nobody trained since its hand-over: x stays
        if weighting == "equal" or (len(set(weights)) == 1 and len(set(counts)) == 1):
            return None
        shares = [w / total for w in weights]
        if weighting == "tokens":
            return [len(weights) * p for p in shares]
        tau = sum(p * c for p, c in zip(shares, counts))
        return [len(weights) * p * tau / c if c else 0.0 for p, c in zip(shares, counts)]

    def launch(n: int, start: bool = True) -> tuple[int, Params, list[Params]]:
        nonlocal copy_of_x, copy_of_y
        handed = [ref.params() for ref in replicas]
        f = factors()
        merges = f is None or any(f)
        flight_from = handed
        if estimates and start:  # from the last landed round's x and y
            flight_from = starts(handed)
            for ref, own in zip(replicas, flight_from):
                ref.load(own)
        if outer_bits == 32 and outer_topk is None:
            with torch.no_grad():
                for i, name in enumerate(names):
                    thetas = [h[name] if f is None else f[m] * h[name] for m, h in enumerate(handed)]
                    x[i].grad = x[i].detach() - torch.stack(thetas).sum(0) / rows
            if merges:
                outer_opt.step()
            copy_of_x = flat([p.detach() for p in x], rows * chunk)
            copy_of_y = common_part()
            return n, {name: x[i].detach().clone() for i, name in enumerate(names)}, flight_from
        total = torch.zeros(rows * chunk)
        for m, own in enumerate(handed):
            payload = residuals[m] + copy_of_x - flat(list(own.values()), rows * chunk)  # the library's order
            sent = delivered(payload)
            if error_feedback and (outer_bits < 16 or outer_topk is not None):
                residuals[m] = payload - sent
            total += sent if f is None else f[m] * sent
        for i, grad in enumerate(unflat(total / rows, shapes)):
            x[i].grad = grad
        if merges:
            outer_opt.step()
        update = flat([p.detach() for p in x], rows * chunk) - copy_of_x
        copy_of_x = copy_of_x + delivered(update)
        copy_of_y = copy_of_y + delivered(common_part() - copy_of_y)
        return n, dict(zip(names, unflat(copy_of_x, shapes))), flight_from

    def land(flight: tuple[int, Params, list[Params]], keep: bool) -> bool:
        n0, new_x, handed = flight
        for m, (ref, own) in enumerate(zip(replicas, handed)):
            now = ref.params()
            ref.load({k: new_x[k] + (now[k] - own[k]) if keep else new_x[k] for k in new_x})
            kept = keep and n > n0
            offsets[m] = (n - n0, {k: own[k] - new_x[k] for k in new_x}) if kept else None
        return keep and n > n0

    keeps = overlap in ("keep", "estimate") and sync_delay > 0
    n = 0
    for step_data in steps:
        for ref, data, entry in zip(replicas, step_data, since):
            if data is None:
                continue
            grad, weight = ref.weighted_grad_sum(ref.params(), data)
            ref.apply(_scale(grad, weight))
            entry[0] += weight
            entry[1] += 1
        n += 1
        unsynced = True
        if in_flight is not None and n - in_flight[0] >= sync_delay:
            unsynced, in_flight = land(in_flight, keeps), None
        if n % sync_every == 0:
            in_flight = launch(n)
            if sync_delay == 0:
                unsynced, in_flight = land(in_flight, keeps), None
    if in_flight is not None:
        unsynced = land(in_flight, keeps)
    if unsynced or paced:
        land(launch(n, start=False), False)
    return [ref.params() for ref in replicas]
