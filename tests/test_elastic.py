"""Elastic replicas on torchft (acco.elastic): replica groups of one process each, an in-process
lighthouse, outer rounds over torchft's gloo process group.

- Without failures the rounds are mode="local"'s recurrence at 4 bits (tests/reference.py).
- The fault test: examples/elastic_local.py with 2 replica groups, one killed (SIGKILL) at a random
  point of its inner steps, or inside a round once its quorum formed (its peer in the round's
  collectives); the survivor keeps taking inner steps alone, the killed one is restarted, heals
  from the survivor and trains again; every replica ends at the same global values and the
  held-out loss within 2% of an uninterrupted run at the survivor's inner steps. 10 runs.
- A group that missed a round the others landed (the same step count, other global values)
  takes their global values at its next round (a heal by content).
- An elastic job stopped with every group's checkpoint resumes bit for bit.
- Speed pacing: beside a group 3 times slower the fast one keeps its rate.
Under pauses, CPU hogs and near-end kills: benchmarks/elastic_stress.py.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from acco import AccoOptimizer, default_outer  # noqa: E402
from tests.helpers import assert_params_close  # noqa: E402
from tests.ranks import fork_server  # noqa: E402
from tests.reference import OPTIMIZERS, local_reference, make_model, params_of  # noqa: E402
from acco.options import AUTO_EVERY_BOUNDS  # noqa: E402
from tests.test_auto_every import assert_planned, every_history  # noqa: E402
from tests.test_replicas import speed_plans  # noqa: E402
from tests.test_local import H, MAX_NORM, inner_step, step_data  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from elastic_stress import alone_share, expected_loss  # noqa: E402

pytestmark = pytest.mark.timeout(180)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elastic_local.py"


def lighthouse():
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=50,
                            heartbeat_timeout_ms=1000)  # fmt: skip


def replica_rank(index: int, address: str, steps: int, results, fail_at: int | None = None,  # type: ignore[no-untyped-def]
                 miss_at: int | None = None, checkpoint: tuple[str, str, int] | None = None,
                 options: dict | None = None) -> None:
    """One replica group of one process: mode="local" with torchft's membership; ``fail_at``:
    replica 1's legs of that round (torchft's step) report a failure, as a local error would;
    ``miss_at``: replica 1 drops that round after torchft committed it everywhere (as a group
    the others landed a round without would be: the same step count, other global values);
    ``checkpoint``: ``("save", dir, k)``: stop after inner step k with a checkpoint of this group
    in ``dir/replica-I`` (acco.checkpoint, no finish()); ``("resume", dir, k)``: start from it;
    ``options``: further ``AccoOptimizer`` arguments."""
    from acco import checkpoint as acco_checkpoint
    from acco.elastic import TorchFT

    class FailsOnce(TorchFT):
        failed = False

        def agree(self, quorum, succeeded, *args):  # type: ignore[no-untyped-def]
            fails = index == 1 and quorum.step == fail_at and not self.failed
            self.failed = self.failed or fails
            committed = super().agree(quorum, succeeded and not fails, *args)
            return committed and not (index == 1 and quorum.step == miss_at)

    torch.set_num_threads(1)
    try:
        membership = FailsOnce.connect(f"replica-{index}", lighthouse=address, start_with=2, hostname="localhost",
                                       timeout=datetime.timedelta(seconds=10),
                                       quorum_timeout=datetime.timedelta(seconds=60))  # fmt: skip
        model = make_model()
        cls, hp = OPTIMIZERS["adamw"]
        opt = AccoOptimizer(model, cls, mode="local", membership=membership, sync_every=H, sync_delay=0,
                            pacing="lockstep", max_grad_norm=MAX_NORM, timeout=datetime.timedelta(seconds=90),
                            **(options or {}), **hp)  # fmt: skip
        action, directory, first = checkpoint or (None, None, 0)
        if action == "resume":
            acco_checkpoint.load(Path(directory) / f"replica-{index}", opt, model)
        for t in range(first if action == "resume" else 0, first if action == "save" else steps):
            inner_step(opt, model, t, index, weighted=False)
        if action == "save":
            acco_checkpoint.save(Path(directory) / f"replica-{index}", opt, model)
            opt.close()
        else:
            opt.finish()
        rounds = [(s.participants, s.dropped, s.content_heal) for s in opt.round_stats]
        # Plain bytes: a tensor sent through a queue lives in this process's shared memory, gone once it exits.
        results.put((index, {k: (v.numpy().tobytes(), tuple(v.shape)) for k, v in params_of(model).items()},
                     rounds, opt.outer_rounds))
        membership.close()
    except BaseException as error:  # the test reports it
        results.put((index, repr(error), None, None))
        raise


def run_replicas(steps: int, fail_at: int | None = None, miss_at: int | None = None,
                 checkpoint: tuple[str, str, int] | None = None, options: dict | None = None) -> list[tuple]:
    """Both replica groups in processes of their own, an in-process lighthouse: each one's
    (parameters, [(participants, dropped)] per round, outer rounds)."""
    runs = [lambda address, results, i=i: (replica_rank, (i, address, steps, results, fail_at, miss_at, checkpoint,
                                                          options))
            for i in range(2)]  # fmt: skip
    outcome = dict((r[0], r[1:]) for r in with_lighthouse(runs, timeout=150))
    for index in range(2):
        assert not isinstance(outcome[index][0], str), outcome[index][0]
    return [({k: torch.frombuffer(bytearray(b), dtype=torch.float32).reshape(shape) for k, (b, shape) in p.items()},
             after_join(rounds), count) for p, rounds, count in (outcome[0], outcome[1])]


def with_lighthouse(runs: list, timeout: float) -> list:
    """One process per entry of ``runs`` (each gives ``(target, args)`` from the lighthouse's
    address and the results queue) beside an in-process lighthouse; what they put, one each."""
    server = lighthouse()
    context = fork_server()  # new processes that skip the seconds of importing torch
    results = context.Queue()
    processes = [context.Process(target=target, args=args)
                 for target, args in (run(server.address(), results) for run in runs)]  # fmt: skip
    try:
        for process in processes:
            process.start()
        return [results.get(timeout=timeout) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=20)
            if process.is_alive():
                process.kill()
        server.shutdown()


def after_join(rounds: list[tuple]) -> list[tuple]:
    """A group's rounds from its first with both groups: a group that started first runs its
    join round again until the other is there (start_with=2; each try is dropped)."""
    first = next(n for n, (participants, dropped, _) in enumerate(rounds) if participants == 2 and not dropped)
    assert all(dropped and participants == 1 for participants, dropped, _ in rounds[:first]), rounds
    return rounds[first:]


def test_rounds_without_failures_are_the_local_recurrence_at_4_bits() -> None:
    """Two replica groups, no failure: every round has both; the parameters are mode="local"'s
    recurrence (lockstep, blocking, 4 bits with error feedback, token weights), identical on both."""
    steps = 7
    (params0, rounds0, count0), (params1, _, _) = run_replicas(steps)
    assert all(p == 2 and not dropped and not healed for p, dropped, healed in rounds0), rounds0
    assert count0 == 1 + steps // H + 1  # the first (joining) round, one per sync_every, finish()'s last
    for name in params0:
        assert torch.equal(params0[name], params1[name]), name
    data = [[step_data(t, m) for m in range(2)] for t in range(steps)]
    expected = local_reference(params_of(make_model()), "adamw", data, sync_every=H, sync_delay=0, max_norm=MAX_NORM,
                               outer_bits=4, outer=default_outer(H, elastic=True))[0]  # the elastic default  # fmt: skip
    assert_params_close(params0, expected, rtol=1e-5, atol=1e-6)


def test_sparse_rounds_without_failures_are_the_local_recurrence() -> None:
    """The same with sparse rounds (``outer_topk=0.25`` at 2 bits): both legs of each elastic
    round are the fixed group's sparse legs among the groups present."""
    steps, sparse = 7, {"outer_topk": 0.25, "outer_bits": 2}
    (params0, rounds0, _), (params1, _, _) = run_replicas(steps, options=sparse)
    assert all(p == 2 and not dropped and not healed for p, dropped, healed in rounds0), rounds0
    for name in params0:
        assert torch.equal(params0[name], params1[name]), name
    data = [[step_data(t, m) for m in range(2)] for t in range(steps)]
    expected = local_reference(params_of(make_model()), "adamw", data, sync_every=H, sync_delay=0, max_norm=MAX_NORM,
                               outer_bits=2, outer_topk=0.25, outer=default_outer(H, elastic=True))[0]  # fmt: skip
    dense = local_reference(params_of(make_model()), "adamw", data, sync_every=H, sync_delay=0, max_norm=MAX_NORM,
                            outer_bits=4, outer=default_outer(H, elastic=True))[0]  # fmt: skip
    assert_params_close(params0, expected, rtol=1e-5, atol=1e-6)
    assert max((expected[k] - dense[k]).abs().max() for k in expected) > 1e-4  # not the dense round


