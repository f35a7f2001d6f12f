"""Local steps that survive a lost replica: elastic replica groups on torchft, on one machine.

Starts torchft's lighthouse and ``--replicas`` replica groups (each its own process training
the byte-level GPT of examples/train_gpt.py with ``mode="local"``), restarts a replica group
whose process dies, and exits 0 once every replica has finished (``pip install acco[ft]``):

    python examples/elastic_local.py --replicas 2 --steps 3000 --log-dir runs/elastic

Kill replica 1 while it trains and watch it rejoin (the other keeps training meanwhile):

    kill -9 $(cat runs/elastic/replica-1.pid)

Replica groups of several ranks, FSDP2 (or tensor parallelism, ``--inner tp``) inside each:

    python examples/elastic_local.py --replicas 2 --nproc-per-replica 2 --inner fsdp --steps 3000 --log-dir runs/elastic

The launcher starts each group's ranks with torchrun's variables (a port of their own); when one
of them dies it kills the others and restarts the whole group, whose ranks each heal from the
equal rank of a peer group.

Per replica I, ``DIR/replica-I.pid`` holds the pids of its training processes (whitespace-separated,
rank order; rewritten at each restart), ``DIR/replica-I.jsonl`` one JSON object per outer round (``round``, ``inner_step``,
``participants``, ``loss``: the mean training loss of this replica since its last record,
``dropped``, ``content_heal``, ``counted``: this group's inner steps that the round's landed
update included (0 where it took no part), ``report``: every participant's hand-over (steps,
weights, seconds per step: what speed pacing plans the next round from), ``seconds``, ``time``) and a last one with ``final`` and ``eval_loss``
(the held-out loss of the final global values), ``DIR/replica-I.final`` the sha256 of its final
whole parameters (the same on every replica), ``DIR/replica-I.log`` its output (every rank's).

Across machines, start the lighthouse once (``torchft_lighthouse --min_replicas 1 --bind
[::]:29510``) and one replica group per machine, each with its own ``--replica``:

    python examples/elastic_local.py --replica 0 --replicas 2 --steps 3000 --log-dir runs/elastic \\
        --lighthouse http://lighthouse-host:29510 --hostname this-host

(a group of several ranks there: ``torchrun --nproc-per-node 2 examples/elastic_local.py --replica 0
--nproc-per-replica 2 ...``; docs/elastic.md: what a survivor does while a peer is gone,
``min_replicas``, timeouts).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

NO_PEER_EXIT_CODE = 3  # a restarted group came back to a job with no group left (acco.elastic.NoPeerToHeal)
RESTART_ENV = "ACCO_ELASTIC_START"  # how many times the launcher started this replica group before
SPARE_ENV = "ACCO_ELASTIC_SPARE"  # a process that loads torch, then waits to replace a replica group's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--replicas", type=int, default=2, help="replica groups (the first round waits for all of them)")
    add("--steps", type=int, default=300, help="inner steps per replica (stop_after: the same on every replica)")
    add("--seconds", type=float, default=None, help="stop after this many seconds of training instead (equal time; "
        "the learning-rate schedule then runs over them, --steps its length in steps)")  # fmt: skip
    add("--log-dir", required=True, help="pid, jsonl, final and log files per replica")
    add("--nproc-per-replica", type=int, default=1, help="ranks per replica group (1: one process each; more: "
        "--inner inside the group, the launcher restarting the whole group when one of its ranks dies)")
    add("--inner", choices=["fsdp", "tp"], default="fsdp", help="with --nproc-per-replica above 1: FSDP2 fully_shard "
        "per block, or tensor parallelism of each block's MLP, inside each replica group")  # fmt: skip
    add("--replica", type=int, default=None, help="run only this replica group (across machines); default: launch all")
    add("--lighthouse", default=None, help="torchft lighthouse address (default: start one here)")
    add("--hostname", default=None, help="this machine's address as the other replica groups reach it")
    add("--min-replicas", type=int, default=1, help="replica groups a round needs to land")
    add("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout: how fast a loss is seen")
    add("--join-ms", type=int, default=100, help="the lighthouse's join timeout: the least a round waits for a live "
        "group that has not asked yet (acco's grace window waits longer where the hand-over times spread more)")  # fmt: skip
    add("--grace", default="adaptive", help="how long a round waits for a group of the last round: 'adaptive' "
        "(a few times the measured spread of hand-over times) or seconds; 'lockstep': every live group, every round")  # fmt: skip
    add("--sync-every", type=lambda text: text if text == "auto" else int(text), default=10,
        help="inner steps per outer round, or 'auto': chosen from the link (the library's default)")
    add("--outer-bits", type=int, default=4)
    add("--outer", choices=["default", "plain"], default="default", help="the outer step: acco's default for elastic "
        "groups, or plain averaging (SGD lr 1.0, no momentum: the fixed job's default)")  # fmt: skip
    add("--timeout", type=float, default=10.0, help="seconds a collective or a commit vote waits for a peer")
    add("--quorum-timeout", type=float, default=60.0, help="seconds a round waits for a quorum")
    add("--max-restarts", type=int, default=3, help="restarts per replica group before the launcher gives up")
    add("--warm-spares", action="store_true", help="keep a process per replica group with torch loaded, to replace "
        "one that dies sooner (costs a process's memory and, while it loads, CPU)")  # fmt: skip
    add("--data", default=None, help="a text file or directory (default: Python's stdlib)")
    add("--max-bytes", type=int, default=400_000)
    add("--n-layer", type=int, default=1)
    add("--n-embd", type=int, default=32)
    add("--n-head", type=int, default=2)
    add("--seq-len", type=int, default=32)
    add("--batch-size", type=int, default=4)
    add("--micro-batches", type=int, default=2, help="per inner step")
    add("--lr", type=float, default=3e-3)
    add("--eval-batches", type=int, default=8)
    add("--seed", type=int, default=1337)
    add("--step-seconds", type=float, default=0.0, help="sleep this long per inner step (a slower device)")
    add("--slow", default=None, metavar="I:F", help="replica group I sleeps F times --step-seconds per inner step")
    add("--pacing", choices=["speed", "lockstep"], default="speed", help="inner steps per round: by each group's "
        "measured speed (a slower group takes fewer), or sync_every each")  # fmt: skip
    add("--stall", action="append", default=None, metavar="I:K:T", help="replica group I, at its inner step K, "
        "sleeps T seconds inside its training loop (alive, heartbeating); repeatable")  # fmt: skip
    add("--trainer", choices=["acco", "torchft-diloco"], default="acco", help="what each replica group runs: acco's "
        "elastic local steps, or torchft's own DiLoCo (examples/torchft_diloco.py: the baseline)")  # fmt: skip
    add("--trace", type=int, default=0, metavar="N", help="diagnostics per outer round in the jsonl: the inner lr, the "
        "inner optimizer's step count, the norms of the global values' change and of this group's own progress, and "
        "the global values' held-out loss on N batches; and per rank DIR/trace-I-ROUND-PID.pt (the round's global "
        "values before and after, this rank's hand-over) and DIR/state-I-RANK-roundN-PID.pt (the inner optimizer's "
        "state, this rank's blocks, and the parameters after round N)")  # fmt: skip
    add("--die-in-round", default=None, metavar="I:K", help="testing: replica group I dies (SIGKILL) inside outer "
        "round K, once its quorum formed, while its peers are in the round's collectives")  # fmt: skip
    args = parser.parse_args(argv)
    if args.nproc_per_replica < 1:
        parser.error("--nproc-per-replica >= 1")
    if args.nproc_per_replica > 1 and args.warm_spares:
        parser.error("--warm-spares: replica groups of one process only (a group of several restarts whole)")
    if args.replicas < 1 or args.steps < 1 or not 1 <= args.min_replicas <= args.replicas:
        parser.error("--replicas, --steps >= 1 and 1 <= --min-replicas <= --replicas")
    if args.trainer == "torchft-diloco" and (args.nproc_per_replica > 1 or args.die_in_round or args.warm_spares):
        parser.error("--trainer torchft-diloco: replica groups of one process, without --die-in-round or --warm-spares")
    if args.grace not in ("adaptive", "lockstep"):
        try:
            args.grace = float(args.grace)
        except ValueError:
            parser.error(f"--grace: 'adaptive', 'lockstep' or seconds, not {args.grace!r}")
    try:
        args.stalls = [(int(i), int(k), float(t)) for i, k, t in (spec.split(":") for spec in args.stall or [])]
    except ValueError:
        parser.error(f"--stall: I:K:T (group, inner step, seconds), not {args.stall}")
    if args.grace == "lockstep":  # the lighthouse waits for every live group (torchft's own join timeout)
        args.join_ms = 60_000
    return args


def stalls_at(args: argparse.Namespace, index: int) -> dict[int, float]:
    """``--stall``'s seconds to sleep, by inner step, for replica group ``index``."""
    return {k: t for i, k, t in args.stalls if i == index}


