"""Hugging Face ``transformers.Trainer`` with acco: :class:`AccoTrainer`.

Replace ``Trainer(...)`` with ``AccoTrainer(..., acco_mode="acco")`` and keep the same
``TrainingArguments``. One Trainer step (``state.global_step``) is one committed update in
every mode, of ``gradient_accumulation_steps`` (K) micro-batches per rank:

- ``sync``: one round of K micro-batches; the Trainer's ``optimizer.step()`` is acco's
  ``step()``, which reduce-scatters, updates and all-gathers in place (ZeRO-1).
- ``dpu``: one round of K micro-batches; ``step()`` lands the update handed over one step
  earlier and hands this one over.
- ``acco``: two rounds of K/2 micro-batches. The estimate round ends inside
  :meth:`AccoTrainer.training_step`, after the first half of the micro-batches; the commit
  round ends at the Trainer's ``optimizer.step()``.
- ``local``: one inner update of this replica (K micro-batches, no collective); every
  ``sync_every`` steps an outer round averages the replicas on the comm lane and lands
  ``sync_delay`` steps later, as in a hand-written loop (docs/api.md, ``mode="local"``).
  The LR schedule drives the inner learning rate; the logged ``loss`` is the Trainer's mean
  over ranks of each replica's loss on its own parameters (not the global values').
  Evaluations and checkpoints see the global values of the last landed round
  (``AccoOptimizer.eval()`` in this mode: no wait, no collective), and ``finish()`` at the
  end runs one more outer round so every replica ends at the same, global parameters.

So ``max_steps``, ``save_steps``, ``eval_steps``, ``logging_steps`` and the warm-up and
length of the LR schedule count committed updates, as with ``Trainer``. In ``acco`` and
``dpu`` mode the update of step j is still on the comm lane when step j ends (the model
holds the acco estimate, or dpu's previous parameters); evaluation and checkpoints at step
j call ``AccoOptimizer.eval()``, which waits for it and loads it, so they see exactly j
committed updates, and the next training step calls ``AccoOptimizer.train()`` to put the
live parameters back. Once the last step's evaluation and save are done, ``finish()`` lands
the last update for good (before ``load_best_model_at_end`` loads anything). Logs do not wait
for the update in flight: they report the learning rate of the step's update and the grad
norm of the last update that has landed.

What differs from ``Trainer`` under the hood, and why:

- no DDP: acco reduce-scatters the gradients itself (DDP would reduce them twice and block
  the overlap). The model is marked prepared for accelerate before the Trainer's
  ``accelerator.prepare(model, optimizer)``, which then leaves it unwrapped; a check at every
  training step raises if anything wrapped it anyway;
- each micro-batch's loss is the mean over its own label tokens and is handed to acco with
  ``accumulate(weight=tokens)``: the update divides by the tokens of all micro-batches of all
  ranks, as the Trainer's ``num_items_in_batch`` averaging does, without its per-step
  all-gather. The token counts of an update are read with one host synchronisation;
- ``args.max_grad_norm`` clips on acco's comm lane (the global norm of the averaged
  gradient, before each update); the Trainer's own clipping finds no gradient to clip, since
  ``accumulate()`` consumed them;
- the LR schedule of ``args`` advances once per committed update (:class:`CommitScheduler`);
- checkpoints hold the committed parameters in ``model.safetensors`` as usual and acco's
  sharded state in ``<checkpoint>/acco`` (every rank writes its shard, through
  :mod:`acco.checkpoint`), so ``train(resume_from_checkpoint=...)`` resumes exactly, and at
  another world size by resharding;
- acco's telemetry joins the training logs: ``acco_hidden_share`` (share of the comm lane's
  time hidden behind compute), ``acco_micro_batches_per_round`` (this rank) and
  ``acco_global_micro_batches_per_round``, ``acco_wait_s`` (time ``step()`` blocked since the
  last log) and ``grad_norm`` (the norm acco clipped, of the last committed update); in
  ``local`` mode ``acco_outer_rounds`` and ``acco_skipped_outer_rounds`` (landed so far),
  ``acco_outer_bytes`` (of those landed since the last log) and no ``grad_norm`` (each
  replica clips its own gradient).
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import math
import os
import statistics
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("acco.integrations.hf needs transformers and accelerate: pip install 'acco[hf]'") from error

from acco import checkpoint
from acco import AccoOptimizer, Mode, RoundKind, RoundStats
from acco.integrations.schedules import (CommitScheduler, check_micro_batches, require_lockstep, round_ends,
                                         rounds_per_update)
from acco.options import Options, parse_enum

__all__ = ["ACCO_CHECKPOINT_DIR", "AccoTrainer", "CommitScheduler"]

ACCO_CHECKPOINT_DIR = "acco"  # inside each Trainer checkpoint: acco's sharded optimizer state
_SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name, so tools that look for it find it
_ACCO_SIGNATURE = inspect.signature(AccoOptimizer.__init__).parameters
# mode="local"'s own arguments.
_LOCAL_KWARGS = ("sync_every", "sync_delay", "overlap", "outer_optimizer", "outer_bits", "outer_error_feedback", "pacing",
                 "outer_weighting", "outer_topk")
_ACCO_KWARGS = ("layout", "param_dtype", "reduce_dtype", "nonfinite", "timeout", "buffers", *_LOCAL_KWARGS)
# Scheduler types the Trainer steps with a metric after evaluation, not once per update.
_METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")
# Names whose optimizer needs the model or its own train()/eval() (LOMO, schedule-free):
# neither can run on a shard.
_UNSHARDABLE_OPTIMIZERS = ("lomo", "adalomo", "schedule_free")
_MAPPED_MODULES = ("torch.optim.", "transformers.optimization")


@dataclasses.dataclass(frozen=True)
class _MicroBatch:
    """What :meth:`AccoTrainer.training_step` does with one micro-batch of an update."""

    weight: float  # label tokens (or 1): the weight handed to accumulate()
    update_weight: float  # this rank's weight over the whole update (for the logged loss)
    ends_round: bool  # an acco estimate round ends after it, inside the update
    ends_update: bool  # the last of the update: the Trainer's optimizer.step() follows


class AccoTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with :class:`acco.AccoOptimizer`.

    Takes every argument of ``Trainer`` (same positions and names) plus the ``acco_*``
    keywords below. The base optimizer is the one ``args.optim`` names (mapped to its torch
    class: ``adamw_torch``, ``adamw_torch_fused``, ``sgd``, ``adagrad``, ``rmsprop``, ... or
    ``optimizer_cls_and_kwargs=(torch class, kwargs)``) with the Trainer's weight-decay
    groups; ``args.max_grad_norm`` becomes acco's ``max_grad_norm``, ``args.ddp_timeout`` its
    ``timeout``; ``args.bf16`` runs the forward pass under bf16 autocast as with ``Trainer``.
    See the module docstring for how steps map onto rounds.

    Args:
        acco_mode: ``"acco"`` (estimate + commit rounds of K/2 micro-batches each; K =
            ``gradient_accumulation_steps`` must be even), ``"dpu"``, ``"sync"`` or
            ``"local"`` (one inner update per step, an outer round every ``sync_every``).
        acco_accumulate_while_waiting: at each round boundary, while the round in flight has
            not landed, keep computing micro-batches instead of waiting (a fast rank never
            idles). The extra micro-batches come from a separate pass over this rank's share
            of the training set (reshuffled each pass), not from the Trainer's data order, so
            the scheduled ``max_steps * K`` micro-batches per rank are unchanged and every
            update covers those plus the extra ones: the samples trained on grow with the time
            the network takes (``acco_extra_micro_batches`` in the logs counts them), and a
            resume is no longer bit-exact. Not with ``acco_mode="local"``.
        acco_kwargs: further ``AccoOptimizer`` arguments: ``layout``, ``param_dtype``,
            ``reduce_dtype``, ``nonfinite``, ``timeout``, ``buffers``; with
            ``acco_mode="local"`` also ``sync_every``, ``sync_delay``, ``overlap``,
            ``outer_optimizer``, ``outer_bits``, ``outer_topk``, ``outer_error_feedback``. Checked as
            ``AccoOptimizer`` checks them, here.
        *args, **kwargs: those of ``transformers.Trainer``.

    Raises:
        ValueError: an ``acco_*`` argument is invalid, or ``args`` asks for something acco
            cannot honour: ``fp16`` (the Trainer's GradScaler unscales ``p.grad`` to clip;
            acco unscales on its comm lane: :mod:`acco.amp`), ``torch_compile``, ``deepspeed``, ``fsdp``,
            ``parallelism_config``, ``auto_find_batch_size``, a metric-driven
            ``lr_scheduler_type``, an odd ``gradient_accumulation_steps`` in ``acco`` mode, an
            ``optim`` that does not map to a torch (or transformers) optimizer class, more than
            one GPU per process, a model already wrapped in DDP, or ``optimizers=(...)`` (acco
            builds its own optimizer and schedule); ``local`` mode's ``acco_kwargs`` in another
            mode, ``param_dtype``/``reduce_dtype`` or ``acco_accumulate_while_waiting`` in
            ``local`` mode.
        TypeError: an ``acco_kwargs`` value of the wrong type (as ``AccoOptimizer``).

    Example::

        >>> args = TrainingArguments("out", max_steps=100, gradient_accumulation_steps=4,
        ...                          learning_rate=2e-5, lr_scheduler_type="cosine")
        >>> trainer = AccoTrainer(model=model, args=args, train_dataset=train,
        ...                       eval_dataset=held_out, acco_mode="acco")
        >>> trainer.train()                      # torchrun --nproc_per_node=N script.py
        >>> trainer.train(resume_from_checkpoint=True)  # exact; resharded at another world size
    """

    def __init__(
        self,
        *args: Any,
        acco_mode: Mode | str = Mode.ACCO,
        acco_accumulate_while_waiting: bool = False,
        acco_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Everything is checked before Trainer.__init__ moves the model or builds anything.
        bound = inspect.signature(Trainer.__init__).bind(None, *args, **kwargs).arguments
        self.acco_mode: Mode = parse_enum(Mode, acco_mode, "acco_mode")
        if not isinstance(acco_accumulate_while_waiting, bool):
            raise ValueError(f"Invalid acco_accumulate_while_waiting: {acco_accumulate_while_waiting!r} (a bool)")
        self.acco_accumulate_while_waiting = acco_accumulate_while_waiting
        self.acco_kwargs = dict(acco_kwargs or {})
        unknown = sorted(set(self.acco_kwargs) - set(_ACCO_KWARGS))
        if unknown:
            raise ValueError(
                f"Invalid acco_kwargs {unknown}: AccoTrainer passes {list(_ACCO_KWARGS)}; mode comes from acco_mode, "
                "max_grad_norm and the base optimizer from TrainingArguments"
            )
        local_only = sorted(set(self.acco_kwargs) & set(_LOCAL_KWARGS))
        if local_only and self.acco_mode is not Mode.LOCAL:
            raise ValueError(
                f"Invalid acco_kwargs {local_only} with acco_mode={self.acco_mode.value!r}: they set the outer rounds "
                "of acco_mode='local'; pass that mode or leave them out"
            )
        if acco_accumulate_while_waiting and self.acco_mode is Mode.LOCAL:
            raise ValueError(
                "Invalid acco_accumulate_while_waiting=True with acco_mode='local': an inner step is one update, it "
                "cannot take more micro-batches while a round is in flight; the default sync_every='auto' keeps the "
                "wait for rounds under 4% of the time, and acco_kwargs sync_delay='auto' lands each round "
                "once it has arrived"
            )
        if self.acco_mode is Mode.LOCAL:
            require_lockstep(self.acco_kwargs, (
                "Invalid acco_kwargs pacing={pacing!r}: the Trainer's logging, evaluation, saving and epoch starts "
                "are collectives at step counts, which replicas taking different numbers of inner steps would reach "
                "at different times; AccoTrainer runs its replicas in lockstep (pacing='lockstep', its default). "
                "Replicas of different speeds: a hand-written loop (docs/loops.md, \"Replicas of different speeds\")"))
        _check_acco_options(self.acco_mode, self.acco_kwargs)
        if bound.get("args") is not None:
            _check_training_args(bound["args"], self.acco_mode)
        optimizers = bound.get("optimizers", (None, None))
        if any(item is not None for item in optimizers):
            raise ValueError(
                "Invalid optimizers=(...): AccoTrainer builds its own AccoOptimizer and LR schedule; choose the base "
                "optimizer with TrainingArguments.optim or optimizer_cls_and_kwargs=(torch class, kwargs)"
            )
        model = bound.get("model")
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            raise ValueError(
                f"Invalid model: a {type(model).__name__}; pass the bare model: acco reduces gradients itself"
            )
        train_dataset = bound.get("train_dataset")
        if acco_accumulate_while_waiting and isinstance(train_dataset, IterableDataset):
            raise ValueError(
                "acco_accumulate_while_waiting=True needs a map-style train_dataset (with __len__): extra "
                "micro-batches are drawn from this rank's share of it, which an IterableDataset does not give"
            )

        super().__init__(*args, **kwargs)

        _check_training_args(self.args, self.acco_mode)  # also when args was left to its default
        if self.args.n_gpu > 1:
            raise ValueError(
                f"AccoTrainer runs one process per device, but this process sees {self.args.n_gpu} GPUs "
                "(the Trainer would use DataParallel): launch with torchrun --nproc_per_node"
            )
        self._base_optimizer_class, self._base_optimizer_kwargs = self._base_optimizer()
        self._acco: AccoOptimizer | None = None
        self._acco_finished = False
        self._queued: deque[_MicroBatch] = deque()
        self._extra_iterator: Iterator[Any] | None = None
        self._extra_micro_batches = 0
        self._train_dataloader: DataLoader | None = None
        self._last_logged_round = -1
        self._shifts_labels = _loss_shifts_labels(self.model)
        self.add_callback(_CommittedParameters(self))

    # ------------------------------------------------------------- optimizer and schedule

    @property
    def acco_optimizer(self) -> AccoOptimizer | None:
        """The AccoOptimizer (built when training starts; None before)."""
        return self._acco

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the :class:`AccoOptimizer` (the Trainer calls this before preparing the model).

        Marks the model as prepared for accelerate first: autocast and device placement
        apply, and the Trainer's ``accelerator.prepare(model, optimizer)`` then returns it
        unwrapped instead of in DDP. ``self.optimizer`` is the accelerate wrapper around the
        AccoOptimizer (which forwards ``step``, ``train`` and ``eval`` to it);
        :attr:`acco_optimizer` is the AccoOptimizer itself.

        .. warning:: Collective: the AccoOptimizer's construction broadcasts rank 0's
            parameters; every rank must call it.
        """
        if self._acco is not None and self._acco_finished:
            self.optimizer = None  # finished by a previous train(): it cannot run rounds again
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        prepared = self.accelerator.prepare_model(opt_model, evaluation_mode=True)
        if prepared is not opt_model:
            raise RuntimeError(
                f"accelerate wrapped the model in {type(prepared).__name__} while preparing it; AccoTrainer needs "
                "the bare model"
            )
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        options: dict[str, Any] = {
            "timeout": datetime.timedelta(seconds=self.args.ddp_timeout),
            **self.acco_kwargs,
            **self._base_optimizer_kwargs,
        }
        self._acco = AccoOptimizer(
            [g for g in groups if g["params"]],
            self._base_optimizer_class,
            mode=self.acco_mode,
            max_grad_norm=self.args.max_grad_norm if self.args.max_grad_norm > 0 else None,
            module=self.model,  # its persistent buffers stay identical across ranks
            **options,
        )
        self._acco_finished = False
        self._last_logged_round = -1
        # device_placement=False: the shards already live on the device, and accelerate's
        # placement round trip (state_dict, load_state_dict) would copy the whole state.
        self.optimizer = self.accelerator.prepare_optimizer(self._acco, device_placement=False)
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> CommitScheduler:
        """The LR schedule of ``args`` over ``num_training_steps`` committed updates,
        stepped once per committed update (:class:`CommitScheduler`)."""
        if self.lr_scheduler is None:
            acco = self._require_acco()
            schedule = super().create_scheduler(num_training_steps, optimizer=acco)
            self.lr_scheduler = CommitScheduler(schedule, acco)
        return self.lr_scheduler

    def _base_optimizer(self) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
        """The base optimizer class and its keyword arguments, from ``optimizer_cls_and_kwargs``
        or ``args.optim``; ValueError if acco cannot shard it."""
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            what = f"optimizer_cls_and_kwargs class {cls!r}"
            kwargs = {"lr": self.args.learning_rate, **kwargs}
        else:
            name = str(getattr(self.args.optim, "value", self.args.optim))
            what = f"optim={name!r}"
            if name.startswith(_UNSHARDABLE_OPTIMIZERS):
                raise ValueError(f"Invalid {what}: this optimizer cannot run on a shard of the parameters")
            try:
                cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
            except (ImportError, ValueError) as error:
                raise ValueError(f"Invalid {what}: it does not map to a torch optimizer class here ({error})") from error
            # Names that map to third-party classes (bitsandbytes, torchao, ...) keep state
            # that is not known to survive sharding; such a class can still be passed with
            # optimizer_cls_and_kwargs, at the caller's judgement.
            if isinstance(cls, type) and not cls.__module__.startswith(_MAPPED_MODULES):
                raise ValueError(
                    f"Invalid {what}: it maps to {cls.__module__}.{cls.__qualname__}; AccoTrainer maps optim names to "
                    "torch.optim classes (adamw_torch, adamw_torch_fused, sgd, adagrad, rmsprop) and transformers' "
                    "Adafactor; pass another class with optimizer_cls_and_kwargs"
                )
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"Invalid {what}: AccoTrainer needs a torch.optim.Optimizer subclass, not a factory")
        injected = sorted({"params", "model", "optimizer_dict"} & set(kwargs))
        if injected:
            raise ValueError(f"Invalid {what}: it brings its own {injected}, which acco cannot shard")
        return cls, dict(kwargs)

    def _require_acco(self) -> AccoOptimizer:
        if self._acco is None:
            raise RuntimeError("AccoTrainer: the AccoOptimizer is built when training starts (create_optimizer)")
        return self._acco

    # ------------------------------------------------------------------------ training

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``; on an exception the comm lane is closed (not collective), so a
        failing rank never blocks on the others."""
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        except BaseException:
            if self._acco is not None:
                self._acco.close()
                self._acco_finished = True
            raise

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], None]:
        """The next update's micro-batches, and no ``num_items_in_batch``.

        Each micro-batch's loss is a mean over its own tokens and the token counts go to
        ``accumulate(weight=...)``, so no count is all-gathered here; the counts of the
        whole update are read in one host synchronisation.
        """
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        weights = self._micro_batch_weights(batches)
        total = math.fsum(weights)
        ends = round_ends(rounds_per_update(self.acco_mode), len(batches))  # acco: the estimate round's end
        self._queued = deque(
            _MicroBatch(weight=w, update_weight=total, ends_round=i + 1 in ends, ends_update=i + 1 == len(batches))
            for i, w in enumerate(weights)
        )
        return batches, None

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Tensor | Any],
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor:
        """Forward, backward and ``accumulate(weight=tokens)`` for one micro-batch; in
        ``acco`` mode the estimate round ends after the first half of an update's
        micro-batches. Returns the loss share to log (this micro-batch's part of the
        update's token-mean loss on this rank).

        ``num_items_in_batch`` is ignored: the normalisation is acco's weighting.

        Raises:
            RuntimeError: the model was wrapped (DDP, DataParallel, compile) after all.
        """
        if model is not self.model or isinstance(model, (DistributedDataParallel, DataParallel)):
            raise RuntimeError(
                f"AccoTrainer got a {type(model).__name__} wrapping the model: acco reduces gradients itself and "
                "the model must stay unwrapped (no DDP, DataParallel or torch.compile)"
            )
        acco = self._require_acco()
        acco.train()  # the live parameters back, if an evaluation or a save loaded the committed ones
        model.train()
        if self._queued:
            queued = self._queued.popleft()
        else:  # called outside the Trainer's loop: one micro-batch, no round boundary
            weight = self._micro_batch_weights([inputs])[0]
            queued = _MicroBatch(weight=weight, update_weight=weight, ends_round=False, ends_update=False)
        loss = self._forward_backward(model, inputs, queued.weight)
        if queued.ends_round or queued.ends_update:
            if self.acco_accumulate_while_waiting:
                self._accumulate_while_waiting(model)
            if queued.ends_round and acco.step():
                self.lr_scheduler.step()  # once per committed update, before the next handover
        if not queued.weight > 0:  # nothing to learn in it (and its mean is NaN)
            return torch.zeros_like(loss)
        return loss * (queued.weight / queued.update_weight)

    def _forward_backward(self, model: nn.Module, inputs: dict[str, Any], weight: float) -> Tensor:
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)  # mean over this micro-batch's own tokens
        if weight > 0:  # no label token: its mean is NaN, and it carries no weight anyway
            self.accelerator.backward(loss)
            self._require_acco().accumulate(weight)
        return loss.detach()

    def _accumulate_while_waiting(self, model: nn.Module) -> None:
        acco = self._require_acco()
        while not acco.ready():
            inputs = next(self._extra_batches())
            self._forward_backward(model, inputs, self._micro_batch_weights([inputs])[0])
            self._extra_micro_batches += 1

    def _extra_batches(self) -> Iterator[Any]:
        if self._extra_iterator is None:
            if self._train_dataloader is None:
                raise RuntimeError("AccoTrainer: no training dataloader yet (train() has not started)")
            self._extra_iterator = _extra_micro_batches(self._train_dataloader, self.args)
        return self._extra_iterator

    def _micro_batch_weights(self, batches: Sequence[Any]) -> list[float]:
        counts_tokens = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        return _token_weights(batches, counts_tokens, self._shifts_labels)

    def _finish(self, keep_model: bool = False) -> None:
        """Land the last update and close the comm lane (collective).

        Args:
            keep_model: keep the parameters the model holds now (the best checkpoint the
                Trainer loaded) instead of the last committed ones.
        """
        acco = self._acco
        if acco is None or self._acco_finished:
            return
        kept = [p.detach().clone() for p in self.model.parameters()] if keep_model else None
        if acco.finish():
            self.lr_scheduler.step()
        acco.train()  # drops a copy eval() may still hold; the model keeps finish()'s parameters
        self._acco_finished = True
        if kept is not None:
            with torch.no_grad():
                for param, value in zip(self.model.parameters(), kept):
                    param.copy_(value)

    # ------------------------------------------------------------------ logs and checkpoints

    def log(self, logs: dict[str, float], start_time: float | None = None, **kwargs: Any) -> None:
        """``Trainer.log`` with acco's telemetry added to training logs: the rounds landed
        since the previous log (this rank's view) and the last committed update's grad norm."""
        if self._acco is not None and "loss" in logs:
            logs.update(self._telemetry(logs))
        super().log(logs, start_time, **kwargs)

    def _telemetry(self, logs: dict[str, float]) -> dict[str, float]:
        acco = self._require_acco()
        rounds: list[RoundStats] = [s for s in acco.round_stats if s.index > self._last_logged_round]
        if rounds:
            self._last_logged_round = rounds[-1].index
        # A round replayed from a checkpoint only all-gathers again: it computed nothing here.
        rounds = [s for s in rounds if not s.replayed]
        gradient_rounds = [s for s in rounds if s.kind is not RoundKind.OUTER]  # an outer round carries parameters
        out: dict[str, float] = {}
        if rounds:
            out["acco_hidden_share"] = statistics.fmean(s.hidden_share for s in rounds)
            out["acco_wait_s"] = math.fsum(s.wait_seconds for s in rounds)
        if gradient_rounds:
            out["acco_micro_batches_per_round"] = statistics.fmean(s.local_micro_batches for s in gradient_rounds)
            out["acco_global_micro_batches_per_round"] = statistics.fmean(
                s.global_micro_batches for s in gradient_rounds
            )
        if self.acco_mode is Mode.LOCAL:  # the outer rounds so far, and the bytes of those landed since the last log
            out["acco_outer_rounds"] = float(acco.outer_rounds)
            out["acco_skipped_outer_rounds"] = float(acco.skipped_outer_rounds)
            out["acco_outer_bytes"] = float(sum(s.collective_bytes for s in rounds if s.kind is RoundKind.OUTER))
            reports = [s.replicas for s in rounds if s.replicas is not None]
            if reports:  # this replica's inner steps and tokens per round, and its wait for the rounds
                own = acco.replica
                out["acco_inner_steps_per_round"] = statistics.fmean(r.steps[own] for r in reports)
                out["acco_tokens_per_round"] = statistics.fmean(r.weights[own] for r in reports)
        if self.acco_accumulate_while_waiting:
            out["acco_extra_micro_batches"] = float(self._extra_micro_batches)
        # The Trainer's own grad_norm is of p.grad, which accumulate() consumed: report acco's.
        logs.pop("grad_norm", None)
        norms = [s.grad_norm for s in acco.round_stats if s.kind is RoundKind.COMMIT and not math.isnan(s.grad_norm)]
        if norms:
            out["grad_norm"] = norms[-1]
        return out

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """acco's sharded state under ``output_dir/acco`` (every rank writes its shard) and
        the schedule (rank 0). The model files beside it hold the committed parameters;
        acco's folder also holds the live ones when they differ (an acco estimate, dpu's
        previous parameters), which the next round computes at."""
        acco = self._acco
        if acco is None or self._acco_finished:
            # Saved after finish(): the model files hold the final parameters; the optimizer
            # state is gone, so this checkpoint exports the model but does not resume it.
            return
        acco.train()  # the live parameters, for an exact resume
        live_model = self.model if acco.mode is not Mode.SYNC else None
        checkpoint.save(Path(output_dir) / ACCO_CHECKPOINT_DIR, acco, live_model)
        acco.eval()  # back to the committed parameters for whatever follows the save
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """Load what :meth:`_save_optimizer_and_scheduler` wrote, at this world size (acco
        reshards when it differs).

        Raises:
            ValueError: the checkpoint holds no acco state (a plain Trainer's, or saved with
                ``save_only_model``), or acco's state does not fit this optimizer.
        """
        if checkpoint_dir is None:
            return
        acco = self._require_acco()
        directory = Path(checkpoint_dir) / ACCO_CHECKPOINT_DIR
        if not (directory / ".metadata").is_file():
            raise ValueError(
                f"{checkpoint_dir} holds no acco optimizer state ({ACCO_CHECKPOINT_DIR}/): it was not written by "
                "AccoTrainer during training (or with save_only_model=True), so it cannot be resumed exactly"
            )
        checkpoint.load(directory, acco, self.model if acco.mode is not Mode.SYNC else None)
        state = torch.load(os.path.join(checkpoint_dir, _SCHEDULER_FILE), map_location="cpu", weights_only=True)
        self.lr_scheduler.load_state_dict(state)


