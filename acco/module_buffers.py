"""Module buffers (BatchNorm running statistics) kept identical across ranks.

DDP broadcasts rank 0's buffers before every forward. acco has no forward hook and no
collective on the training thread: the buffers ride with the rounds instead
(docs/design.md, "Module buffers"):

- at each hand-over, a *snapshot* of this rank's persistent buffers is taken (after the
  previous round has landed);
- the comm lane synchronises the snapshots during the round (after its all-gather): rank 0's
  (``"broadcast"``) or the mean over ranks (``"average"``; integer buffers such as
  ``num_batches_tracked`` take rank 0's, a mean of counts being no count);
- when the round lands, ``"broadcast"`` gives ranks other than 0 rank 0's snapshot (rank 0
  keeps its own buffers, as with DDP), and ``"average"`` gives every rank the mean plus what
  its own forward passes changed since its snapshot;
- ``finish()`` synchronises once more, without delay: afterwards every rank holds the same
  buffers, rank 0's or the mean of everyone's.

During training the buffers therefore lag by one round on the ranks that take others'
values. Non-persistent buffers (RoPE caches) are never touched.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from acco.collectives import Collectives

__all__ = ["BufferPolicy", "BufferSnapshot", "BufferSync", "buffer_sync_for"]


class BufferPolicy(str, enum.Enum):
    """How floating-point persistent module buffers are kept identical across ranks."""

    BROADCAST = "broadcast"  # rank 0's, as DDP's broadcast_buffers=True
    AVERAGE = "average"  # the mean over ranks


@dataclass
class BufferSnapshot:
    """One round's copy of this rank's buffers and, once the lane has run, their
    synchronised values (``synced``, in the same order)."""

    values: list[Tensor]
    synced: list[Tensor] | None = None


class BufferSync:
    """Snapshots, synchronises and lands one module's persistent buffers.

    Buffers are looked up by name each time, so a buffer the model replaces
    (``module.running_mean = new_tensor``, ``model.to(...)``) stays synchronised.

    Args:
        module: the model whose buffers to keep identical.
        policy: ``BufferPolicy.BROADCAST`` or ``BufferPolicy.AVERAGE``.
        rank: this rank in acco's process group.
        world_size: the group's size.
    """

    def __init__(self, module: nn.Module, policy: BufferPolicy, rank: int, world_size: int) -> None:
        persistent = module.state_dict(keep_vars=True)
        self.names = [name for name, _ in module.named_buffers() if name in persistent]
        self._module = module
        self.policy = policy
        self.rank, self.world_size = rank, world_size

    @property
    def buffers(self) -> list[Tensor]:
        return [self._module.get_buffer(name) for name in self.names]

    def fingerprint(self) -> str:
        return f"{self.policy.value}:" + ";".join(
            f"{name}:{tuple(b.shape)}:{b.dtype}:{b.device.type}" for name, b in zip(self.names, self.buffers)
        )

    def snapshot(self) -> BufferSnapshot:
        """A copy of the buffers now (on the calling thread's stream)."""
        return BufferSnapshot([b.detach().clone() for b in self.buffers])

    def synchronised(self, comm: Collectives, *, broadcast: bool = False) -> BufferSnapshot:
        """A snapshot taken and synchronised now (collective, at once)."""
        snapshot = self.snapshot()
        self.synchronise(snapshot, comm, broadcast=broadcast)
        return snapshot

    def synchronise(self, snapshot: BufferSnapshot, comm: Collectives, *, broadcast: bool = False) -> None:
        """On the comm lane: ``snapshot.synced`` = rank 0's values, or the mean over ranks
        for floating-point buffers under ``"average"`` (unless ``broadcast``, as at
        construction). One collective per dtype."""
        synced = [v.clone() for v in snapshot.values]
        average = [self.policy is BufferPolicy.AVERAGE and not broadcast and v.is_floating_point() for v in synced]
        for reduce in (True, False):
            chosen = [v for v, a in zip(synced, average) if a is reduce]
            for dtype in sorted({v.dtype for v in chosen}, key=str):
                same = [v for v in chosen if v.dtype == dtype]
                flat = torch.cat([v.reshape(-1) for v in same])
                if reduce:
                    comm.all_reduce_sum_(flat)
                    flat.div_(self.world_size)
                else:
                    comm.broadcast_(flat, src=0)
                parts = flat.split([v.numel() for v in same])
                torch._foreach_copy_(same, [part.view(v.shape) for part, v in zip(parts, same)])
        snapshot.synced = synced

    def land(self, snapshot: BufferSnapshot, *, exact: bool = False) -> None:
        """Write a synchronised snapshot into the buffers (see the module docstring);
        ``exact``: every rank takes the synchronised values as they are (``finish()``)."""
        if snapshot.synced is None:
            raise AssertionError("BufferSync.land() of a snapshot the comm lane has not synchronised")
        with torch.no_grad():
            for buffer, before, synced in zip(self.buffers, snapshot.values, snapshot.synced):
                if exact:
                    buffer.copy_(synced)
                elif self.policy is BufferPolicy.AVERAGE and buffer.is_floating_point():
                    buffer.copy_(synced + (buffer - before))  # the mean, plus this rank's updates since
                elif self.rank != 0:
                    buffer.copy_(synced)  # rank 0's; rank 0 keeps its own, as with DDP

    def state_dict(self, pending: BufferSnapshot | None) -> dict[str, Any]:
        """This rank's live buffers and the snapshot of the round in flight (``pending``,
        already synchronised), if any."""
        return {
            "names": list(self.names),
            "live": [b.detach().clone() for b in self.buffers],
            "snapshot": None if pending is None else list(pending.values),
            "synced": None if pending is None or pending.synced is None else list(pending.synced),
        }

    def check_state_dict(self, saved: dict[str, Any]) -> None:
        """``ValueError`` unless ``saved`` holds buffers of these names, shapes and dtypes."""
        if list(saved["names"]) != self.names:
            raise ValueError(f"saved module buffers {saved['names']} differ from this module's {self.names}")
        for name, value, buffer in zip(self.names, saved["live"], self.buffers):
            if not isinstance(value, Tensor) or value.shape != buffer.shape or value.dtype != buffer.dtype:
                raise ValueError(f"saved module buffer {name!r} does not match this module's {tuple(buffer.shape)} {buffer.dtype}")

    def load_state_dict(self, saved: dict[str, Any]) -> BufferSnapshot | None:
        """Restore the live buffers (checked by :meth:`check_state_dict`); returns the round
        in flight's snapshot, if any."""
        buffers = self.buffers
        with torch.no_grad():
            torch._foreach_copy_(buffers, [v.to(b.device) for v, b in zip(saved["live"], buffers)])
        if saved["snapshot"] is None:
            return None
        devices = [b.device for b in buffers]
        return BufferSnapshot(
            [v.to(d) for v, d in zip(saved["snapshot"], devices)], [v.to(d) for v, d in zip(saved["synced"], devices)]
        )


def buffer_sync_for(
    module: nn.Module | None, policy: BufferPolicy | None, rank: int, world_size: int
) -> BufferSync | None:
    """The buffers to keep identical: None without a module or a policy, with one rank, or
    when the module has no persistent buffer (then nothing is snapshot or sent)."""
    if module is None or policy is None or world_size == 1:
        return None
    sync = BufferSync(module, policy, rank, world_size)
    return sync if sync.names else None