def test_a_round_one_participant_failed_lands_nowhere() -> None:
    """Replica 1's legs of round 2 fail (both alive): the agreement drops the round on both, each
    keeps its parameters, the next round carries their inner steps; both end identical."""
    (params0, rounds0, count0), (params1, rounds1, count1) = run_replicas(7, fail_at=2)
    assert rounds0 == rounds1
    # the joining round, the one after inner step 3, the dropped one after step 6, finish()'s over steps 4 to 7
    assert [dropped for _, dropped, _ in rounds0] == [False, False, True, False], rounds0
    assert count0 == count1 == 3
    for name in params0:
        assert torch.equal(params0[name], params1[name]), name


def default_rank(index: int, address: str, steps: int, results) -> None:  # type: ignore[no-untyped-def]
    """One replica group of one process at mode="local"'s defaults (no sync_every, sync_delay or
    pacing given): its parameters, every round's H and why, and its rounds."""
    from acco.elastic import TorchFT

    torch.set_num_threads(1)
    try:
        membership = TorchFT.connect(f"replica-{index}", lighthouse=address, start_with=2, hostname="localhost",
                                     timeout=datetime.timedelta(seconds=10),
                                     quorum_timeout=datetime.timedelta(seconds=60))  # fmt: skip
        model = make_model()
        cls, hp = OPTIMIZERS["adamw"]
        opt = AccoOptimizer(model, cls, mode="local", membership=membership, max_grad_norm=MAX_NORM,
                            timeout=datetime.timedelta(seconds=90), **hp)  # fmt: skip
        described = repr(opt)
        opt.stop_after(steps=steps)  # speed pacing (the default) may give the groups different steps under load
        t = 0
        while not opt.should_stop:
            inner_step(opt, model, t, index, weighted=False)
            t += 1
        opt.finish()
        results.put((index, {k: v.numpy().tobytes() for k, v in params_of(model).items()}, every_history(opt),
                     described))  # fmt: skip
        membership.close()
    except BaseException as error:  # the test reports it
        results.put((index, repr(error), None, None))
        raise