class _CommittedParameters(TrainerCallback):
    """Evaluations and saves see the committed parameters; the last update lands before
    training ends.

    At the end of step j in ``acco``/``dpu`` mode the update of step j is on the comm lane.
    Before an evaluation or save, ``AccoOptimizer.eval()`` lands it in the model (the next
    training step's ``train()`` puts the live parameters back). Once the last step's
    evaluation and save are done (at the end of the last epoch, or after them), ``finish()``
    lands it for good, before the Trainer may load its best checkpoint.
    """

    def __init__(self, trainer: AccoTrainer) -> None:
        self.trainer = trainer
        self.training_over = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.training_over = False
        self.trainer._train_dataloader = kwargs.get("train_dataloader")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        acco = self.trainer.acco_optimizer
        if acco is not None and acco.should_stop:  # request_stop() / stop_after() on some replica (local mode)
            control.should_training_stop = True
        self._committed_view(control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._committed_view(control)
        if state.global_step >= state.max_steps or control.should_training_stop:
            self.training_over = True
            self._finish_when_done(args, control)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if args.save_strategy != "best":  # with "best", whether a save follows is decided after this
            self._finish_when_done(args, control)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._finish_when_done(args, control)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # Reached unfinished only if no event above could finish (e.g. a "best" save that did
        # not happen); the Trainer may have loaded its best checkpoint by now: keep it.
        self.trainer._finish(keep_model=bool(args.load_best_model_at_end and state.best_model_checkpoint))

    def _committed_view(self, control: TrainerControl) -> None:
        acco = self.trainer.acco_optimizer
        if acco is not None and not self.trainer._acco_finished and (control.should_evaluate or control.should_save):
            acco.eval()

    def _finish_when_done(self, args: TrainingArguments, control: TrainerControl) -> None:
        if self.training_over and not control.should_evaluate and not control.should_save:
            self.trainer._finish()


def _extra_micro_batches(loader: DataLoader, args: TrainingArguments) -> Iterator[Any]:
    """Endless micro-batches from this rank's share of the training set, reshuffled each pass.

    A plain DataLoader over the dataset and collator the Trainer prepared: accelerate's own
    loader synchronises RNG state across ranks when an iteration starts, a collective that
    ranks drawing different numbers of extra micro-batches would never all reach.
    """
    sampler = DistributedSampler(
        loader.dataset,
        num_replicas=args.world_size,
        rank=args.process_index,
        shuffle=True,
        seed=args.seed + 1,  # not the Trainer's own order
        drop_last=True,
    )
    extra = DataLoader(
        loader.dataset,
        batch_size=args.per_device_train_batch_size,
        sampler=sampler,
        collate_fn=loader.collate_fn,
        drop_last=True,
    )
    for epoch in range(2**62):
        sampler.set_epoch(epoch)
        drawn = 0
        for batch in extra:
            drawn += 1
            yield batch
        if not drawn:
            raise RuntimeError("acco_accumulate_while_waiting: this rank's share of the training set is empty")


def _token_weights(batches: Sequence[Any], counts_tokens: bool, shifts_labels: bool) -> list[float]:
    """Label tokens per micro-batch where the Trainer would count them for
    ``num_items_in_batch`` (``counts_tokens``); 1 per micro-batch otherwise (a mean of
    micro-batch means). Read in one host synchronisation."""
    if not (counts_tokens and len(batches) > 0 and isinstance(batches[0], Mapping) and "labels" in batches[0]):
        return [1.0] * len(batches)
    try:
        labels = [
            b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:] if shifts_labels else b["labels"]
            for b in batches
        ]
        return [float(n) for n in torch.stack([t.ne(-100).sum() for t in labels]).tolist()]
    except (TypeError, AttributeError, RuntimeError):  # labels that are not tensors
        return [1.0] * len(batches)