def lr_factor(args: argparse.Namespace, schedule, num_updates: int, started_at: float) -> float:  # type: ignore[no-untyped-def]
    """The schedule's factor now: by inner steps, or (``--seconds``) by the training time spent."""
    if args.seconds is None:
        return schedule(num_updates)
    return schedule(min(args.steps, int(args.steps * (time.perf_counter() - started_at) / args.seconds)))


# ------------------------------------------------------------------------- a replica group


def replica_main(args: argparse.Namespace) -> None:
    # Imported here: the launcher starts the replica groups without waiting for torch to load.
    import torch

    from acco import AccoOptimizer, default_outer
    from acco.elastic import NoPeerToHeal, TorchFT
    from train_gpt import GPT, GPTConfig, WarmupCosine, eval_batches, evaluate, load_corpus, loss_fn, param_groups, \
        sample_batch, split_corpus  # fmt: skip

    class DiesInRound(TorchFT):
        """Fault injection for tests: SIGKILL once the quorum of round ``die_in_round`` formed."""

        die_in_round: int | None = None

        def start_round(self):  # type: ignore[no-untyped-def]
            quorum = super().start_round()
            if self.die_in_round is not None and quorum.step >= self.die_in_round:
                os.kill(os.getpid(), signal.SIGKILL)
            return quorum

    directory, index = Path(args.log_dir), args.replica
    directory.mkdir(parents=True, exist_ok=True)
    ranks = args.nproc_per_replica  # a group of several: the launcher set torchrun's variables, and writes the pids
    rank = int(os.environ.get("RANK", "0")) if ranks > 1 else 0
    writes = rank == 0  # the group's records, final digest and output
    if os.environ.get(SPARE_ENV):  # a warm spare: torch is loaded; the launcher says when to take over
        line = sys.stdin.readline()
        if not line:
            return
        os.environ[RESTART_ENV] = line.strip()
        print(f"replica {index} | a warm spare takes over", flush=True)
    if ranks == 1:
        (directory / f"replica-{index}.pid").write_text(str(os.getpid()))
    started = int(os.environ.get(RESTART_ENV, "0"))
    torch.set_num_threads(1)
    group = None  # acco's own group: this process alone
    if ranks > 1:
        import types

        import torch.distributed as dist
        from train_gpt import shard_inside

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.quorum_timeout + 60))
    corpus = load_corpus(args.data, args.max_bytes)
    train_data, held_out = split_corpus(corpus, args.seq_len)
    eval_set = eval_batches(held_out, args.eval_batches, args.batch_size, args.seq_len, args.seed, torch.device("cpu"))
    torch.manual_seed(args.seed)  # every replica group the same initial model (a fresh job's first round checks)
    model = GPT(GPTConfig(args.n_layer, args.n_embd, args.n_head, args.seq_len))
    if ranks > 1:  # FSDP2 or TP inside the group, over a mesh whose replicate dimension is this rank alone
        group = shard_inside(model, (1, ranks), args.inner, types.SimpleNamespace(world_size=ranks, device=torch.device("cpu")))
    # A fresh job's first round waits for every replica group; a restarted one joins whoever is training.
    membership = DiesInRound.connect(
        f"replica-{index}", lighthouse=args.lighthouse, min_replicas=args.min_replicas,
        start_with=args.replicas if started == 0 else 1, must_heal=started > 0,
        timeout=datetime.timedelta(seconds=args.timeout),
        quorum_timeout=datetime.timedelta(seconds=args.quorum_timeout), hostname=args.hostname,
        grace=0.0 if args.grace == "lockstep" else args.grace,
    )  # fmt: skip
    if args.die_in_round is not None and started == 0:
        victim, round_ = (int(n) for n in args.die_in_round.split(":"))
        membership.die_in_round = round_ if victim == index else None
    # The first round runs here: a restarted replica group takes the global values, the inner
    # optimizer's state and the step count from a peer.
    try:
        opt = AccoOptimizer(
            param_groups(model, weight_decay=0.1), torch.optim.AdamW, module=model, mode="local",
            process_group=group, membership=membership, sync_every=args.sync_every, sync_delay=0, pacing=args.pacing,
            outer_bits=args.outer_bits, lr=args.lr, betas=(0.9, 0.95), max_grad_norm=1.0,
            outer_optimizer=default_outer(args.sync_every) if args.outer == "plain" else None,
            timeout=datetime.timedelta(seconds=args.quorum_timeout + 60),
        )  # fmt: skip
    except Exception as error:
        if not _caused_by(error, NoPeerToHeal):
            raise
        # Restarted after every other group had ended: if one finished, the job's result is its.
        print(f"replica {index} | came back to a job with no group left: {error}", flush=True)
        membership.close()
        sys.exit(NO_PEER_EXIT_CODE)
    data_rank = rank if args.inner == "fsdp" else 0  # tensor parallelism: a group's ranks share their batches
    generator = torch.Generator().manual_seed(args.seed + 1000 * index + 1_000_000 * started + 100 * data_rank)
    step_seconds = args.step_seconds
    if args.slow is not None and int(args.slow.split(":")[0]) == index:
        step_seconds *= float(args.slow.split(":")[1])
    schedule = WarmupCosine(20, args.steps)
    log = open(directory / f"replica-{index}.jsonl", "a") if writes else open(os.devnull, "w")
    clock, seen, losses = time.perf_counter(), 0, []

    def record_rounds() -> None:
        """One JSON object per outer round this replica ran since the last call."""
        nonlocal seen, losses
        for stats in [s for s in opt.round_stats if s.index >= seen]:
            seen = stats.index + 1
            entry = {"round": opt.outer_rounds, "inner_step": opt.num_updates, "participants": stats.participants,
                     "dropped": stats.dropped, "content_heal": stats.content_heal, "counted": stats.counted, "spread": stats.spread,
                     "steps": None if stats.replicas is None else list(stats.replicas.steps), "loss": sum(losses) / len(losses) if losses else None,
                     "seconds": round(time.perf_counter() - clock, 3), "time": time.time(), "pid": os.getpid(),
                     "bytes": stats.collective_bytes,
                     "report": None if stats.replicas is None else stats.replicas.as_dict()}  # fmt: skip
            if args.trace:
                entry.update(trace(stats))
            log.write(json.dumps(entry) + "\n")
            log.flush()
            losses = []
            if not writes:
                continue
            print(f"replica {index} | round {entry['round']:4d} | inner step {entry['inner_step']:5d} | "
                  f"{entry['participants']} replica group(s)" + (" | dropped" if stats.dropped else "")
                  + ("" if entry["loss"] is None else f" | loss {entry['loss']:.4f}"), flush=True)

    # --trace: diagnostics (they reach into the optimizer's loop: not an API to copy).
    trace_set = eval_set[: args.trace]

    def whole_params() -> list:  # type: ignore[type-arg]
        """The whole parameters (a DTensor gathered: collective in the group, every rank calls it)."""
        return [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]

    anchor = [p.clone() for p in whole_params()] if args.trace else []  # the global values changes are measured from
    before_step = [p.clone() for p in anchor]

    def trace(stats) -> dict:  # type: ignore[no-untyped-def]
        """What a round did, measured on this group's own copy (blocking rounds: the parameters
        are the global values right after one)."""
        now = whole_params()
        norm = lambda pairs: float(sum(((a - b).double() ** 2).sum() for a, b in pairs) ** 0.5)  # noqa: E731
        state = [s for inner in opt.inner_optimizers for s in inner.state.values() if "step" in s]
        out = {"lr": opt.param_groups[0]["lr"], "adam_step": float(state[0]["step"]) if state else None,
               "update_norm": norm(zip(now, anchor)), "own_norm": norm(zip(before_step, anchor)),
               "global_loss": evaluate(model, trace_set)}
        if handed:  # the exact hand-over, for an offline check of the round's arithmetic
            torch.save({"before": handed.pop("before"), "handed": handed.pop("params"), "weight": handed.pop("weight"),
                        "after": [v.clone() for v in opt._loop.global_values]}, directory / f"trace-{index}-{stats.index}-{os.getpid()}.pt")
        adam = [{k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in entry.items()}
                for inner in opt.inner_optimizers for entry in inner.state.values()]
        torch.save({"inner_state": adam, "params": [p.clone() for p in now], "lr": opt.param_groups[0]["lr"],
                    "num_updates": opt.num_updates},
                   directory / f"state-{index}-{rank}-round{opt.outer_rounds}-{os.getpid()}.pt")
        for a, p in zip(anchor, now):
            a.copy_(p)
        return out

    handed: dict = {}
    if args.trace:
        lane_run = opt._loop.lane_work.run

        def run_and_keep(round_):  # type: ignore[no-untyped-def]
            handed["params"] = [p.detach().clone() for p in round_.params]
            handed["weight"] = round_.hand_over.weight
            handed["before"] = [v.clone() for v in opt._loop.global_values]
            return lane_run(round_)

        opt._loop.lane_work.run = run_and_keep

    if writes:
        print(f"replica {index} | joined at round {opt.outer_rounds}, inner step {opt.num_updates}", flush=True)
    record_rounds()
    opt.stop_after(steps=None if args.seconds else args.steps, seconds=args.seconds)
    stalls = stalls_at(args, index) if started == 0 else {}
    started_at = time.perf_counter()
    while not opt.should_stop:
        for group in opt.param_groups:  # the schedule follows the step count (a healed replica takes its peers')
            group["lr"] = args.lr * lr_factor(args, schedule, opt.num_updates, started_at)
        if opt.num_updates in stalls:  # --stall: busy elsewhere (an evaluation, a checkpoint), still heartbeating
            time.sleep(stalls.pop(opt.num_updates))
        for _ in range(args.micro_batches):
            x, y = sample_batch(train_data, args.batch_size, args.seq_len, generator)
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.accumulate()
            losses.append(loss.item())
        if step_seconds:
            time.sleep(step_seconds)
        if args.trace:
            for saved, p in zip(before_step, whole_params()):
                saved.copy_(p)
        opt.step()
        record_rounds()
    opt.finish()
    record_rounds()
    final = evaluate(model, eval_set)
    digest = hashlib.sha256()
    for value in model.state_dict().values():  # whole parameters (a DTensor gathered: collective in the group)
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    buffers = {key: sum(entry[key] for entry in opt.buffer_bytes()) for key in opt.buffer_bytes()[0]}
    log.write(json.dumps({"final": True, "eval_loss": final, "inner_step": opt.num_updates, "round": opt.outer_rounds,
                          "buffer_bytes": buffers}) + "\n")  # fmt: skip
    log.close()
    if writes:
        (directory / f"replica-{index}.final").write_text(digest.hexdigest())
        print(f"replica {index} | finished at inner step {opt.num_updates} | eval loss {final:.4f}", flush=True)
    membership.close()
    if ranks > 1:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ launcher


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """The lighthouse and every replica group on this machine; a replica group whose process
    dies is started again (it rejoins and heals from a peer)."""
    directory = Path(args.log_dir)
    directory.mkdir(parents=True, exist_ok=True)
    lighthouse = None
    address = args.lighthouse
    if address is None:  # a free port now; the lighthouse binds it while the replica groups load torch
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::", 0))
            port = probe.getsockname()[1]
        address = f"http://{socket.gethostname()}:{port}"
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn"), "OMP_NUM_THREADS": "1"}

    def start(index: int, count: int | None) -> Group:
        """Replica group ``index``'s processes (``count``: its start; None: a warm spare that waits):
        one, or ``--nproc-per-replica`` with torchrun's variables and a fresh port for their
        process group; their pids in ``replica-I.pid``."""
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--replica", str(index), "--lighthouse", address]
        output = open(directory / f"replica-{index}.log", "a")
        extra = {SPARE_ENV: "1"} if count is None else {RESTART_ENV: str(count)}
        ranks = args.nproc_per_replica
        if ranks == 1:
            return Group([subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env={**env, **extra},
                                           stdin=subprocess.PIPE if count is None else None)])  # fmt: skip
        port = str(_free_port())
        group = Group([subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env={
            **env, **extra, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for rank in range(ranks)])  # fmt: skip
        (directory / f"replica-{index}.pid").write_text(" ".join(str(p.pid) for p in group.processes))
        return group

    def restart(index: int, count: int) -> Group:
        """The warm spare takes over (torch already loaded: the rejoin is not a cold start), and a new
        spare starts loading."""
        spare = spares.pop(index, None)
        if spare is None or spare.poll() is not None:
            return start(index, count)
        process = spare.processes[0]
        process.stdin.write(f"{count}\n".encode())
        process.stdin.close()
        spares[index] = start(index, None)
        return spare

    for index in range(args.replicas):
        (directory / f"replica-{index}.final").unlink(missing_ok=True)
    starts = {index: 0 for index in range(args.replicas)}
    running = {index: start(index, 0) for index in range(args.replicas)}
    spares: dict[int, Group] = {}
    launched = time.time()

    def training(index: int) -> bool:
        records = directory / f"replica-{index}.jsonl"
        return records.exists() and records.stat().st_mtime >= launched
    if args.lighthouse is None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum at INFO
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind=f"[::]:{port}", min_replicas=args.min_replicas, join_timeout_ms=args.join_ms,
                                      quorum_tick_ms=50, heartbeat_timeout_ms=args.heartbeat_ms)  # fmt: skip
    finished: set[int] = set()
    came_back: set[int] = set()
    shown = 0.0
    try:
        while running:
            for index, process in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                del running[index]
                if code == 0 and (directory / f"replica-{index}.final").exists():
                    finished.add(index)
                    print(f"replica {index} finished", flush=True)
                elif code == NO_PEER_EXIT_CODE and finished:
                    # It came back after the others had ended: the job's result is theirs.
                    came_back.add(index)
                    print(f"replica {index} came back to a finished job: the result is the others'", flush=True)
                elif starts[index] < args.max_restarts:
                    starts[index] += 1
                    # A group that died before it joined the job (e.g. its port taken meanwhile)
                    # starts as new again: only a group that trained must heal from a peer.
                    joined = training(index)
                    print(f"replica {index} died (exit code {code}): restart {starts[index]}"
                          + (" (all its ranks)" if args.nproc_per_replica > 1 else "")
                          + ("" if joined else ", as new (it had not joined the job)"), flush=True)
                    running[index] = restart(index, starts[index] if joined else 0)
                else:
                    print(f"replica {index} died (exit code {code}) and is not restarted", flush=True)
            if args.warm_spares and not spares and running and all(training(index) for index in running):
                # Warm spares load torch once the replica groups train (not during their own start-up).
                spares.update({index: start(index, None) for index in running})
            if time.monotonic() - shown > 2.0 and running:
                shown = time.monotonic()
                for index in sorted(running):
                    last = _last_record(directory / f"replica-{index}.jsonl")
                    if last is not None:
                        print(f"replica {index} | round {last.get('round')} | inner step {last.get('inner_step')} | "
                              f"{last.get('participants')} replica group(s)", flush=True)  # fmt: skip
            time.sleep(0.1)
    finally:
        for group in [*running.values(), *spares.values()]:
            group.kill()
        if lighthouse is not None:
            lighthouse.shutdown()
    return 0 if finished and len(finished | came_back) == args.replicas else 1


class Group:
    """A replica group's processes, as the launcher watches them: the group is running while
    every process is; once one ends, the group's exit code is the first non-zero one (the
    others are killed: a group of several restarts whole) or 0 once all ended with 0."""

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        self.processes = processes

    def poll(self) -> int | None:
        codes = [process.poll() for process in self.processes]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            self.kill()
            return failed[0]
        return None if None in codes else 0

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _caused_by(error: BaseException | None, kind: type) -> bool:
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__ or error.__context__
    return False


def _last_record(path: Path) -> dict | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return json.loads(lines[-1]) if lines else None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replica is None:
        sys.exit(launch(args, argv))
    if args.trainer == "torchft-diloco":
        from torchft_diloco import replica_main as diloco_main

        diloco_main(args)
        return
    replica_main(args)


if __name__ == "__main__":
    main()
