"""Elastic replica groups of several ranks: 2 groups of 2 gloo processes each, FSDP2 or tensor
parallelism inside, torchft's quorum across (an in-process lighthouse).

- Without failures the elastic rounds are the fixed 2 x 2 mesh's (``mesh=("replicate", "shard")``,
  acco across ``replicate``) at the same schedule: the same final parameters within 1e-5.
- A rank of one group killed (SIGKILL) at a random point: examples/elastic_local.py restarts its
  whole group, which heals each rank's own blocks from the equal rank of the other group; every
  group ends with the same global values (tests/test_elastic.py has the one-rank form's ten runs;
  benchmarks/elastic_stress.py ``--nproc-per-replica 2`` has ten of these).
"""

from __future__ import annotations

import datetime
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")

from acco import AccoOptimizer, default_outer  # noqa: E402
from tests.helpers import assert_params_close, assert_params_equal  # noqa: E402
from tests.ranks import free_port, run_fresh  # noqa: E402
from tests.reference import OPTIMIZERS, loss_fn  # noqa: E402
from tests.test_elastic import with_lighthouse  # noqa: E402
from tests.test_mesh import S, build, data_of, full_params  # noqa: E402

pytestmark = pytest.mark.timeout(240)

STEPS, H, MAX_NORM = 9, 3, 0.5


def train(inner: str, membership=None, checkpoint: tuple[str, str, int] | None = None) -> dict:  # type: ignore[no-untyped-def]
    """One rank of a 2 x 2 layout: acco across replica groups (``membership``: torchft's, each
    group its own job with ``replicate`` of size 1; None: the fixed mesh's 2 replicas), ``inner``
    inside; replica g's rank r feeds mesh rank g * S + r's micro-batches. ``checkpoint``:
    ``("save", dir, k)``: stop after inner step k with a checkpoint of each group in
    ``dir/group-g`` (acco.checkpoint, no finish()); ``("resume", dir, k)``: start from it."""
    from acco import checkpoint as acco_checkpoint

    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    elastic = membership is not None
    shape = (1, S) if elastic else (2, S)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = build(inner, mesh)
    cls, hp = OPTIMIZERS["adamw"]
    opt = AccoOptimizer(model, cls, process_group=mesh["replicate"].get_group(), mode="local", membership=membership,
                        sync_every=H, sync_delay=0, pacing="lockstep", max_grad_norm=MAX_NORM,
                        outer_optimizer=default_outer(H, elastic=True),  # the same for the fixed mesh
                        timeout=datetime.timedelta(seconds=90), **hp)  # fmt: skip
    rank = int(os.environ["ACCO_TEST_GROUP"]) * S + dist.get_rank() if elastic else dist.get_rank()
    action, directory, first = checkpoint or (None, None, 0)
    where = None if directory is None else f"{directory}/group-{os.environ.get('ACCO_TEST_GROUP')}"
    if action == "resume":
        acco_checkpoint.load(where, opt, model)
    for t in range(first if action == "resume" else 0, first if action == "save" else STEPS):
        for i in range(2):
            x, y, _ = data_of(inner, t, rank, i, False)
            loss_fn(model, x, y).backward()
            opt.accumulate()
        opt.step()
    if action == "save":
        acco_checkpoint.save(where, opt, model)
        opt.close()
    else:
        opt.finish()
    rounds = [(s.participants, s.dropped) for s in opt.round_stats]
    return {"params": full_params(model), "rounds": rounds, "outer_rounds": opt.outer_rounds}


def elastic_rank(inner: str, address: str, group: int, port: int, rank: int, results, checkpoint=None) -> None:  # type: ignore[no-untyped-def]
    """Rank ``rank`` of replica group ``group``: the group's own process group (its own port, as
    its own torchrun job would have), torchft's membership across groups."""
    from acco.elastic import TorchFT

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(S), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "ACCO_TEST_GROUP": str(group)})  # fmt: skip
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        membership = TorchFT.connect(f"group-{group}", lighthouse=address, start_with=2, hostname="localhost",
                                     timeout=datetime.timedelta(seconds=10),
                                     quorum_timeout=datetime.timedelta(seconds=60))  # fmt: skip
        out = train(inner, membership, checkpoint)
        results.put((group, rank, {k: (v.numpy().tobytes(), tuple(v.shape)) for k, v in out["params"].items()},
                     out["rounds"]))  # fmt: skip
        membership.close()
        dist.destroy_process_group()
    except BaseException as error:  # the test reports it
        results.put((group, rank, repr(error), None))
        raise


