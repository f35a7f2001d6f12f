"""torchft's own DiLoCo as a replica group of examples/elastic_local.py: the baseline that acco's
elastic local steps are compared against, at equal wall time (``pip install acco[ft]``):

    python examples/elastic_local.py --trainer torchft-diloco --replicas 3 --seconds 120 --log-dir runs/diloco

The launcher runs :func:`replica_main` in each replica-group process instead of its acco worker.
Everything but the outer round is the acco worker's: the byte-level GPT of examples/train_gpt.py
(the same seed, so every group starts from the same model), its data and data seeds, an inner step
of ``--micro-batches`` micro-batches whose gradients are averaged (acco's ``accumulate()``),
clipped at 1.0, AdamW (lr ``--lr``, betas 0.9/0.95, weight decay 0.1 on matrices) with the
launcher's learning-rate schedule per inner step, acco's default outer optimizer (SGD, lr 0.5,
momentum 0.3, Nesterov), ``--sync-every``, ``--step-seconds``, ``--slow``, ``--stall``, the
lighthouse and its timeouts, and the same files (``replica-I.jsonl``, ``.final``, ``.pid``).

The outer round is ``torchft.local_sgd.DiLoCo``'s, unchanged: after every ``sync_every`` inner
steps torchft's Manager forms a quorum (the lighthouse decides who is in), the participants
average their pseudo-gradients (full precision, one all-reduce per parameter) and the outer step
lands where the group's commit vote passes; where it fails the group's parameters go back to the
last global values and its round's steps are lost. A group behind (stalled, restarted) heals from
a peer: it takes the peer's current parameters, inner optimizer, global values, outer optimizer
and step count, so its own steps since its last landed round are replaced, and that round counts
the peer's pseudo-gradient twice (torchft's local_sgd.py says so: "some replicas will get the same
copy of the model").

A fresh job starts training once one quorum holds every replica group (no commit in it; acco's
first round waits for every group too): without that the lighthouse gives the first group up a
quorum of its own and the later ones heal from it, their first round lost. torchft's ``init_sync``
is off for the same reason (with it, at step 0 every group but one heals from that one); the same
seed gives every group the same initial model instead.

Where it differs from acco's worker, by torchft's design:

- every group takes ``sync_every`` inner steps per round (no speed pacing: a slower group holds
  every round up; ``--pacing`` does not apply), and the pseudo-gradients travel in float32
  (``--outer-bits`` does not apply: torchft quantizes only with Triton on a GPU);
- a group left out of a round (stalled past the lighthouse's join timeout) does not carry its
  steps into a later round: it heals when it next asks, and its steps count for nothing;
- torchft has no agreed end of training. This worker ends it so: with ``--steps`` every group
  stops once torchft's step (rounds landed, the same on every participant; a heal copies it)
  reaches ``--steps // --sync-every``, so groups that land the last round together end on the
  same parameters. With ``--seconds`` each group, after each round it landed, votes to stop when
  this round boundary is nearer its budget (counted from its first inner step) than the next one
  (acco's rule, with the median of this group's round lengths as the measure: acco takes the last
  one, which a stalled round would stretch), and the round's participants take the largest vote
  (one all-reduce of one number over torchft's process group): they stop together.

Caveat, not hidden: a group that was not in the last landed round (stalled then, or its commit
failed) finishes alone. Once the others have exited and their heartbeats expired the lighthouse
gives it a quorum of its own; it lands its round alone (no peer is ahead of it to heal from) and
ends on parameters of its own: its ``.final`` digest then differs from the others'.

A group of several ranks is not supported (``--nproc-per-replica 1`` only), nor ``--die-in-round``
(it injects into acco's membership); a restarted group (``ACCO_ELASTIC_START``) that finds no
peer in its first round exits with the launcher's no-peer code, as acco's worker does.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed import ReduceOp, TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo

from acco.options import default_outer
from elastic_local import NO_PEER_EXIT_CODE, RESTART_ENV, lr_factor, stalls_at
from train_gpt import GPT, GPTConfig, WarmupCosine, eval_batches, evaluate, load_corpus, loss_fn, param_groups, \
    sample_batch, split_corpus  # fmt: skip

__all__ = ["RoundOutcome", "replica_main"]

# A fresh job's first quorum waits for every replica group; the lighthouse forms one from those
# alive as they come (a quorum of one while the others still load torch), so the start asks again.
GATHER_POLL_SECONDS = 0.1


def replica_main(args: argparse.Namespace) -> None:
    """One replica group of examples/elastic_local.py training with torchft's DiLoCo.

    Args:
        args: elastic_local.py's parsed arguments (``--replica`` set by its launcher).

    Raises:
        ValueError: ``--nproc-per-replica`` above 1, or ``--die-in-round``.
        TimeoutError: a fresh job's replica groups did not all come within ``--quorum-timeout``.
    """
    if args.nproc_per_replica != 1:
        raise ValueError(f"--trainer torchft-diloco: replica groups of one process only, not --nproc-per-replica "
                         f"{args.nproc_per_replica}")  # fmt: skip
    if args.die_in_round is not None:
        raise ValueError(f"--die-in-round {args.die_in_round}: acco's worker only (kill the process instead)")
    directory, index = Path(args.log_dir), args.replica
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"replica-{index}.pid").write_text(str(os.getpid()))
    started = int(os.environ.get(RESTART_ENV, "0"))
    torch.set_num_threads(1)
    corpus = load_corpus(args.data, args.max_bytes)
    train_data, held_out = split_corpus(corpus, args.seq_len)
    eval_set = eval_batches(held_out, args.eval_batches, args.batch_size, args.seq_len, args.seed, torch.device("cpu"))
    torch.manual_seed(args.seed)  # every replica group the same initial model (torchft's init_sync is off)
    model = GPT(GPTConfig(args.n_layer, args.n_embd, args.n_head, args.seq_len))
    inner = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=args.lr, betas=(0.9, 0.95))
    outer = default_outer(args.sync_every)(model.parameters())  # acco's, for the same sync_every

    # What a group behind takes from a peer besides DiLoCo's own (global values, outer optimizer).
    heals: list[int] = []  # torchft's step after each heal of the current round (the peer's)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])
        heals.append(manager.current_step())

    timeout = datetime.timedelta(seconds=args.timeout)
    host = args.hostname or socket.gethostname()
    store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)  # this group's alone
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=args.min_replicas, use_async_quorum=False, init_sync=False, replica_id=f"replica-{index}",
        store_addr=host, store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname=host,
        timeout=timeout, quorum_timeout=datetime.timedelta(seconds=args.quorum_timeout), connect_timeout=timeout,
    )  # fmt: skip
    if started == 0:  # a restarted group joins whoever trains: its first round heals it
        _gather(manager, args.replicas, args.quorum_timeout)
    generator = torch.Generator().manual_seed(args.seed + 1000 * index + 1_000_000 * started)
    step_seconds = args.step_seconds
    if args.slow is not None and int(args.slow.split(":")[0]) == index:
        step_seconds *= float(args.slow.split(":")[1])
    schedule = WarmupCosine(20, args.steps)
    stalls = stalls_at(args, index) if started == 0 else {}
    every = args.sync_every
    last_round = max(1, args.steps // every)  # --steps: torchft's step at which every group stops
    log = open(directory / f"replica-{index}.jsonl", "a")
    joined = "restarted: heals from a peer at its first round" if started else "every replica group came"
    print(f"replica {index} | {joined}", flush=True)

    clock = started_at = boundary = last_landed = time.perf_counter()
    deadline = None if args.seconds is None else started_at + args.seconds
    losses: list[float] = []
    round_lengths: list[float] = []  # boundary to boundary, this group's rounds (a stalled one among them)
    taken = in_round = 0  # this process's inner steps; those since the last round boundary
    first_round = True
    with DiLoCo(manager, [model], inner, outer, sync_every=every):
        while True:
            job_step = manager.current_step() * every + in_round  # the job's count (a heal takes the peer's)
            for group in inner.param_groups:
                group["lr"] = args.lr * lr_factor(args, schedule, job_step, started_at)
            if job_step in stalls:  # --stall: busy elsewhere (an evaluation, a checkpoint), still heartbeating
                time.sleep(stalls.pop(job_step))
            inner.zero_grad(set_to_none=True)
            for _ in range(args.micro_batches):  # their mean, as acco's accumulate() weighs them
                x, y = sample_batch(train_data, args.batch_size, args.seq_len, generator)
                loss = loss_fn(model, x, y)
                (loss / args.micro_batches).backward()
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step_seconds:
                time.sleep(step_seconds)
            before = manager.current_step()
            inner.step()  # after every sync_every-th, DiLoCo's hook runs the outer round (quorum, heal, commit)
            taken, in_round = taken + 1, in_round + 1
            if in_round < every:
                continue

            outcome = RoundOutcome.read(manager, before, heals)
            in_round = 0
            heals.clear()
            now = time.perf_counter()
            round_lengths.append(now - boundary)
            boundary = now
            entry = {"round": outcome.step, "inner_step": outcome.step * every, "participants": outcome.participants,
                     "dropped": not outcome.landed, "healed": outcome.healed, "counted": outcome.counted(every),
                     "taken": taken, "loss": sum(losses) / len(losses) if losses else None,
                     "seconds": round(now - clock, 3), "time": time.time(), "pid": os.getpid()}  # fmt: skip
            log.write(json.dumps(entry) + "\n")
            log.flush()
            losses = []
            print(f"replica {index} | round {entry['round']:4d} | inner step {entry['inner_step']:5d} | "
                  f"{entry['participants']} replica group(s)" + (" | healed" if outcome.healed else "")
                  + (" | dropped" if not outcome.landed else "")
                  + ("" if entry["loss"] is None else f" | loss {entry['loss']:.4f}"), flush=True)  # fmt: skip
            if outcome.landed:
                last_landed = now
            elif now - last_landed > args.quorum_timeout:  # e.g. --min-replicas groups are gone for good
                raise RuntimeError(f"replica {index}: no outer round landed for {now - last_landed:.0f}s "
                                   f"(--quorum-timeout {args.quorum_timeout:g})")  # fmt: skip
            if first_round and started > 0 and outcome.landed and not outcome.healed:
                # Restarted after every other group had ended: it trained a round alone from the
                # initial values. If one finished, the job's result is its.
                print(f"replica {index} | came back to a job with no group left", flush=True)
                log.close()
                manager.shutdown(wait=False)
                sys.exit(NO_PEER_EXIT_CODE)
            first_round = False
            if deadline is None:
                if outcome.step >= last_round:
                    break
            elif outcome.landed and _agreed_stop(manager, now + statistics.median(round_lengths) / 2 > deadline):
                break

    final = evaluate(model, eval_set)  # the global values of the last round this group landed
    digest = hashlib.sha256()
    for value in model.state_dict().values():
        digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    log.write(json.dumps({"final": True, "eval_loss": final, "inner_step": manager.current_step() * every,
                          "round": manager.current_step(), "taken": taken}) + "\n")  # fmt: skip
    log.close()
    (directory / f"replica-{index}.final").write_text(digest.hexdigest())
    print(f"replica {index} | finished at inner step {manager.current_step() * every} | eval loss {final:.4f}",
          flush=True)  # fmt: skip
    manager.shutdown(wait=False)


@dataclass(frozen=True)
class RoundOutcome:
    """What one of DiLoCo's outer rounds did for this replica group, read off torchft's Manager
    (DiLoCo's hook keeps its commit vote to itself).

    Attributes:
        step: torchft's step after the round: the rounds the job has landed.
        participants: the replica groups in the round's quorum.
        landed: the round committed here: torchft's step moved one past where it stood (past
            the peer's, for a group that healed in the round).
        healed: this group took a peer's state in the round (it was behind): its own steps since
            its last landed round were replaced by the peer's.
    """

    step: int
    participants: int
    landed: bool
    healed: bool

    @classmethod
    def read(cls, manager: Manager, before: int, heals: list[int]) -> RoundOutcome:
        """The round just run, given torchft's step ``before`` it and the steps its heals set."""
        step, healed = manager.current_step(), bool(heals)
        return cls(step, manager.num_participants(), step == (heals[-1] if healed else before) + 1, healed)

    def counted(self, steps: int) -> int:
        """This group's inner steps the landed update included, of the ``steps`` it took in the
        round (a dropped round's steps never carry over: DiLoCo puts the global values back)."""
        return steps if self.landed and not self.healed else 0


def _gather(manager: Manager, replicas: int, timeout: float) -> None:
    """A fresh job's start: quorums with no commit (torchft's step stays 0) until one holds every
    replica group, so that no group lands its first round alone and the others heal from it, their
    first steps lost (acco's worker waits for every group in its first round too).

    Raises:
        TimeoutError: not every group came within ``timeout`` seconds.
    """
    given_up = time.monotonic() + timeout
    while True:
        manager.start_quorum()
        if manager.num_participants() >= replicas:
            return
        if time.monotonic() > given_up:
            raise TimeoutError(f"the first round waited {timeout:g}s for {replicas} replica groups; "
                               f"{manager.num_participants()} came")  # fmt: skip
        time.sleep(GATHER_POLL_SECONDS)


def _agreed_stop(manager: Manager, wants: bool) -> bool:
    """Whether any participant of the round just landed wants to stop: the largest of their votes
    (one all-reduce over torchft's process group, which every participant runs after the same
    round); this group's own vote where the all-reduce fails (a peer gone since the commit)."""
    vote = torch.tensor([1.0 if wants else 0.0])
    if not manager.allreduce(vote, reduce_op=ReduceOp.MAX).wait() or manager.errored() is not None:
        return wants
    return bool(vote.item())
