"""Elastic replicas: outer rounds among the replica groups present, on torchft.

Who takes part in each outer round under failures is one concern with one owner (docs/design.md,
"Elastic replicas"): :class:`TorchFT` asks torchft's ``Manager`` (its lighthouse forms a quorum
of the replica groups alive at each round) and holds the agreement that lands a round;
:class:`ElasticRunner` is the outer round's body on the comm lane over the replicas present,
which :class:`acco.local.LocalLoop` runs instead of :class:`acco.local.OuterRunner` when
``membership`` is given (``membership.runner(...)``: this module imports nothing of the loop's). Each replica group is its own job (its own ``torchrun``); nothing
here is needed unless torchft is installed (``pip install acco[ft]``).

The outer state stays sharded: the participants of a round split the flat parameters into R
chunks (R: the round's participants), each owning one chunk's full-precision master values and
outer-optimizer state. When the participants change (a replica lost or back), each replica
keeps what it owned of the elements it still owns and rebuilds the rest from the global values
every replica holds, its optimizer state zero; a replica that healed, or a round that was
dropped, rebuilds its whole chunk so. docs/elastic.md measures what that costs.

A round lands only if every participant's legs succeeded: one all-reduce of a failure count
before torchft's own commit vote (which counts only a replica group's own ranks). A dropped
round changes nothing on any replica but its residual (reset: what quantising the dropped
round would have carried, less than one quantisation step per value), and each replica keeps
its own inner steps, which the next round carries.

Every group knows which rounds its global values come from: the *lineage*, how many rounds
have landed on them and a digest chained over each one's identity (torchft's step and the
quorum's id, which no other round shares), kept in checkpoints.

No group holds a round past the *grace window*: the lighthouse issues a quorum once a minimum
quorum has asked (and its join timeout has passed), and while a group of the participants'
last few rounds is missing the participants ask again until the window (adaptive: a few times
the measured spread of hand-over times; or fixed) has passed. A group left out (alive but late: a
stall, a paused process, a loaded machine) keeps training, and at its next round its global
values are behind: torchft heals it by step count, or, where its step count equals the others'
(a round torchft committed that it dropped), the round's first exchange shows its lineage
behind and the participants of the newest lineage send it their global values (a *heal by
content*). Either way a group whose state is its own (it has landed a round in this process)
takes only the global values, its own progress carried onto them: its pseudo-gradient is what
it trained since the values it started from, and its inner steps since its last landed round
all count in this round. Only a restarted process takes a peer's whole state, and a group that
dropped a round since its last landed one takes the newest global values as they are (another
participant may have landed that round: its progress would count twice). No live group
trains on other global values than the rest once it is in a round with them.

The job ends together: ``finish()`` runs rounds (handing over nothing) until one lands in which
every participant is finishing and every group the job had is there (the most participants
any round had), or a participant waited ``finish_timeout`` for a group that does not come back
(a group that rejoins a finishing job heals from it and finishes in the same round). A
restarted group that finds no peer at all (the job has ended) raises :class:`NoPeerToHeal`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import datetime
import hashlib
import logging
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from acco.collectives import ReconfigurableCollectives
from acco.legs import QuantizedLegs
from acco.quantize import BlockCodec, TopKCodec
from acco.outer_round import OuterRunner, OuterShard, RoundRefused, Seating
from acco.replicas import HandOver, ReplicaReport
from acco.sharding import ShardedGroup, ShardPlan, plan_layout, Layout
from acco.telemetry import RoundStats

__all__ = ["ElasticRunner", "NoPeerToHeal", "Quorum", "TorchFT"]

DEFAULT_QUORUM_TIMEOUT = datetime.timedelta(seconds=120)
_log = logging.getLogger("acco")


class NoPeerToHeal(RuntimeError):
    """A restarted replica group found no peer to heal from: every other group has finished or
    is gone. Its launcher decides: if another group finished, the job's result is that group's
    and this one ends cleanly (examples/elastic_local.py exits it with code 3, which its launcher
    counts as done); otherwise the job is lost."""


@dataclass(frozen=True)
class Quorum:
    """One outer round's participants, as torchft's Manager formed them.

    Attributes:
        collectives: the round's collectives over torchft's process group.
        replica / replicas: this replica group's rank among the participants, and their number.
        healed: this replica took a peer's state at this round (it was behind: restarted).
        step: torchft's count of committed rounds (the same on every participant).
        quorum_id: the lighthouse's id of this quorum (a new one whenever the participants
            change): with ``step``, the round's identity (chained into the lineage once it lands).
    """

    collectives: ReconfigurableCollectives
    replica: int
    replicas: int
    healed: bool
    step: int
    quorum_id: int = 0


class TorchFT:
    """The membership of ``mode="local"``'s outer rounds through torchft (``membership=``).

    At each outer round torchft's ``Manager`` forms a quorum of the replica groups alive (its
    lighthouse decides; a restarted group heals from a peer first), acco runs the round over
    torchft's process group among them, and lands it only if every participant succeeded.

    Args:
        manager: a ``torchft.Manager`` made with ``use_async_quorum=False`` (the quorum, and a
            heal, complete before the round's collectives).
        process_group: the torchft process group the manager reconfigures (``ProcessGroupGloo``
            or ``ProcessGroupNCCL``).
        start_with: the first round waits for this many replica groups (a fresh job: every group
            from the first step); later rounds take whoever is alive.
        must_heal: this replica group was restarted: its first round must find a peer ahead of
            it to heal from (``RuntimeError`` otherwise, rather than training alone from scratch).
        collective_timeout: the most one collective of a round waits (a hung peer).
        finish_timeout: the most ``finish()`` waits for a group of the job that is not there
            (restarting, or gone for good) before the groups present end without it (default:
            the quorum timeout).
        grace: how long a round waits, from its first quorum, for a group of the participants'
            last few rounds (:attr:`ElasticRunner.grace_memory`) that has not handed over yet:
            ``"adaptive"`` (the default: a few times the measured spread of hand-over times,
            :attr:`ElasticRunner.grace_factor`) or a number of seconds. A group later than that
            is left out of the round and keeps its progress: its inner steps count in its next
            round.
        replica_id: the name the Manager was given (:meth:`connect` passes it): the group's
            identity in the grace window's memory across rounds and restarts. Without it each
            process is a new group, so a restarted group's peers wait for its old identity in
            the rounds :attr:`ElasticRunner.grace_memory` spans.

    Example::

        membership = TorchFT.connect("replica-0", lighthouse="http://host:29510", min_replicas=1)
        opt = AccoOptimizer(model, torch.optim.AdamW, mode="local", membership=membership, lr=3e-4)
    """

    def __init__(self, manager: Any, process_group: Any, *, start_with: int = 1, must_heal: bool = False,
                 collective_timeout: datetime.timedelta = datetime.timedelta(seconds=30),
                 finish_timeout: datetime.timedelta | None = None, grace: float | str = "adaptive",
                 replica_id: str | None = None) -> None:  # fmt: skip
        if grace != "adaptive" and (isinstance(grace, bool) or not isinstance(grace, (int, float))
                                    or not 0 <= grace < float("inf")):
            raise ValueError(f"Invalid grace: {grace!r} (\"adaptive\" or seconds: finite, >= 0)")
        if isinstance(start_with, bool) or not isinstance(start_with, int) or start_with < 1:
            raise ValueError(f"Invalid start_with: {start_with!r} (an int >= 1: replica groups the first round waits for)")
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("TorchFT needs a Manager made with use_async_quorum=False: a heal must complete before "
                             "the round's collectives")  # fmt: skip
        self.manager, self.process_group = manager, process_group
        self.start_with, self.must_heal = start_with, must_heal
        self.collective_timeout = collective_timeout
        self.quorum_timeout: datetime.timedelta = getattr(manager, "_quorum_timeout", DEFAULT_QUORUM_TIMEOUT)
        self._finish_timeout = finish_timeout
        self.grace = grace
        # This replica group's identity across rounds and restarts: its replica id as the
        # Manager was given it (torchft adds a fresh uuid per process), exact in float64.
        name = replica_id if replica_id is not None else f"anonymous:{id(self)}:{time.time_ns()}"
        self.group_id = int.from_bytes(hashlib.blake2b(str(name).encode(), digest_size=6).digest(), "little")
        self._healed = threading.Event()
        self._first = True
        self._waiting_since: float | None = None
        self._owned: list[Any] = []  # what connect() made, shut down by close()

    @classmethod
    def connect(
        cls,
        replica_id: str,
        *,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        start_with: int = 1,
        must_heal: bool = False,
        timeout: datetime.timedelta = datetime.timedelta(seconds=30),
        quorum_timeout: datetime.timedelta = DEFAULT_QUORUM_TIMEOUT,
        hostname: str | None = None,
        heartbeat_interval: datetime.timedelta = datetime.timedelta(milliseconds=100),
        finish_timeout: datetime.timedelta | None = None,
        grace: float | str = "adaptive",
    ) -> TorchFT:
        """This rank's membership of its replica group: torchft's gloo process group and a
        Manager reaching the lighthouse at ``lighthouse`` (default: ``$TORCHFT_LIGHTHOUSE``).

        A replica group of one process needs no ``torch.distributed``. In a group of several
        ranks (FSDP2 or tensor parallelism inside: the group's own ``torchrun`` job, its default
        process group initialised) every rank calls it: rank 0 opens a fresh store for the
        group's Managers (torchft's model: one per rank, sharing the group's store; rank 0's
        talks to the lighthouse) and tells the others where it is (a broadcast on the default
        group); torchft's process group then pairs each rank with the equal ranks of the other
        groups, and a heal moves each rank's own blocks.

        Args:
            replica_id: this replica group's name (torchft adds a fresh suffix per start).
            min_replicas: a round needs at least this many groups to land (torchft's
                ``min_replica_size``; the lighthouse's own ``--min_replicas`` decides when a
                quorum forms).
            timeout: a collective's and a commit vote's limit (a hung peer is dropped after it).
            quorum_timeout: how long a round may wait for a quorum: longer than the slowest
                replica's inner steps of a round (a peer is waited for at every round) plus the
                lighthouse's heartbeat timeout. A quorum that times out ends the Manager.
            hostname: this machine's address as the other groups reach it (default: its name).
            finish_timeout: see the class (default: ``quorum_timeout``).
            grace: see the class. The lighthouse's own join timeout (``--join_timeout_ms``) is
                the least a round waits for a live group that has not asked: keep it short.
        """
        import torch.distributed as dist
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        host = hostname or socket.gethostname()
        rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False) if rank == 0 else None
        if ranks > 1:  # a fresh store at every start (a restarted group's ranks never read a stale address)
            where = [(host, store.port) if store is not None else None]
            dist.broadcast_object_list(where, src=0)
            host, port = where[0]
        else:
            port = store.port
        group = ProcessGroupGloo(timeout=timeout)
        manager = Manager(
            pg=group, load_state_dict=None, state_dict=None, min_replica_size=min_replicas, use_async_quorum=False,
            replica_id=replica_id, store_addr=host, store_port=port, rank=rank, world_size=ranks,
            lighthouse_addr=lighthouse, hostname=host, timeout=timeout, quorum_timeout=quorum_timeout,
            connect_timeout=timeout, heartbeat_interval=heartbeat_interval,
        )  # fmt: skip
        membership = cls(manager, group, start_with=start_with, must_heal=must_heal, collective_timeout=timeout,
                         finish_timeout=finish_timeout, grace=grace, replica_id=replica_id)  # fmt: skip
        membership.quorum_timeout = quorum_timeout
        membership._owned = [manager] + ([store] if store is not None else [])
        return membership

    @property
    def finish_timeout(self) -> float:
        """Seconds ``finish()`` waits for a missing group of the job."""
        timeout = self._finish_timeout if self._finish_timeout is not None else self.quorum_timeout
        return timeout.total_seconds()

    def runner(self, *args: Any) -> ElasticRunner:
        """The outer round's body over this membership (:class:`ElasticRunner`'s arguments
        after the membership): what :class:`acco.local.LocalLoop` runs on its comm lane."""
        return ElasticRunner(self, *args)

    def bind(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], bool]) -> None:
        """What a replica group behind takes from a peer (:meth:`start_round` heals it);
        ``load_state_dict`` returns whether it replaced this group's state (a restarted group)
        rather than carrying its progress onto the peer's global values (a late one)."""

        def load(state: Any) -> None:
            if load_state_dict(state):
                self._healed.set()

        self.manager.register_state_dict_fn("acco", load, state_dict)

    def start_round(self) -> Quorum:
        """The quorum of this outer round (blocks until torchft has formed it; heals this
        replica group first if it is behind).

        Raises:
            TimeoutError / RuntimeError: torchft's, when no quorum forms within its timeout.
        """
        self._healed.clear()
        self.manager.start_quorum()
        replica = self.manager.participating_rank()
        replicas = self.manager.num_participants()
        if replica is None:
            raise RuntimeError("torchft formed a quorum without this replica group as a participant")
        if (self._first and self.must_heal and not self._healed.is_set() and self.manager.current_step() == 0
                and self.manager.errored() is None):  # (a heal that failed is retried at the next round)
            raise NoPeerToHeal("a restarted replica group found no peer to heal from (every other group has finished "
                               "or is gone): it would train alone from the initial values")  # fmt: skip
        comm = ReconfigurableCollectives(self.process_group, replica, replicas, self.collective_timeout)
        quorum_id = int(getattr(self.manager, "_quorum_id", 0) or 0)
        return Quorum(comm, replica, replicas, self._healed.is_set(), self.manager.current_step(), quorum_id)

    def agree(self, quorum: Quorum, succeeded: bool, device: torch.device | None = None) -> bool:
        """Whether the round lands: every participant's legs succeeded (one all-reduce of the
        failures), the first round had ``start_with`` groups, and torchft's vote. The same on
        every participant, unless a peer dies within this very exchange (the one that lands
        is ahead: torchft heals the other from it at the next round)."""
        # torchft's own errors of this round (a heal or a reconfiguration that failed) count too:
        # its commit vote counts only this replica group's ranks.
        succeeded = succeeded and self.manager.errored() is None
        waiting = self._first and quorum.replicas < self.start_with
        if waiting and self._waiting_since is None:
            self._waiting_since = time.monotonic()
        if waiting and time.monotonic() - self._waiting_since > self.quorum_timeout.total_seconds():
            raise TimeoutError(f"the first round waited {self.quorum_timeout} for {self.start_with} replica groups; "
                               f"{quorum.replicas} came")  # fmt: skip
        failures = torch.tensor([0.0 if succeeded and not waiting else 1.0], dtype=torch.float64, device=device)
        try:
            quorum.collectives.all_reduce_sum_(failures)  # every participant learns of any failure
        except Exception as error:  # a peer died: nobody lands this round
            failures.fill_(1.0)
            if succeeded:
                self.report_error(error)
        if failures.item():
            self.manager.report_error(RuntimeError(
                f"the first round waits for {self.start_with} replica groups" if waiting and succeeded
                else "a participant's outer round failed"))  # fmt: skip
        committed = bool(self.manager.should_commit())
        self._first = self._first and not committed
        return committed

    def report_error(self, error: Exception) -> None:
        self.manager.report_error(error)

    def close(self) -> None:
        """Shut down what :meth:`connect` made (the Manager's server and heartbeats)."""
        for owned in self._owned:
            if hasattr(owned, "shutdown"):
                owned.shutdown(wait=False)
        self._owned = []