def run_elastic(inner: str, checkpoint: tuple[str, str, int] | None = None) -> dict[tuple[int, int], tuple]:
    """2 replica groups of S ranks, each group with its own process group: (group, rank) ->
    (whole parameters, rounds)."""
    ports = [free_port() for _ in range(2)]
    runs = [lambda address, results, g=g, r=r: (elastic_rank, (inner, address, g, ports[g], r, results, checkpoint))
            for g in range(2) for r in range(S)]  # fmt: skip
    outcome = {(g, r): rest for g, r, *rest in with_lighthouse(runs, timeout=200)}
    for key, (params, _) in outcome.items():
        assert not isinstance(params, str), (key, params)
    return {key: ({k: torch.frombuffer(bytearray(b), dtype=torch.float32).reshape(shape) for k, (b, shape) in p.items()},
                  rounds) for key, (p, rounds) in outcome.items()}  # fmt: skip


@pytest.mark.parametrize("inner", ["fsdp", "tp"])
def test_elastic_groups_of_two_ranks_are_the_fixed_mesh_recurrence(inner) -> None:
    """Elastic rounds with 2 groups of 2 ranks equal the fixed 2 x 2 mesh's at the same schedule
    (4-bit legs, error feedback, AdamW inside, SGD-Nesterov outside) within 1e-5; every rank of
    every group ends with the same whole parameters."""
    with ThreadPoolExecutor(max_workers=1) as pool:  # the fixed mesh's job beside the elastic one
        fixed_run = pool.submit(run_fresh, train, inner, world_size=4, timeout=200)
        elastic = run_elastic(inner)
        fixed = fixed_run.result()
    for key, (params, rounds) in elastic.items():
        joined = next(n for n, (participants, dropped) in enumerate(rounds) if participants == 2 and not dropped)
        assert all(participants == 2 and not dropped for participants, dropped in rounds[joined:]), (key, rounds)
        assert len(rounds) - joined == 1 + STEPS // H + 1, (key, rounds)  # the join, a round per H steps, finish()
        assert_params_equal(params, elastic[(0, 0)][0])
        assert_params_close(params, fixed[0]["params"], rtol=0, atol=1e-5)


def test_an_elastic_job_of_groups_of_two_ranks_resumes_from_its_checkpoints_bit_for_bit(tmp_path) -> None:
    """2 groups of 2 ranks (FSDP2 inside) stopped after inner step 4 with a checkpoint of each
    group (acco.checkpoint: DCP, each rank its blocks), resumed by new processes with a new
    lighthouse: every rank ends bit for bit where the uninterrupted run does."""
    with ThreadPoolExecutor(max_workers=2) as pool:  # both jobs at once
        uninterrupted, _ = pool.map(lambda checkpoint: run_elastic("fsdp", checkpoint), [None, ("save", str(tmp_path), 4)])
    resumed = run_elastic("fsdp", ("resume", str(tmp_path), 4))
    for key, (params, _) in resumed.items():
        assert_params_equal(params, uninterrupted[key][0])


MESH_STEPS, MESH_EVERY = 150, 10
MESH_RUN = ["--nproc-per-replica", "2", "--inner", "fsdp", "--steps", str(MESH_STEPS), "--step-seconds", "0.02",
            "--sync-every", str(MESH_EVERY)]  # after test_elastic.RUN: later options win  # fmt: skip
# The job's time limit, from what it does rather than from how fast one machine did it: an
# allowance per process the launcher starts (loading torch, the corpus, the model and its FSDP2
# layout, joining the job: about 8 s each where four start at once on 2 cores) and per outer
# round (about 1 s), each about four times what it took on 2 cores shared with two CPU-bound
# processes and a benchmark. The job: both groups' ranks, then group 1's restarted ones; the
# join, a round every MESH_EVERY inner steps and finish()'s.
PROCESS_START_S, ROUND_S = 30.0, 5.0
MESH_PROCESSES = 2 * 2 + 2
MESH_ROUNDS = 1 + MESH_STEPS // MESH_EVERY + 1
MESH_LIMIT_S = MESH_PROCESSES * PROCESS_START_S + MESH_ROUNDS * ROUND_S


def wait_for_job(process, directory, limit: float) -> None:  # type: ignore[no-untyped-def]
    """The launcher's exit within ``limit`` seconds (then its process group is killed), 0, with
    its output and every group's log in the failure."""
    import signal
    import subprocess

    try:
        process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = directory.with_suffix(".out").read_text()
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(directory.glob("replica-*.log")))
    assert process.returncode == 0, f"exit {process.returncode} (limit {limit:.0f} s)\n" + output[-3000:] + logs