def test_elastic_groups_run_the_default_sync_every() -> None:
    """Two replica groups with membership= and neither sync_every nor sync_delay: the default,
    sync_every="auto" with blocking rounds. Every landed round's H is the planner's choice from
    the reports of the rounds before it (replayed), the same on both groups (each hands over its
    round time: elastic rounds report it like a fixed group's), starting at the lower bound; both
    end identical."""
    runs = [lambda address, results, i=i: (default_rank, (i, address, 3 * AUTO_EVERY_BOUNDS[0] * 4, results))
            for i in range(2)]  # fmt: skip
    outcome = {r[0]: r[1:] for r in with_lighthouse(runs, timeout=150)}
    for index in range(2):
        assert not isinstance(outcome[index][0], str), outcome[index][0]
        assert "sync_every: auto" in outcome[index][2] and "sync_delay: 0" in outcome[index][2]
    assert outcome[0][0] == outcome[1][0]
    every = []
    for index in range(2):
        history = outcome[index][1]
        assert_planned(history, AUTO_EVERY_BOUNDS)
        # (a group that joined first tried its join round alone: dropped, not counted)
        every.append([h["sync_every"] for h in history if h["landed"] and h["report"] is not None])
        assert any(h["report"] is not None and any(h["report"]["round_seconds"]) for h in history), history
    assert every[0][-len(every[1]):] == every[1] or every[1][-len(every[0]):] == every[0], every
    assert every[0][1] == AUTO_EVERY_BOUNDS[0], every