@dataclass
class _Epoch:
    """This replica's part of the outer state while the participants stay the same."""

    replica: int
    replicas: int
    plans: list[ShardPlan]
    masters: list[Tensor]  # per param group, this replica's chunk, full precision
    outers: list[torch.optim.Optimizer]


class ElasticRunner(OuterRunner):
    """The outer round (:class:`acco.outer_round.OuterRunner`'s body) over the replica groups
    present (torchft): its hooks seat the quorum (a restarted group heals in it) and this
    replica's epoch of the outer state, exchange the hand-overs (over the group's ranks, then
    across groups; a heal by content where a participant missed a round), lay the legs over
    torchft's process group and the epoch's chunks, agree the round (every participant's legs
    succeeded, and torchft's vote) and land it: ``gathered`` holds the new global values of a
    round that lands.

    Args:
        membership: who takes part (:class:`TorchFT`).
        groups: each param group's buffers (one replica group of one rank: whole parameters).
        global_values: the loop's copy of the global values, per group (read; the loop writes it).
        codec: both legs' encoding (``outer_bits``).
        error_feedback: keep what quantising dropped (per replica, flat over the parameters).
        outer_optimizer: builds the outer optimizer on a chunk.
        heal_state / load_heal_state: the loop's state a restarted replica takes from a peer,
            and how it takes it (see :meth:`acco.local.LocalLoop.heal_state`).
        *args: the rest of :class:`~acco.runner.LaneWork`'s.

    A round whose own legs fail is dropped on every participant (a peer lost mid-round); after
    ``max_failed_rounds`` such rounds in a row the error is this replica's own and is raised
    (``CommLaneError`` at ``step()``), as a non-finite round with ``nonfinite="raise"`` and a
    quorum that never forms are.
    """

    lands_late = False  # a dropped round is carried into the next: its replica waits for the quorum

    max_failed_rounds = 3
    # finish()'s rounds while a group of the job is not there start at wall-clock multiples of
    # this: the finishing groups ask for their quorum at the same instants (a round with some of
    # them only, then one with the rest, would otherwise rotate: torchft's lighthouse issues a
    # quorum as soon as the last one's members ask, and a group left out of it is already waiting).
    finish_poll_seconds = 0.25
    # The adaptive grace window: this many times the median spread of the last rounds' hand-over
    # times (how much later than the median participant the last one handed over), at least
    # grace_floor seconds, at most grace_cap (docs/elastic.md, "Late groups": measured).
    grace_factor, grace_floor, grace_cap, grace_rounds = 3.0, 0.05, 10.0, 8
    # A round waits for every group seen in a round within the last grace_memory committed
    # rounds, not only for those of this group's last round: a group left out of one round is
    # early for the next, where it meets the first of the others to ask; without that memory
    # each round's pair would land without the third, a different one each round, for good.
    grace_memory = 3
    grace_poll_seconds = 0.02  # between two asks for a quorum while the grace window is open

    def __init__(
        self,
        membership: TorchFT,
        groups: Sequence[ShardedGroup],
        global_values: Sequence[Tensor],
        codec: BlockCodec | TopKCodec,
        error_feedback: bool,
        outer_optimizer: Callable[..., torch.optim.Optimizer],
        heal_state: Callable[[], dict[str, Any]],
        load_heal_state: Callable[[dict[str, Any]], None],
        *args: Any,
    ) -> None:
        super().__init__(groups, *args)
        self._membership = membership
        self._global_values = list(global_values)
        self._codec = codec
        self._outer_optimizer = outer_optimizer
        self._shapes = [[tuple(slot.shape) for slot in group.plan.slots] for group in groups]
        # This rank's layout, as its equal ranks in the other groups must share it: a digest of
        # its blocks' shapes (exact in the exchange's float64).
        self._layout = int.from_bytes(hashlib.blake2b(repr(self._shapes).encode(), digest_size=6).digest(), "little")
        self._residuals = ([torch.zeros(g.plan.padded_numel, dtype=torch.float32, device=g.device) for g in groups]
                           if error_feedback else None)  # fmt: skip
        self._epoch: _Epoch | None = None
        self._round: Any = None  # the round being run (a heal rewrites its hand-over)
        self._heal_state, self._load_heal_state = heal_state, load_heal_state
        membership.bind(self._state_for_peer, self._heal)
        # Where the global values come from: (rounds landed, a digest chained over their identities).
        self.lineage: tuple[int, int] = (0, 0)
        self.most_participants = 0  # the most groups a landed round had: the job's groups, for finish()
        self.ends_job = False  # the last landed round ended the job on every participant
        self._finishing_since: float | None = None
        self._failures: list[Exception] = []  # this replica's own failed rounds in a row
        self._peers: list[_Peer] = []  # what the last round's exchange said of its participants
        self._carried = False  # this quorum's heal carried this group's progress (a late group)
        self._landed = False  # a round landed on this process's state (or a checkpoint restored it): its progress is its own
        # A round this group handed over in was dropped here since its last landed one: another
        # participant may have landed it (its agreement failed here only), its progress then already
        # in the newest global values. Such a group takes them as they are (its steps since lost)
        # rather than carrying its progress onto them twice.
        self._maybe_merged = False
        self._seen: dict[int, int] = {}  # each group in a round with this one: the round's torchft step
        self._spreads: collections.deque[float] = collections.deque(maxlen=self.grace_rounds)
        self._handed_over_at = self._first_quorum_at = 0.0
        self.replica, self.replicas = 0, 1
        self.place = [0, 1]  # a residual is this replica's own (a checkpoint of one group's rank)

    # ------------------------------------------------------------ the round's hooks

    def _seat(self, round_: Any) -> Seating:
        """The quorum (a restarted replica group heals inside it) and this replica's epoch; the
        legs and shards follow the exchange (a heal by content may rebuild the epoch)."""
        self._round = round_
        if round_.hand_over.finishing and self._finishing_since is not None:
            period = self.finish_poll_seconds  # finish() waits for a group of the job: a rendezvous, not a busy loop
            time.sleep(period - time.time() % period)
        self._handed_over_at = time.monotonic()
        seating = Seating(0, 1, None, None, [], gathers_unchanged=False)
        self._ask(seating, round_)
        self._first_quorum_at = time.monotonic()
        return seating

    def _ask(self, seating: Seating, round_: Any) -> None:
        """This round's quorum (a restarted replica group heals inside it, a late one takes the
        global values with its progress carried onto them) and this replica's epoch, into
        ``seating``."""
        self._carried = False
        with self._recorder.phase(round_.stats, "quorum"):
            quorum = self._membership.start_round()
        self.replica, self.replicas = quorum.replica, quorum.replicas
        self._epoch_for(quorum, rebuild=self._carried, keep_residuals=self._carried)
        round_.stats.content_heal = round_.stats.content_heal or self._carried
        seating.replica, seating.replicas, seating.comm, seating.context = (quorum.replica, quorum.replicas,
                                                                             quorum.collectives, quorum)  # fmt: skip

    def _exchange(self, seating: Seating, round_: Any) -> tuple[int, ReplicaReport]:
        """Every participant's hand-over, asked again while a group of the participants' last
        round is missing and the grace window is open; where some were left out of a round the
        others landed, the heal by content (they take the newest global values, their own
        progress carried onto them); then the round's legs and this rank's shards of the epoch."""
        stats, record = round_.stats, self._recorder
        with record.phase(stats, "totals"):
            nonfinite, report, self._peers, spread, waits = self._agreed_exchange(seating, round_)
        while waits:  # (its own phase: a wait for a late group is not a wait for the others' hand-overs)
            with record.phase(stats, "grace"):
                time.sleep(self.grace_poll_seconds)  # the missing group may ask meanwhile: the lighthouse adds it
                self._ask(seating, round_)
                nonfinite, report, self._peers, spread, waits = self._agreed_exchange(seating, round_)
        stats.spread = spread
        if seating.replicas > 1:
            self._spreads.append(spread)
        quorum, peers = seating.context, self._peers
        followers = [r for r, peer in enumerate(peers) if peer.lineage != max(p.lineage for p in peers)]
        if followers:  # some participant was left out of a round the others landed
            with record.phase(stats, "heal"):
                self._heal_by_content(quorum, peers, followers, round_)
            follower = quorum.replica in followers
            stats.content_heal = stats.content_heal or follower
            if follower:
                self._epoch_for(quorum, rebuild=True, keep_residuals=not peers[quorum.replica].maybe_merged)
            lost = [r for r in followers if peers[r].maybe_merged]  # they take the newest values as they are
            report = dataclasses.replace(report, steps=tuple(0 if r in lost else n for r, n in enumerate(report.steps)),
                                         weights=tuple(0.0 if r in lost else w for r, w in enumerate(report.weights)))  # fmt: skip
        copies = self._copies()
        seating.legs = QuantizedLegs(self._codec, copies, self._residuals)
        seating.shards = [self._shard(number, group, copy.clone(), round_.params[number])
                          for number, (group, copy) in enumerate(zip(self._groups, copies))]  # fmt: skip
        return nonfinite, report

    def _shard(self, number: int, group: ShardedGroup, values: Tensor, params: Tensor) -> OuterShard:
        """Param group ``number``'s part in this epoch: its chunk's master and outer optimizer,
        the hand-over relaid for the epoch's chunks, the new global values into ``values``."""
        epoch = self._epoch
        plan, master, outer = epoch.plans[number], epoch.masters[number], epoch.outers[number]
        grad = torch.empty_like(master)

        def step() -> None:
            master.grad = grad
            outer.step()
            master.grad = None

        return OuterShard(_Place(plan, epoch.replica), self._relaid(params, group.plan, plan), master, grad, step,
                          lambda: None, values, values)  # fmt: skip

    def _legs_failed(self, round_: Any, error: Exception) -> None:
        """A peer lost mid-round: the round is dropped on every participant (its vote says
        so); after ``max_failed_rounds`` in a row the error is this replica's own: raised."""
        self._membership.report_error(error)
        self._failures.append(error)
        _log.warning("elastic outer round %d dropped on this replica group: %s: %s", round_.stats.index,
                     type(error).__name__, error)  # fmt: skip
        if len(self._failures) >= self.max_failed_rounds:
            raise self._failed(round_, error) from error

    def _agree(self, seating: Seating, succeeded: bool) -> bool:
        if succeeded:
            self._failures.clear()
        with self._recorder.phase(self._round.stats, "agree"):
            return self._membership.agree(seating.context, succeeded, self._groups[0].device)

    def _land(self, seating: Seating, round_: Any, committed: bool) -> None:
        """A landed round's global values into each group's ``gathered`` (relaid for the
        groups' layout), its identity into the lineage, and whether it ends the job; a dropped
        one changes nothing but the residuals (reset) and the epoch (rebuilt next round)."""
        quorum, stats = seating.context, round_.stats
        stats.participants = quorum.replicas
        if committed:
            for group, shard in zip(self._groups, seating.shards):
                group.gathered.zero_()
                self._relay(shard.out, shard.place.plan, group.gathered, group.plan)
            self.lineage = _next_lineage(self.lineage, quorum)
            self.most_participants = max(self.most_participants, quorum.replicas)
            self._landed, self._maybe_merged = True, False
            stats.counted = 0 if stats.skipped else round_.report.steps[quorum.replica]
            # The job ends on a round every participant finishes in, with every group the job had
            # (or after a participant's finish_timeout): the same decision on every participant.
            self.ends_job = all(round_.report.finishing) and (
                quorum.replicas >= max(peer.expected for peer in self._peers) or any(peer.gives_up for peer in self._peers))
        else:
            stats.dropped, stats.counted = True, 0
            self._maybe_merged = self._landed
            self._epoch = None  # a master may have stepped: the next round rebuilds from the global values
            for residual in self._residuals or []:
                residual.zero_()
        self._round = None

    def replay(self, round_: Any) -> RoundStats:
        raise AssertionError("elastic outer rounds are blocking: no round is in flight in a checkpoint")

    def state_dict(self) -> dict[str, Any]:
        """What only elastic rounds keep, for a checkpoint of this group: the lineage, the most
        groups a round had, the residuals and this participant's part of the outer state (its
        chunk's master values and outer-optimizer state, for the participants of the last
        round). A job resumed at the same groups and layout takes up its rounds bit for bit."""
        epoch = self._epoch
        return {
            "lineage": list(self.lineage),
            "most_participants": self.most_participants,
            "residuals": None if self._residuals is None else list(self._residuals),
            "epoch": None if epoch is None else {
                "replica": epoch.replica, "replicas": epoch.replicas, "masters": list(epoch.masters),
                "outers": [outer.state_dict() for outer in epoch.outers]},
        }  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A :meth:`state_dict`, after the join round of a fresh job: the round's epoch and
        residuals give way to the saved ones (the next round keeps them if it has the same
        participants, and rebuilds from the global values otherwise)."""
        self.lineage = (int(saved["lineage"][0]), int(saved["lineage"][1]))
        self.most_participants = int(saved["most_participants"])
        self._landed = True
        device = self._groups[0].device
        if saved["residuals"] is not None and self._residuals is not None:
            self._residuals = [r.to(device=device, dtype=torch.float32).clone() for r in saved["residuals"]]
        epoch = saved["epoch"]
        if epoch is None:
            self._epoch = None
            return
        replicas = int(epoch["replicas"])
        plans = [plan_layout(Layout.FLAT, shapes, replicas) for shapes in self._shapes]
        masters, outers = [], []
        for master, state in zip(epoch["masters"], epoch["outers"]):
            master = master.to(device=device, dtype=torch.float32).clone().requires_grad_(True)
            outer = self._outer_optimizer([master])
            outer.load_state_dict(state)
            masters.append(master)
            outers.append(outer)
        self._epoch = _Epoch(int(epoch["replica"]), replicas, plans, masters, outers)

    @property
    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """Each param group's outer optimizer on this participant's chunk now (empty before the
        first round)."""
        return [] if self._epoch is None else list(self._epoch.outers)

    def buffer_bytes(self, number: int) -> dict[str, int]:
        """Param group ``number``'s outer state now: its chunk's master values and this
        group's residual (the outer optimizer's state is the optimizer's)."""
        master = 0 if self._epoch is None else self._epoch.masters[number].nbytes
        residual = 0 if self._residuals is None else self._residuals[number].nbytes
        return {"master": master, "outer_residual": residual}

    # ------------------------------------------------------------------------- the parts

    def _exchange_hand_overs(self, quorum: Quorum, round_: Any) -> tuple[int, ReplicaReport, list[_Peer], float, bool]:
        """Every participant's hand-over and non-finite flag, what only elastic rounds need of
        each (:class:`_Peer`), and whether to ask for the quorum again (the grace window: the
        same decision on every participant, from what they all sent), in one all-reduce (each
        rank with the equal ranks of the other groups, every rank of a group saying what its
        group agreed: the same on all of them); and this round's spread of hand-over times."""
        own, nonfinite, gives_up = self._group_hand_over(round_)
        fields, device, now = 17, self._groups[0].device, time.monotonic()
        flags = torch.zeros(1 + fields * quorum.replicas, dtype=torch.float64, device=device)
        start = 1 + fields * quorum.replica
        flags[start : start + fields] = torch.tensor(
            [own.steps, own.weight, own.step_seconds, own.stop, own.finishing, *self.lineage, self.most_participants,
             gives_up, self._layout, self._expected(quorum), now - self._handed_over_at, now - self._first_quorum_at,
             self.grace(), self._maybe_merged, self._membership.group_id, own.round_seconds],
            dtype=torch.float64)  # fmt: skip
        flags[0] = float(nonfinite)
        quorum.collectives.all_reduce_sum_(flags)
        flags = flags.cpu()
        rows = flags[1:].view(quorum.replicas, fields).tolist()
        if len({row[9] for row in rows}) != 1:
            raise RoundRefused(_MISFIT)
        # A group of the participants' recent rounds has not asked yet (late, or gone): ask again
        # while the window opened by this round's first quorum lasts (the lighthouse adds a
        # group that asked meanwhile to the next quorum at once).
        missing = quorum.replicas < max(row[10] for row in rows)
        if missing and max(row[12] for row in rows) < max(row[13] for row in rows):
            return 0, None, [], 0.0, True  # type: ignore[return-value]
        self._saw(quorum, [int(row[15]) for row in rows])
        # How much later than the median participant the last one handed over (a group back from
        # a stall, which asked long before the others, leaves the median where it is).
        waited = [row[11] for row in rows]
        report = ReplicaReport(
            steps=tuple(int(row[0]) for row in rows), weights=tuple(row[1] for row in rows),
            step_seconds=tuple(row[2] for row in rows), stop=tuple(bool(row[3]) for row in rows),
            finishing=tuple(bool(row[4]) for row in rows), round_seconds=tuple(row[16] for row in rows),
        )  # fmt: skip
        peers = [_Peer((int(row[5]), int(row[6])), int(row[7]), bool(row[8]), bool(row[14])) for row in rows]
        return int(flags[0].item()), report, peers, statistics.median(waited) - min(waited), False

    def _agreed_exchange(self, seating: Seating, round_: Any) -> tuple[int, ReplicaReport, list[_Peer], float, bool]:
        """:meth:`_exchange_hand_overs`, and in a group of several ranks whether any rank asks
        for the quorum again or failed (one all-reduce over the group's ranks: every rank asks
        again, proceeds or fails alike, whatever its clock or its own exchange said)."""
        failed: Exception | None = None
        try:
            nonfinite, report, peers, spread, waits = self._exchange_hand_overs(seating.context, round_)
        except Exception as error:  # (raised below, once the group's other ranks know)
            failed, nonfinite, report, peers, spread, waits = error, 0, None, [], 0.0, False
        if self._replica_size > 1:
            flags = torch.tensor([float(waits), float(failed is not None)], dtype=torch.float64,
                                 device=self._groups[0].device)  # fmt: skip
            self._mesh_comm.all_reduce_sum_(flags)
            waits = bool(flags[0].item())
            if flags[1].item() and failed is None:
                failed = RuntimeError("another rank of this replica group failed the round's exchange")
        if failed is not None:
            raise failed
        return nonfinite, report, peers, spread, waits

    def _saw(self, quorum: Quorum, groups: Sequence[int]) -> None:
        """``groups`` (their :attr:`TorchFT.group_id`) took part in ``quorum``'s round with this one."""
        self._seen.update((group, quorum.step) for group in groups)

    def _expected(self, quorum: Quorum) -> int:
        """How many groups were in a round with this one within the last :attr:`grace_memory`
        committed rounds (itself included): a round with fewer waits the grace window."""
        return sum(1 for step in self._seen.values() if step >= quorum.step - self.grace_memory)

    def grace(self) -> float:
        """Seconds a round waits, from its first quorum, for a missing group of the last rounds:
        the membership's ``grace``, or (``"adaptive"``) :attr:`grace_factor` times the median
        spread of the last :attr:`grace_rounds` rounds' hand-over times, within
        [:attr:`grace_floor`, :attr:`grace_cap`]."""
        fixed = self._membership.grace
        if fixed != "adaptive":
            return float(fixed)
        spread = statistics.median(self._spreads) if self._spreads else 0.0
        return min(self.grace_cap, max(self.grace_floor, self.grace_factor * spread))

    def _group_hand_over(self, round_: Any) -> tuple[HandOver, bool, bool]:
        """What this replica group hands over, agreed by its ranks (one all-reduce over the
        group's ranks when it has several, as the fixed mesh's exchange counts a replica group):
        its first rank's steps and weight, its slowest rank's seconds per step, a stop or a
        finish any rank asks for; whether any rank holds NaN or inf (exact); whether any rank
        has waited ``finish_timeout`` in ``finish()``."""
        own = round_.hand_over
        if own.finishing and self._finishing_since is None:
            self._finishing_since = time.monotonic()
        gives_up = own.finishing and time.monotonic() - self._finishing_since > self._membership.finish_timeout
        quick = self._nonfinite_flag(round_.params)
        if self._replica_size == 1:
            return own, bool(quick.item()) and self._confirm_nonfinite(round_.params) > 0, gives_up
        fields, ranks, rank = 7, self._mesh_comm.world_size, self._mesh_comm.rank
        flags = torch.zeros(1 + fields * ranks, dtype=torch.float64, device=quick.device)
        flags[1 + fields * rank : 1 + fields * (rank + 1)] = torch.tensor(
            [own.steps, own.weight, own.step_seconds, own.stop, own.finishing, own.round_seconds, gives_up],
            dtype=torch.float64)  # fmt: skip
        flags[0] = quick
        self._mesh_comm.all_reduce_sum_(flags)
        flags = flags.cpu()
        rows = flags[1:].view(ranks, fields).tolist()
        agreed = HandOver.of_ranks([row[:6] for row in rows])
        nonfinite = bool(flags[0]) and self._confirm_nonfinite(round_.params) > 0  # over the group's ranks
        return agreed, nonfinite, any(row[6] for row in rows)

    def _heal_by_content(self, quorum: Quorum, peers: list[_Peer], followers: list[int], round_: Any) -> None:
        """The newest lineage's global values to the participants of older ones (sent by the
        first participant holding it, as an all-reduce in which the others add zeros): those
        take them, their own progress carried onto them (their part of the outer state is
        rebuilt from them)."""
        newest = max(peer.lineage for peer in peers)
        source = next(r for r, peer in enumerate(peers) if peer.lineage == newest)
        follower = quorum.replica in followers
        newest_values = []
        for values in self._global_values:
            sent = values.clone() if quorum.replica == source else torch.zeros_like(values)
            quorum.collectives.all_reduce_sum_(sent)
            newest_values.append(sent)
        if not follower:
            return
        self.lineage = newest
        if self._maybe_merged:  # its progress may be in them already: they as they are, its hand-over them
            _log.warning("elastic outer round %d: this replica group dropped a round another may have landed: it takes "
                         "the newest global values as they are (its inner steps since are lost)", round_.stats.index)
            for group, values, new in zip(self._groups, self._global_values, newest_values):
                values.copy_(new)
                group.load_params(values)
            self._hand_over_global_values(round_, round_.hand_over.step_seconds)
            return
        _log.info("elastic outer round %d: this replica group missed a round the others landed: it takes their global "
                  "values, its own progress carried onto them", round_.stats.index)  # fmt: skip
        self._carry(round_, newest_values)

    def _carry(self, round_: Any, newest: Sequence[Tensor]) -> None:
        """A late replica group takes the newest global values and keeps its progress: its
        parameters (live, and this round's hand-over) move by as much as the global values do,
        so its pseudo-gradient is what it trained since the global values it started from, and
        its hand-over (its inner steps and tokens since its last landed round) counts whole."""
        with torch.no_grad():
            for group, params, values, new in zip(self._groups, round_.params, self._global_values, newest):
                new = new.to(device=values.device)
                params.copy_(params.float() + (new.float() - values.float()))  # (in fp32 whatever the buffers')
                values.copy_(new)
                group.load_params(params)

    def _epoch_for(self, quorum: Quorum, rebuild: bool = False, keep_residuals: bool = False) -> _Epoch:
        """This replica's chunk of the outer state for the round's participants: kept while they
        stay the same; otherwise what it owned of its new chunk kept, the rest rebuilt from the
        global values with the outer optimizer's state zero (all of it after a heal, a heal by
        content (``rebuild``) or a dropped round). The residuals restart with a heal, unless
        ``keep_residuals`` (a late group's own, carried with its progress)."""
        old = None if quorum.healed or rebuild else self._epoch
        if old is not None and (old.replica, old.replicas) == (quorum.replica, quorum.replicas):
            return old
        if self._residuals is not None and (quorum.healed or rebuild) and not keep_residuals:
            for residual in self._residuals:
                residual.zero_()
        plans = [plan_layout(Layout.FLAT, shapes, quorum.replicas) for shapes in self._shapes]
        masters, outers = [], []
        for number, (plan, values) in enumerate(zip(plans, self._global_values)):
            start, stop = plan.rank_range(quorum.replica)
            numel = sum(slot.numel for slot in plan.slots)
            master = torch.zeros(plan.chunk, dtype=torch.float32, device=values.device)
            master[: max(0, min(stop, numel) - start)] = values[start : min(stop, numel)].float()
            outer = self._outer_optimizer([master.requires_grad_(True)])
            if old is not None:
                self._keep_overlap(old, number, master, outer, start, stop)
            masters.append(master)
            outers.append(outer)
        # The residuals and copies are laid out for the new number of chunks (padding only differs).
        self._residuals = None if self._residuals is None else [
            self._resized(r, plan.padded_numel) for r, plan in zip(self._residuals, plans)]  # fmt: skip
        self._epoch = _Epoch(quorum.replica, quorum.replicas, plans, masters, outers)
        return self._epoch

    @staticmethod
    def _keep_overlap(old: _Epoch, number: int, master: Tensor, outer: torch.optim.Optimizer, start: int,
                      stop: int) -> None:
        """The elements this replica owned before and still owns: their master values and
        outer-optimizer state as they were."""
        old_start, old_stop = old.plans[number].rank_range(old.replica)
        first, last = max(start, old_start), min(stop, old_stop)
        if first >= last:
            return
        previous, previous_outer = old.masters[number], old.outers[number]
        with torch.no_grad():
            master[first - start : last - start] = previous[first - old_start : last - old_start]
        state = previous_outer.state.get(previous, {})
        if not state:
            return
        kept: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, Tensor) and value.shape == previous.shape:
                fresh = torch.zeros_like(master)
                fresh[first - start : last - start] = value[first - old_start : last - old_start]
                kept[key] = fresh
            else:
                kept[key] = copy.deepcopy(value)
        outer.state[master] = kept

    def _copies(self) -> list[Tensor]:
        """The global values laid out for this epoch's chunks (a view where the padding fits)."""
        out = []
        for values, plan in zip(self._global_values, self._epoch.plans):
            if values.numel() >= plan.padded_numel:
                out.append(values[: plan.padded_numel])
            else:
                out.append(self._resized(values, plan.padded_numel))
        return out

    @staticmethod
    def _resized(flat: Tensor, numel: int) -> Tensor:
        out = torch.zeros(numel, dtype=flat.dtype, device=flat.device)
        count = min(numel, flat.numel())
        out[:count] = flat[:count]
        return out

    @staticmethod
    def _relaid(flat: Tensor, source: ShardPlan, target: ShardPlan) -> Tensor:
        """A flat buffer of ``source``'s layout in ``target``'s (the same order of parameters)."""
        out = torch.zeros(target.padded_numel, dtype=flat.dtype, device=flat.device)
        ElasticRunner._relay(flat, source, out, target)
        return out

    @staticmethod
    def _relay(flat: Tensor, source: ShardPlan, out: Tensor, target: ShardPlan) -> None:
        for a, b in zip(source.slots, target.slots):
            out[b.offset : b.offset + b.numel] = flat[a.offset : a.offset + a.numel]

    def _state_for_peer(self) -> dict[str, Any]:
        """What a restarted group takes from this one: the loop's, and where its global values
        come from."""
        return {**self._heal_state(), "lineage": list(self.lineage), "most_participants": self.most_participants,
                "layout": self._layout}

    def _heal(self, state: dict[str, Any]) -> bool:
        """A peer's state, taken inside the quorum (this replica was behind in torchft's step
        count). A group whose state is its own (it has landed a round in this process: late,
        a paused process among them) takes only the global values, its progress carried onto
        them; a restarted one, or one that dropped a round another may have landed (its progress
        perhaps in them already), takes the loop's whole state, and this round's hand-over becomes
        the global values themselves, with no weight. Returns whether the state was replaced.

        Raises:
            RoundRefused: the peer's rank holds other blocks than this one (groups laid out
                differently).
        """
        if state.get("layout", self._layout) != self._layout:
            raise RoundRefused(_MISFIT)
        lineage = tuple(state.get("lineage", self.lineage))
        self.most_participants = max(self.most_participants, int(state.get("most_participants", 0)))
        if self._landed and not self._maybe_merged and self._round is not None:
            self._carry(self._round, state["global_values"])
            self.lineage, self._carried = lineage, True
            return False
        self._load_heal_state(state)
        self.lineage = lineage
        if self._round is not None:
            self._hand_over_global_values(self._round, 0.0)
        return True

    def _hand_over_global_values(self, round_: Any, step_seconds: float) -> None:
        """This round's hand-over becomes the global values themselves, with no steps and no
        weight (a heal: this replica's own progress is not the round's)."""
        for params, values in zip(round_.params, self._global_values):
            params.copy_(values)
        own = round_.hand_over
        round_.hand_over = HandOver(0, 0.0, step_seconds, own.stop, own.finishing, own.round_seconds)