@pytest.mark.timeout(MESH_LIMIT_S + 60)
def test_a_killed_rank_restarts_its_group_which_heals_while_the_other_trains(tmp_path) -> None:
    """examples/elastic_local.py, 2 groups of 2 ranks (FSDP2 inside), a random rank of group 1
    killed (SIGKILL) a few rounds in; asserted by round counts, within a time limit that scales
    with the job (MESH_LIMIT_S): the launcher restarts group 1 whole and exits 0; group 0 never
    stopped (its landed rounds numbered in turn, every one of its inner steps counted in one) and
    landed rounds alone meanwhile; group 1's new ranks healed at an outer round R (their first
    round: group 0's too, with both groups, at group 0's inner step count) and from R on landed
    every round group 0 landed, with both groups; both end at the same round, at the step
    budget, with the same whole parameters. (Ten such runs, each against an uninterrupted run's
    held-out loss: benchmarks/elastic_stress.py ``--scenarios rank-kill``.)"""
    import json
    import random
    import signal
    import threading
    import time

    from tests.test_elastic import launch, records

    seed = random.randrange(1 << 16)
    rng = random.Random(seed)
    directory = tmp_path / "run"
    process = launch(directory, *MESH_RUN)
    killed: list[int] = []

    def landed_by_group_1() -> int:
        """Group 1's rounds landed so far (not a fresh job's join tries), whole lines only."""
        path = directory / "replica-1.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []  # (the last one may be half written)
        return sum(1 for line in lines if not json.loads(line)["dropped"])

    def kill() -> None:
        while landed_by_group_1() < 3:  # a few rounds in (the job's own limit bounds the wait)
            if process.poll() is not None:
                return
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))
        pids = (directory / "replica-1.pid").read_text().split()
        killed.append(rng.randrange(len(pids)))
        os.kill(int(pids[killed[0]]), signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    wait_for_job(process, directory, MESH_LIMIT_S)
    killer.join(timeout=5)
    assert killed, f"seed {seed}: the run ended before the kill"
    survivor, restarted = records(directory, 0), records(directory, 1)
    assert (directory / "replica-0.final").read_text() == (directory / "replica-1.final").read_text(), seed
    assert survivor[-1]["final"] and restarted[-1]["final"], seed
    # Group 0 never stopped: its landed rounds numbered in turn from the join, every one of its
    # inner steps counted in one of them (a round dropped as the kill hit is carried by the next).
    landed = [r for r in survivor[:-1] if not r["dropped"]]
    assert [r["round"] for r in landed] == list(range(1, len(landed) + 1)), (seed, landed)
    assert sum(r["counted"] for r in landed) == MESH_STEPS, (seed, landed)
    assert any(r["participants"] == 1 and r["counted"] > 0 for r in landed), (seed, "group 0 never trained alone")
    # Group 1 restarted once, whole; its new ranks' first round R healed them (a new process starts at
    # inner step 0: there it holds group 0's count), and from R on both groups landed the same rounds.
    pids = [r["pid"] for r in restarted[:-1]]
    assert len(set(pids)) == 2, (seed, "group 1 was not restarted", pids)
    back = [r for r in restarted[:-1] if r["pid"] == pids[-1] and not r["dropped"]]
    before = [r["round"] for r in restarted[:-1] if r["pid"] == pids[0] and not r["dropped"]]
    assert back and before, (seed, restarted)
    heal = back[0]["round"]
    by_round = {r["round"]: r for r in landed}
    assert heal > max(before) and heal in by_round, (seed, before, back, landed)
    assert back[0]["inner_step"] == by_round[heal]["inner_step"] > 0, (seed, back[0], by_round[heal])
    assert [r["round"] for r in back] == [r["round"] for r in landed if r["round"] >= heal], (seed, back, landed)
    assert all(r["participants"] == 2 for r in back + [by_round[r["round"]] for r in back]), (seed, back)
    # Both end at the round they agreed on, at the step budget, with the same values.
    assert survivor[-1]["round"] == restarted[-1]["round"] == landed[-1]["round"], (seed, survivor[-1], restarted[-1])
    assert survivor[-1]["inner_step"] == restarted[-1]["inner_step"] == MESH_STEPS, (seed, survivor[-1], restarted[-1])
    assert survivor[-1]["eval_loss"] == restarted[-1]["eval_loss"], seed