def misfit_rank(index: int, address: str, results) -> None:  # type: ignore[no-untyped-def]
    """A replica group whose model is laid out unlike the other's (another hidden size)."""
    from acco.elastic import TorchFT

    torch.set_num_threads(1)
    membership = TorchFT.connect(f"replica-{index}", lighthouse=address, start_with=2, hostname="localhost",
                                 timeout=datetime.timedelta(seconds=5), quorum_timeout=datetime.timedelta(seconds=5))
    try:
        cls, hp = OPTIMIZERS["adamw"]
        AccoOptimizer(make_model(hidden=7 + index), cls, mode="local", membership=membership, sync_delay=0,
                      timeout=datetime.timedelta(seconds=20), **hp)  # fmt: skip
        results.put((index, "constructed"))
    except Exception as error:
        results.put((index, str(error)))
    membership.close()


@pytest.mark.parametrize("grace", [-1.0, "auto", True, float("nan")])
def test_an_invalid_grace_window_is_refused_before_anything_connects(grace) -> None:
    from acco.elastic import TorchFT

    with pytest.raises(ValueError, match="grace"):
        TorchFT(object(), None, grace=grace)


def test_a_round_waits_for_every_group_of_the_last_three_rounds() -> None:
    """The grace window's memory (docs/elastic.md, "Rounds that rotate"): a group left out of a
    round is early for the next, where it pairs with the first of the others to ask. A round
    must then wait for the third, though every participant's last round had two groups (the
    rule before: it did not, and 3 groups met in pairs for good). A group gone for good is
    waited for in the three rounds after its last one, then no more."""
    from acco.elastic import ElasticRunner, Quorum, TorchFT

    a, b, c = (TorchFT(object(), None, replica_id=f"replica-{i}").group_id for i in range(3))
    assert len({a, b, c}) == 3 and max(a, b, c) < 2**53  # exact in the exchange's float64
    assert TorchFT(object(), None, replica_id="replica-0").group_id == a  # the same group after a restart
    assert TorchFT(object(), None).group_id != TorchFT(object(), None).group_id  # unnamed: a new group each time
    view = {group: object.__new__(ElasticRunner) for group in (a, b, c)}  # each group's own record
    for runner in view.values():
        runner._seen = {}

    def round_(step: int, *groups: int) -> int:
        """``groups`` land the round at torchft step ``step``; the most groups any of them expects."""
        quorum = Quorum(None, 0, len(groups), False, step)  # type: ignore[arg-type]
        expected = max(view[g]._expected(quorum) for g in groups)
        for g in groups:
            view[g]._saw(quorum, groups)
        return expected

    assert round_(0, a, b, c) == 0  # the first round: nothing seen yet
    assert round_(1, a, b) == 3  # c late: the round waits for it (the window), then lands without it
    assert round_(2, c, a) == 3  # c, early, pairs with a: they wait for b
    assert round_(3, b, c) == 3
    assert round_(4, a, b, c) == 3
    # c gone for good after step 4: waited for at steps 5, 6 and 7, not at 8
    assert [round_(step, a, b) for step in (5, 6, 7, 8)] == [3, 3, 3, 2]


def test_groups_laid_out_differently_raise_naming_it() -> None:
    """Two groups whose models differ: at the join torchft heals one from the other (its first
    step), which refuses the peer's state naming the cause; the other group then waits for a
    second group until its quorum timeout and raises too. Neither trains."""
    runs = [lambda address, results, i=i: (misfit_rank, (i, address, results)) for i in range(2)]
    outcome = dict(with_lighthouse(runs, timeout=60))
    assert "constructed" not in outcome.values(), outcome
    assert any("laid out differently" in message for message in outcome.values()), outcome


