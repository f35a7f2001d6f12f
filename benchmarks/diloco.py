"""DiLoCo (Douillard et al. 2023, arXiv 2311.08105) for the benchmarks, through torchft's
``torchft.local_sgd.DiLoCo``: each rank a replica group of one, rank 0 running torchft's
lighthouse. An inner step covers ``micro_batches_per_update`` micro-batches, like every
other method's update; ``end_round()`` is True only when the ranks have just synchronised,
the only time they all hold one model, and ``finish()`` puts that model back.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import Method, ModelConfig
from torch import nn

from examples.train_gpt import param_groups

__all__ = ["TorchftDiLoCoMethod", "torchft_version"]

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
INSTALL = "pip install -e '.[bench]'"
# torchft's Rust side logs every quorum at INFO unless told otherwise; it reads this when
# the extension loads, so before the first import.
os.environ.setdefault("RUST_LOG", "warn")


def torchft_version() -> str | None:
    """torchft's version if it imports here, else None."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        return None
    return importlib.metadata.version("torchft")


class TorchftDiLoCoMethod(Method):
    """The inner AdamW (the other methods' warm-up per inner step and clipping), synchronised
    by torchft every H (``diloco-hH``) steps. Collective: every rank constructs it and calls
    ``close()``.

    Raises:
        ImportError: torchft is not installed.
    """

    def __init__(self, name: str, config: ModelConfig, micro_batches_per_update: int, model: nn.Module,
                 schedule: Callable[[int], float], timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> None:
        if torchft_version() is None:
            raise ImportError(f"{name}: DiLoCo runs through torchft, which does not import here ({INSTALL})")
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo

        super().__init__(name, config, micro_batches_per_update, model)
        self.sync_every = int(name.removeprefix("diloco-h"))
        self.inner = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.inner, schedule)
        self.inner_steps = self.outer_steps = 0
        self._params = [p for p in model.parameters() if p.requires_grad]
        rank, world = dist.get_rank(), dist.get_world_size()
        # The lighthouse (torchft's quorum server) runs on rank 0; its address reaches the
        # others through the default group's store-backed broadcast.
        self._lighthouse = LighthouseServer(bind="0.0.0.0:0", min_replicas=world) if rank == 0 else None
        address = [self._lighthouse.address() if self._lighthouse is not None else None]
        dist.broadcast_object_list(address, src=0)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

        def load_state_dict(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])

        # use_async_quorum=False: DiLoCo requires it. init_sync=False: every rank built the same
        # model from the same seed; with init_sync, the first quorum would make one replica
        # fetch the other's state over HTTP mid-run.
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, load_state_dict=load_state_dict,
            state_dict=lambda: {"model": model.state_dict()}, replica_id=f"rank{rank}", store_addr="127.0.0.1",
            store_port=self._store.port, rank=0, world_size=1, lighthouse_addr=address[0], hostname="127.0.0.1",
            use_async_quorum=False, init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
        self.outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        self.diloco = DiLoCo(self.manager, [model], self.inner, self.outer, sync_every=self.sync_every)
        self.diloco.__enter__()  # registers its hooks on the inner optimizer
        self.synced = [p.detach().clone() for p in self._params]

    def end_round(self) -> bool:
        before = self.manager.current_step()  # counts committed synchronisations
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.config.max_grad_norm)
        self.inner.step()  # torchft synchronises in the inner optimizer's post-step hook
        self.inner.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.inner_steps += 1
        if self.manager.current_step() == before:
            return False
        self.outer_steps += 1
        with torch.no_grad():
            for s, p in zip(self.synced, self._params):
                s.copy_(p)
        return True

    def finish(self) -> bool:
        with torch.no_grad():
            for s, p in zip(self.synced, self._params):
                p.copy_(s)
        return False

    def committed_updates(self, counted: int) -> int:
        return self.outer_steps * self.sync_every  # the inner steps merged into the synchronised model

    def committed_micro_batches(self, counted: int) -> float:
        return self.committed_updates(counted) * self.micro_batches_per_update * dist.get_world_size()

    def close(self) -> None:
        """Leave torchft (collective: the lighthouse goes once every rank is done)."""
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        dist.barrier()
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
