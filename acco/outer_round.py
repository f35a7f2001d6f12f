"""mode="local"'s outer round on the comm lane, once, whoever takes part.

:class:`OuterRunner` is the round's body (docs/design.md, "Local steps"): the participants are
seated, their hand-overs exchanged, each param group's pseudo-gradients reduced to the owners
of its chunks (the reduce leg), the owners' outer step, the new global values gathered (the
gather leg), the round agreed and landed. Who takes part, which collectives carry the legs, how
a round is agreed and what a landing keeps come from the membership, in the hooks a subclass
gives:

- :class:`FixedRunner`: the fixed process group (or mesh): the same replicas every round, the
  outer state in each rank's master shard, a failure ends the job;
- :class:`acco.elastic.ElasticRunner`: torchft's quorum of the replica groups alive, the outer
  state in each participant's chunk of that round (rebuilt when they change), a failed round
  dropped everywhere.

The legs themselves (32 bits, or quantised below) are :mod:`acco.legs`'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from acco.legs import PlainLegs, QuantizedLegs
from acco.options import NonFinite
from acco.replicas import HandOver, ReplicaReport
from acco.rounds import LaneRound
from acco.runner import LaneWork, step_shard
from acco.sharding import ShardedGroup
from acco.telemetry import RoundStats

__all__ = ["FixedRunner", "OuterRound", "OuterRunner", "OuterShard", "RoundRefused", "Seating"]


class RoundRefused(ValueError):
    """What every participant of an outer round finds alike and no later round would change
    (replica groups laid out differently): the round fails with it on every participant,
    rather than being dropped and tried again."""


@dataclass(kw_only=True)
class OuterRound(LaneRound):
    """An outer round: this replica's parameters in, the new global values out.

    Attributes:
        params: per param group, this replica's parameters, flat in the round's buffer (the
            reduce-scatter input; the all-gather writes the new global values there).
        hand_over: what this replica tells the others with them.
        report: every replica's hand-over, once the comm lane has exchanged them.
    """

    params: list[Tensor]
    hand_over: HandOver | None = None
    report: ReplicaReport | None = None


@dataclass
class OuterShard:
    """One param group's part in an outer round, as this rank holds it.

    Attributes:
        place: how the group's flat buffer is chunked among the participants and which chunk
            is this rank's (``plan`` and ``rank``, as :mod:`acco.legs` reads them).
        params: this replica's hand-over, in ``place``'s layout.
        master: this rank's chunk of the global values at full precision (what the outer
            optimizer steps; the gather leg sends its change).
        grad: where the reduce leg writes the chunk's mean pseudo-gradient.
        step: the outer optimizer's step on ``master`` from ``grad``.
        unchanged: what a round that merges nothing does before its gather leg.
        copies: the copy of the global values every rank holds (the quantised legs' base).
        out: where the gather leg writes the new global values.
    """

    place: Any
    params: Tensor
    master: Tensor
    grad: Tensor
    step: Callable[[], None]
    unchanged: Callable[[], None]
    copies: Tensor | None
    out: Tensor


@dataclass
class Seating:
    """Who takes part in one outer round, as this rank sees it.

    Attributes:
        replica / replicas: this replica's index among the participants, and their number.
        comm: the collectives that carry the legs (this rank and its equals in the others).
        legs: the two legs (:mod:`acco.legs`).
        shards: per param group, this rank's :class:`OuterShard`.
        gathers_unchanged: a round that merges nothing still runs its gather leg (the fixed
            groups: the master shards re-sent, as a replayed round sends them); False: the
            global values stay exactly as they are.
        context: what the membership keeps of the round until it lands (the quorum).
    """

    replica: int
    replicas: int
    comm: Any
    legs: PlainLegs | QuantizedLegs | None  # (an elastic round lays them after its exchange)
    shards: list[OuterShard]
    gathers_unchanged: bool = True
    context: Any = None


class OuterRunner(LaneWork):
    """The outer round on the comm lane: :meth:`run` is the body, whoever takes part; a
    subclass gives the hooks (:meth:`_seat`, :meth:`_exchange`, :meth:`_legs_failed`,
    :meth:`_agree`, :meth:`_land`, :meth:`_after_gather`) and what a loop reads of its
    membership (``replica``, ``replicas``, ``place``, ``ends_job``, ``outer_optimizers``, its
    state and buffers)."""

    ends_job = True  # finish()'s rounds end the job on every replica (elastic ones may not)
    # A round may land after its replica went on taking inner steps (acco.local, "late"); an
    # elastic round, which may be dropped and carried, blocks.
    lands_late = True

    def run(self, round_: OuterRound) -> RoundStats:
        """One outer round.

        Raises:
            CommLaneError: naming the round and the phase it failed in (NaN or inf in some
                replica's parameters with ``nonfinite="raise"``; a fixed group's failure; an
                elastic group's own repeated failure, or a quorum that never forms).
        """
        stats, record = round_.stats, self._recorder
        record.lane_start(stats)
        try:
            seating = self._seat(round_)
        except Exception as error:
            raise self._failed(round_, error) from error
        stats.update_weight = float(seating.replicas)
        succeeded, refused = True, None
        try:
            nonfinite, round_.report = self._exchange(seating, round_)
            stats.replicas, stats.global_weight = round_.report, sum(round_.report.weights)
            factors = round_.report.factors(self._options.local.outer_weighting)
            if nonfinite and self._options.nonfinite is NonFinite.RAISE:
                raise FloatingPointError(f"non-finite parameters on {nonfinite} replica(s)")
            stats.skipped = bool(nonfinite)
            # Nothing to merge: NaN/inf skipped, or no replica trained since its hand-over.
            merges = not nonfinite and not (factors is not None and not any(factors))
            sent = received = 0
            for number, shard in enumerate(seating.shards):
                if merges:
                    with record.phase(stats, "reduce-scatter"):
                        sent += seating.legs.reduce(seating.comm, shard.place, number, shard.params, factors, shard.grad)
                    with record.phase(stats, "update"):
                        shard.step()
                elif not seating.gathers_unchanged:
                    continue
                else:
                    shard.unchanged()
                with record.phase(stats, "all-gather"):
                    received += seating.legs.gather(seating.comm, shard.place, number, shard.master, shard.copies,
                                                    shard.out)  # fmt: skip
            stats.collective_bytes = sent + received + self._after_gather(seating, round_)
        except (FloatingPointError, RoundRefused) as error:
            # The same on every participant (NaN or inf with nonfinite="raise"): the round fails
            # everywhere, after the agreement (no participant leaves while another still exchanges).
            succeeded, refused = False, error
        except Exception as error:
            self._legs_failed(round_, error)
            succeeded = False
        try:
            committed = self._agree(seating, succeeded)
        except Exception as error:
            raise self._failed(round_, refused or error) from (refused or error)
        if refused is not None:
            raise self._failed(round_, refused) from refused
        self._land(seating, round_, committed)
        record.lane_end(stats)
        return stats

    # The membership's hooks.

    def _seat(self, round_: OuterRound) -> Seating:
        """This round's participants, its legs and this rank's shards (may block: a quorum)."""
        raise NotImplementedError

    def _exchange(self, seating: Seating, round_: OuterRound) -> tuple[int, ReplicaReport]:
        """How many participants hand over NaN or inf, and every participant's hand-over (the
        same on every rank)."""
        raise NotImplementedError

    def _legs_failed(self, round_: OuterRound, error: Exception) -> None:
        """A round's exchange or legs failed here: raise to end the round (and the job) with
        it; return: the round is dropped (:meth:`_agree` then hears ``succeeded=False``)."""
        raise self._failed(round_, error) from error

    def _agree(self, seating: Seating, succeeded: bool) -> bool:
        """Whether the round lands (the same on every participant)."""
        return succeeded

    def _land(self, seating: Seating, round_: OuterRound, committed: bool) -> None:
        """What the membership keeps of a round that landed (``committed``) or was dropped."""

    def _after_gather(self, seating: Seating, round_: OuterRound) -> int:
        """What a round does after its gather legs (bytes received)."""
        return 0


def _check_same_round(rounds: Sequence[int]) -> None:
    """Every rank launched the same outer round (``rounds``: each rank's index, in rank order).

    A fixed group's replicas launch every round together, so they differ only when their states
    come from different rounds: a resume from checkpoints saved in different rounds, or a rank
    that loaded none. Their next collectives would no longer match (a hang, or one round's
    values mixed with another's): the round fails on every rank instead.

    Raises:
        RoundRefused: naming each rank's round.
    """
    if len(set(rounds)) > 1:
        raise RoundRefused(
            f"the ranks are at different outer rounds ({', '.join(f'rank {r}: round {i}' for r, i in enumerate(rounds))}): "
            "their states come from different rounds (a resume from per-rank checkpoints saved in different outer "
            "rounds, or a rank that loaded none); resume every rank from states saved at the same inner step"
        )


class FixedRunner(OuterRunner):
    """The outer round among the replicas of a fixed process group (or a mesh's ``replicate``
    dimension): the replicas' parameters reduced to each chunk's owner, the mean
    pseudo-gradient subtracted from the owner's snapshot shard by the outer optimizer, the new
    global values gathered. No clipping (the inner steps clip their own).

    Args:
        groups: each param group's buffers.
        outer_optimizers: each group's outer optimizer on the snapshot's shard (or None).
        snapshot: each group's snapshot shard (its master shard).
        legs: the two legs below 32 bits (``outer_bits``), or None: parameters reduce-scattered
            and global values all-gathered at full precision.
        *args, **kwargs: the rest of :class:`~acco.runner.LaneWork`'s.
        common_terms: with ``overlap="estimate"``, each group's copy of the outer step's common
            part (whole, on every rank), which every round's gather leg brings up to date after
            the global values (as they are, quantised against the copy below 32 bits); None:
            no estimate.
    """

    def __init__(
        self,
        groups: Sequence[ShardedGroup],
        outer_optimizers: Sequence[torch.optim.Optimizer | None],
        snapshot: Sequence[Tensor],
        legs: QuantizedLegs | None,
        *args: Any,
        common_terms: Sequence[Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(groups, *args, **kwargs)
        self._outer = list(outer_optimizers)
        self._snapshot = list(snapshot)
        self._quantized = legs
        self._legs = legs if legs is not None else PlainLegs(self._snapshot)
        self._common_terms = common_terms
        # Each replica group's ranks hand over the same parameters' pieces once: a replica
        # counts once in the mean.
        self.replicas = self._mesh_comm.world_size // self._replica_size
        # Who holds this rank's residual: its rank and the number of ranks of the whole mesh.
        self.place = [self._mesh_comm.rank, self._mesh_comm.world_size]
        self._seating = Seating(self.replica, self.replicas, self._comm, self._legs,
                                [self._shard(number, group) for number, group in enumerate(self._groups)])  # fmt: skip

    @property
    def outer_optimizers(self) -> list[torch.optim.Optimizer | None]:
        """Each param group's outer optimizer on this rank's snapshot shard (None: owns nothing)."""
        return list(self._outer)

    def state_dict(self) -> None:
        """Nothing beyond the loop's own state (the snapshot shards are the groups' masters)."""
        return None

    def buffer_bytes(self, number: int) -> dict[str, int]:
        """Nothing beyond the loop's and the groups' buffers."""
        return {}

    @property
    def replica(self) -> int:
        """This rank's replica: its rank among the replicas (in the outer round's group)."""
        return self._comm.rank

    def _shard(self, number: int, group: ShardedGroup) -> OuterShard:
        """Param group ``number``'s part: its snapshot shard, stepped in place (the hand-over
        is the round's ``params``, filled in at each round)."""
        outer, snapshot = self._outer[number], self._snapshot[number]

        def step() -> None:
            if outer is not None:  # the snapshot is the group's master shard
                step_shard(group, outer, {}, estimate=False)
            else:
                group.gather_input.copy_(snapshot)

        def unchanged() -> None:  # the plain gather sends gather_input: the master shard as it is
            if self._quantized is None:
                group.gather_input.copy_(group.prepare_master())

        copies = None if self._quantized is None else self._quantized.copies(number)
        return OuterShard(group, group.master, snapshot, group.master_grad, step, unchanged, copies, group.gathered)

    def _seat(self, round_: OuterRound) -> Seating:
        for shard, params in zip(self._seating.shards, round_.params):
            shard.params = params
        return self._seating

    # The exchange's entries per rank of the mesh: its replica, the round, its hand-over's fields.
    _FIELDS = 8

    def _exchange(self, seating: Seating, round_: OuterRound) -> tuple[int, ReplicaReport]:
        """One all-reduce over the mesh: how many ranks hand over NaN or inf, each rank's round,
        and every replica's hand-over. Each rank writes its own entries (the others are 0, so
        the sum is exact); a replica group's ranks report alike, but for its seconds per step,
        its slowest rank's.

        Raises:
            RoundRefused: the ranks are at different rounds (on every rank alike: each sees
                every rank's).
        """
        with self._recorder.phase(round_.stats, "totals"):
            own, ranks = round_.hand_over, self._mesh_comm.world_size
            params = round_.params
            flags = torch.zeros(1 + self._FIELDS * ranks, dtype=torch.float64, device=params[0].device)
            start = 1 + self._FIELDS * self._mesh_comm.rank
            flags[start : start + self._FIELDS] = torch.tensor(
                [self.replica, round_.stats.index, own.steps, own.weight, own.step_seconds, own.stop, own.finishing,
                 own.round_seconds], dtype=torch.float64)  # fmt: skip
            flags[0] = self._nonfinite_flag(params)
            self._mesh_comm.all_reduce_sum_(flags)
            values = self._device_hooks.host_copy(flags)(self._options.timeout.total_seconds()).tolist()
            entries: dict[int, list[list[float]]] = {}
            rounds = []
            for rank in range(ranks):
                entry = values[1 + self._FIELDS * rank : 1 + self._FIELDS * (rank + 1)]
                rounds.append(int(entry[1]))
                entries.setdefault(int(entry[0]), []).append(entry[2:])
            _check_same_round(rounds)
            report = ReplicaReport.of([HandOver.of_ranks(entries[replica]) for replica in range(self.replicas)])
            nonfinite = self._confirm_nonfinite(params) if values[0] else 0
        return nonfinite, report

    def _after_gather(self, seating: Seating, round_: OuterRound) -> int:
        """The estimate's common terms, then the module buffers."""
        received = self._gather_common_terms(round_.stats)
        self._synchronise_buffers(round_)
        return received

    def _gather_common_terms(self, stats: RoundStats) -> int:
        """``overlap="estimate"``: each owner's common part of the outer step (from its master
        shard and momentum, as they are now) into every rank's copy; the bytes received (0
        without the estimate). A replayed round skips it: a checkpoint holds the copies as this
        leg left them."""
        if self._common_terms is None:
            return 0
        estimate, received = self._options.local.estimate, 0
        with self._recorder.phase(stats, "all-gather"):
            for number, (group, outer, copy) in enumerate(zip(self._groups, self._outer, self._common_terms)):
                master = group.master
                common = torch.empty(master.shape, dtype=torch.float32, device=master.device)
                momenta = [None if outer is None else outer.state.get(view, {}).get("momentum_buffer")
                           for view in group.master_views]  # fmt: skip
                estimate.common(common, master.float(), momenta, group.shard_views(common))
                if self._quantized is not None:
                    received += self._quantized.gather(self._comm, group, number, common, copy, copy)
                else:
                    self._comm.all_gather(copy, common.to(copy.dtype))
                    received += copy.nbytes
        return received

    def replay(self, round_: LaneRound) -> RoundStats:
        """A round re-created from a checkpoint: the gather leg again (below 32 bits from the
        restored master shards and copy, so it sends what the saved run sent)."""
        if self._quantized is None:
            return super().replay(round_)
        self._recorder.lane_start(round_.stats)
        with self._recorder.phase(round_.stats, "all-gather"):
            for number, shard in enumerate(self._seating.shards):
                self._quantized.gather(self._comm, shard.place, number, shard.master, shard.copies, shard.out)
        self._recorder.lane_end(round_.stats)
        return round_.stats