def test_an_elastic_job_stopped_and_resumed_from_its_checkpoints_is_the_uninterrupted_run(tmp_path) -> None:
    """Both groups stop after inner step 5 (between rounds, residuals and outer momentum in use),
    each with its own checkpoint (acco.checkpoint.save); a new job (a new lighthouse, new
    processes) loads them after its join round and trains to step 8: bit for bit the
    uninterrupted 8-step run, on both groups."""
    with ThreadPoolExecutor(max_workers=1) as pool:  # the uninterrupted job beside the one that stops
        whole = pool.submit(run_replicas, 8)
        run_replicas(8, checkpoint=("save", str(tmp_path), 5))
        (whole0, _, count0), (whole1, _, _) = whole.result()
    (params0, _, resumed0), (params1, _, _) = run_replicas(8, checkpoint=("resume", str(tmp_path), 5))
    assert resumed0 == count0  # the saved count of rounds goes on (the new join round is the saved state's)
    for name in whole0:
        assert torch.equal(whole0[name], whole1[name]), name
        assert torch.equal(params0[name], whole0[name]), name
        assert torch.equal(params1[name], whole0[name]), name


def test_a_group_that_missed_a_round_takes_the_others_global_values() -> None:
    """Replica 1 drops round 2 after torchft committed it on both (the same step count, other
    global values: what a group left out of a round holds): at the next round it takes replica
    0's global values (a heal by content) instead of training on from its own; both end identical."""
    (params0, rounds0, _), (params1, rounds1, _) = run_replicas(7, miss_at=2)
    assert [healed for _, _, healed in rounds1] == [False, False, False, True], rounds1
    assert not any(healed for _, _, healed in rounds0), rounds0
    for name in params0:
        assert torch.equal(params0[name], params1[name]), name


# ----------------------------------------------------------------------------- the fault test

STEPS, STEP_SECONDS = 450, 0.01  # paced (sleeping, one micro-batch a step): a restart is not starved by the runs beside it
RUN = ["--replicas", "2", "--steps", str(STEPS), "--step-seconds", str(STEP_SECONDS), "--micro-batches", "1",
       "--sync-every", "10", "--timeout", "10", "--quorum-timeout", "60", "--pacing", "lockstep"]


LIGHTHOUSES: list = []  # one per run, served from this process (the launchers then load no torch)


def launch(directory: Path, *extra: str) -> subprocess.Popen:
    server = lighthouse()
    LIGHTHOUSES.append(server)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    log = open(directory.with_suffix(".out"), "w")
    command = [sys.executable, str(EXAMPLE), *RUN, "--log-dir", str(directory), "--lighthouse", server.address(), *extra]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish(process: subprocess.Popen, directory: Path) -> None:
    try:
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = directory.with_suffix(".out").read_text()
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(directory.glob("replica-*.log")))
    assert process.returncode == 0, output[-3000:] + logs


def records(directory: Path, index: int) -> list[dict]:
    return [json.loads(line) for line in (directory / f"replica-{index}.jsonl").read_text().splitlines()]


def landed(directory: Path, index: int) -> int:
    """Replica ``index``'s rounds landed so far (its join included; not a fresh job's join tries,
    dropped until every group is there)."""
    path = directory / f"replica-{index}.jsonl"
    return sum(1 for r in records(directory, index) if not r.get("final") and not r["dropped"]) if path.exists() else 0