def _check_acco_options(mode: Mode, acco_kwargs: Mapping[str, Any]) -> None:
    """AccoOptimizer's own checks of ``acco_kwargs`` (``ValueError`` / ``TypeError`` naming
    the bad value), run when the trainer is made: the optimizer itself is built only when
    training starts, after the model has moved and the process group exists."""
    checked = inspect.signature(Options.check).parameters
    given = {name: p.default for name, p in _ACCO_SIGNATURE.items() if p.kind is p.KEYWORD_ONLY}
    Options.check(**{name: v for name, v in {**given, **acco_kwargs, "mode": mode}.items() if name in checked})


def _check_training_args(args: TrainingArguments, mode: Mode) -> None:
    """ValueError for each TrainingArguments setting acco cannot honour."""
    rejected = [
        ("fp16", bool(args.fp16), "the Trainer unscales p.grad through its GradScaler to clip, and acco unscales on "
         "its comm lane (a hand-written loop may use a GradScaler in sync or dpu mode); use bf16"),
        ("torch_compile", bool(args.torch_compile), "the compiled wrapper would be wrapped in DDP by accelerate"),
        ("deepspeed", bool(args.deepspeed), "DeepSpeed brings its own sharded optimizer"),
        ("fsdp", bool(args.fsdp), "FSDP shards parameters and reduces gradients itself"),
        ("parallelism_config", args.parallelism_config is not None, "acco is data parallel only"),
        ("auto_find_batch_size", bool(args.auto_find_batch_size), "a retry would rebuild the optimizer mid-run"),
    ]
    for name, active, why in rejected:
        if active:
            raise ValueError(f"Invalid TrainingArguments {name}={getattr(args, name)!r} for AccoTrainer: {why}")
    scheduler = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if scheduler in _METRIC_SCHEDULERS:
        raise ValueError(
            f"Invalid TrainingArguments lr_scheduler_type={scheduler!r} for AccoTrainer: it steps on evaluation "
            "metrics, not once per committed update"
        )
    check_micro_batches(mode, args.gradient_accumulation_steps, "TrainingArguments gradient_accumulation_steps",
                        "halving per_device_train_batch_size, or acco_mode='dpu'")


def _loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss predicts ``labels[..., 1:]`` (causal LM): the first label of
    each row is then never a target, and token counts leave it out (the Trainer's rule)."""
    base = getattr(model, "get_base_model", lambda: model)()  # a PEFT model's underlying model
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    return LOSS_MAPPING.get(getattr(base, "loss_type", None)) is ForCausalLMLoss