_MISFIT = ("the replica groups are laid out differently (this rank's blocks of the parameters differ from its equal "
           "ranks' in the other groups): every group needs the same model, the same number of ranks and the same "
           "inner sharding (FSDP2 / TP plan)")


def _next_lineage(lineage: tuple[int, int], quorum: Quorum) -> tuple[int, int]:
    """The lineage after landing ``quorum``'s round: one more round, the digest chained over its
    identity (52 bits: exact in the exchange's float64)."""
    count, digest = lineage
    text = f"{digest}:{quorum.step}:{quorum.quorum_id}:{quorum.replicas}".encode()
    return count + 1, int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 12


@dataclass(frozen=True)
class _Peer:
    """What a round's first exchange says of a participant beyond its hand-over.

    Attributes:
        lineage: where its global values come from (rounds landed, their chained digest).
        expected: the most groups a round it landed had (the job's groups, as it knows them).
        gives_up: it has waited ``finish_timeout`` in ``finish()`` for a missing group.
        maybe_merged: a round it handed over in was dropped on it since its last landed one
            (another participant may have landed it): behind, it takes the newest global values
            as they are, with no weight.
    """

    lineage: tuple[int, int]
    expected: int
    gives_up: bool
    maybe_merged: bool = False


@dataclass(frozen=True)
class _Place:
    """A param group's chunks among a round's participants, as :class:`acco.legs.QuantizedLegs` reads them."""

    plan: ShardPlan
    rank: int