def killed_run(directory: Path, run: int, *extra: str) -> subprocess.Popen:
    """Run ``run``: replica 1 killed at a random point (even runs: SIGKILL of one of its ranks,
    at random, from outside during its inner steps; odd runs: inside a random round, once its
    quorum formed, replica 0 then in the round's collectives)."""
    rng = random.Random(run)
    inside = run % 2 == 1
    process = launch(directory, *extra, *(["--die-in-round", f"1:{rng.randint(3, 9)}"] if inside else []))
    if not inside:
        def kill() -> None:  # no deadline but the job's: a busy machine can take a minute to start it
            while landed(directory, 1) < 2:
                if process.poll() is not None:
                    return  # the checks below fail: no restart
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 1.5))
            os.kill(int(rng.choice((directory / "replica-1.pid").read_text().split())), signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
    return process


def check_run(directory: Path, uninterrupted: float, solo: float) -> None:
    """Replica 0 took inner steps alone while replica 1 was gone and lost no round; replica 1 was
    restarted, healed and trained with it again; both ended at the same global values, the held-out
    loss within 2% of the one expected from replica 0's share of inner steps taken alone (between
    the uninterrupted run's and replica 0 alone's: elastic_stress.expected_loss; a restart takes
    about 3 s of an 18 s run on a quiet machine, and on a busy one can outlast the run)."""
    survivor, killed = records(directory, 0), records(directory, 1)
    assert (directory / "replica-0.final").read_text() == (directory / "replica-1.final").read_text()
    rounds = [r for r in survivor if not r.get("final")]
    # finish()'s rounds (no inner step: they end the job with every group) after the last regular one
    ending = [r for r in rounds if r["inner_step"] == STEPS][1:]
    assert ending and not ending[-1]["dropped"] and ending[-1]["participants"] == 2, ending
    rounds = rounds[: len(rounds) - len(ending)]
    landed = [r for r in rounds if not r["dropped"]]
    # No lost round: the survivor launched a round every sync_every inner steps; those that landed
    # are numbered in turn, and a dropped one (its peer died inside it) is followed by one that
    # lands, carrying its inner steps.
    assert [r["inner_step"] for r in rounds] == [10 * n for n in range(len(rounds))]
    assert [r["round"] for r in landed] == list(range(1, len(landed) + 1))
    assert not rounds[-1]["dropped"] and landed[-1]["inner_step"] == STEPS
    assert sum(r["dropped"] for r in rounds) <= 1
    pids = [r["pid"] for r in killed if not r.get("final")]
    assert len(set(pids)) == 2, "replica 1 was not killed and restarted"
    alone = [r for r in landed if r["participants"] == 1]
    assert alone, "the survivor took no inner step while replica 1 was gone"
    after = [r for r in killed if r.get("pid") == pids[-1]]
    assert len(after) >= 2 and all(r["participants"] == 2 for r in after if not r["dropped"])
    assert survivor[-1]["eval_loss"] == killed[-1]["eval_loss"]
    share = alone_share(rounds, 2)
    expected = expected_loss(uninterrupted, solo, share)
    assert abs(survivor[-1]["eval_loss"] - expected) <= 0.02 * expected, (survivor[-1]["eval_loss"], expected, share,
                                                                         uninterrupted, solo)  # fmt: skip


@pytest.mark.timeout(400)
@pytest.mark.parametrize("batches", [
    pytest.param([[0, 1]], id="two"),
])  # fmt: skip
def test_runs_of_a_killed_replica_group_rejoin_while_the_other_trains(tmp_path, batches) -> None:
    """Runs of :func:`killed_run` (two at a time; the uninterrupted run and replica 0 alone beside
    the last ones), each checked by :func:`check_run` against their held-out losses, every one
    passing: a rank killed from outside, a replica dying inside a round. (Ten kills of a group
    and ten of a rank of a 2-rank group: the stress tier, tests/test_stress.py.)"""
    group: list[str] = []
    reference, solo = tmp_path / "uninterrupted", tmp_path / "solo"
    outcomes: dict[int, Path] = {}
    failed = []
    for number, batch in enumerate(batches):
        runs = {n: (tmp_path / f"run-{n}", killed_run(tmp_path / f"run-{n}", n, *group)) for n in batch}
        if number == len(batches) - 1:
            references = {reference: launch(reference, *group), solo: launch(solo, *group, "--replicas", "1")}
            for directory, process in references.items():
                finish(process, directory)
        for n, (directory, process) in runs.items():
            try:
                finish(process, directory)
                outcomes[n] = directory
            except AssertionError as error:
                failed.append(f"run {n}: {error}")
    finals = [records(reference, i)[-1] for i in range(2)]
    assert finals[0]["eval_loss"] == finals[1]["eval_loss"]
    for n, directory in sorted(outcomes.items()):
        try:
            check_run(directory, finals[0]["eval_loss"], records(solo, 0)[-1]["eval_loss"])
        except AssertionError as error:
            failed.append(f"run {n}: {error}")
    for server in LIGHTHOUSES:
        server.shutdown()
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------- pacing in elastic rounds

PACED = ["--replicas", "2", "--steps", "120", "--step-seconds", "0.03", "--micro-batches", "1", "--sync-every", "10",
         "--timeout", "10", "--quorum-timeout", "60", "--pacing", "speed"]  # after RUN: later options win  # fmt: skip


def rate(directory: Path, index: int, steps: int = 120) -> float:
    """Replica ``index``'s inner steps per second from its third round to its last regular one."""
    rounds = [r for r in records(directory, index) if not r.get("final") and r["inner_step"] < steps]
    first, last = rounds[2], rounds[-1]
    return (last["inner_step"] - first["inner_step"]) / (last["time"] - first["time"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rate_checked", [False, pytest.param(True, marks=pytest.mark.measured)])
def test_speed_pacing_keeps_the_fast_group_at_its_rate_beside_one_3x_slower(tmp_path, rate_checked) -> None:
    """Group 1 three times slower, the default pacing ("speed"): once the first reports are in,
    pacing gives group 1 fewer steps than group 0's 10; every round's steps are the planner's,
    replayed on the reports the run recorded (a load spike that makes group 0 measure slower
    gives it fewer: the mechanism, not what the load made the paces measure, is asserted); no
    round goes without group 1, and both end identical with exit 0. The measured tier (``-m measured``, on a quiet machine: a rate on a loaded one
    measures the load) runs equal groups beside it: both end identical, and group 0 keeps at least 0.9 of its rate at equal speeds."""
    equal, slow = tmp_path / "equal", tmp_path / "slow"
    runs = {slow: launch(slow, *PACED, "--slow", "1:3")}
    if rate_checked:
        runs[equal] = launch(equal, *PACED)
    for directory, process in runs.items():
        finish(process, directory)
        assert (directory / "replica-0.final").read_text() == (directory / "replica-1.final").read_text()
    rounds = [r for r in records(slow, 0)[1:] if not r.get("final") and r["inner_step"] < 120]
    assert all(r["participants"] == 2 and not r["dropped"] for r in rounds), rounds
    assert any(r["steps"][1] < 10 for r in rounds), rounds  # group 1's steps cut (what a 3x slower group's reports give)
    # every round's steps are the planner's on the reports the run recorded before it
    assert all(r["steps"] == plan for r, plan in zip(rounds[1:], speed_plans([r["report"] for r in rounds], 10))), rounds
    if rate_checked:
        assert rate(slow, 0) >= 0.9 * rate(equal, 0), (rate(slow, 0), rate(equal, 0))


# ------------------------------------------- rounds that no group holds (grace window, late groups)

LATE = ["--replicas", "3", "--steps", "240", "--step-seconds", "0.05", "--micro-batches", "1", "--sync-every", "10",
        "--timeout", "10", "--quorum-timeout", "60", "--pacing", "lockstep"]  # after RUN: later options win  # fmt: skip


def counted_steps(directory: Path, index: int) -> int:
    """Group ``index``'s inner steps by the documented rule (docs/elastic.md, "A late group keeps
    its progress"), checked round by round: a landed round counts every inner step since the
    group's last landed round, except where the group dropped a round since and then took the
    newest global values by content: those count 0 (its progress may be in them already: the
    two-generals case). Asserts that the counted steps and those so lost add up to the group's
    inner steps; returns the lost ones."""
    rounds = [r for r in records(directory, index) if not r.get("final")]
    table = "\n".join(f"round {r['round']} inner step {r['inner_step']} participants {r['participants']} dropped "
                      f"{r['dropped']} counted {r['counted']} content heal {r['content_heal']}" for r in rounds)  # fmt: skip
    since = lost = 0  # the inner step of the last landed round; the steps lost
    landed = dropped = False
    for r in rounds:
        if r["dropped"]:
            dropped = dropped or landed
            continue
        steps = r["inner_step"] - since
        taken = dropped and r["content_heal"]
        assert (r["counted"] or 0) == (0 if taken else steps), f"group {index}, round {r['round']}:\n{table}"
        lost += steps if taken else 0
        since, landed, dropped = r["inner_step"], True, False
    assert sum(r["counted"] or 0 for r in rounds) + lost == records(directory, index)[-1]["inner_step"], table
    return lost


def check_late_group(directory: Path, baseline: Path, rate_checked: bool) -> int:
    """Group 2 was late (stalled or paused): groups 0 and 1 landed rounds without it meanwhile
    (and, ``rate_checked``, kept at least 0.9 of their rate in the run without it); group 2's
    inner steps count by :func:`counted_steps`' rule and it took the newest global values by
    content; every group ends identical. Returns group 2's steps lost by the rule."""
    finals = {(directory / f"replica-{i}.final").read_text() for i in range(3)}
    assert len(finals) == 1, finals
    for index in (0, 1):
        if rate_checked:
            assert rate(directory, index, 240) >= 0.9 * rate(baseline, index, 240), (rate(directory, index, 240),
                                                                                       rate(baseline, index, 240))
        assert sum(1 for r in records(directory, index) if r.get("participants") == 2 and not r["dropped"]) >= 5
    late = records(directory, 2)
    assert any(r["content_heal"] for r in late if not r.get("final")), late  # it took the newest global values
    return counted_steps(directory, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rate_checked", [False, pytest.param(True, marks=pytest.mark.measured)])
def test_a_late_group_holds_no_round_and_its_steps_count_later(tmp_path, rate_checked) -> None:
    """Runs of 3 groups at once: group 2 stalled (``--stall``: asleep in its training loop,
    heartbeating) for 8 s at inner step 40; group 2 paused (SIGSTOP, its heartbeats stopped too)
    for 6 s after its third round. In both the others land rounds without group 2 once the grace
    window has passed, and group 2's inner steps all count in its next round
    (:func:`check_late_group`). The measured tier (``-m measured``) adds a run without stalls beside them: its steps
    all count too, and the others keep 0.9 of its rate in the late runs."""
    baseline, stalled, paused = tmp_path / "baseline", tmp_path / "stalled", tmp_path / "paused"
    processes = [launch(stalled, *LATE, "--stall", "2:40:8"), launch(paused, *LATE)]
    if rate_checked:
        processes.append(launch(baseline, *LATE))

    def pause() -> None:  # no deadline but the job's: a busy machine can take a minute to start it
        while landed(paused, 2) < 3:
            if processes[1].poll() is not None:
                return  # the checks below fail
            time.sleep(0.01)
        pid = int((paused / "replica-2.pid").read_text())  # just landed a round: in its inner steps
        os.kill(pid, signal.SIGSTOP)
        time.sleep(6)
        os.kill(pid, signal.SIGCONT)

    pauser = threading.Thread(target=pause, daemon=True)
    pauser.start()
    for process, directory in zip(processes, (stalled, paused, baseline)):
        finish(process, directory)
    pauser.join()
    if rate_checked:
        assert len({(baseline / f"replica-{i}.final").read_text() for i in range(3)}) == 1
        for i in range(3):  # without a stall every step counts too
            assert counted_steps(baseline, i) == 0
    # The stalled group heartbeats and sleeps in its training loop, in no round: none of its steps
    # is lost. The paused one may be stopped inside a round on a busy machine (the pause follows
    # its third landed round by however long this thread takes to see it): its peers then drop
    # that round, and by the rule its steps since its last landed round are lost.
    assert check_late_group(stalled, baseline, rate_checked) == 0
    check_late_group(paused, baseline, rate_checked)
