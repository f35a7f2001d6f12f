"""Resuming mode="local" from per-rank checkpoints (issue 66): each rank ``torch.save``s its model
and optimizer state after an inner step, and a new model and optimizer on every rank load
them and train on (2 replicas in lockstep, ``sync_every=8``, 40 inner steps: tests/resume_job.py).

With ``sync_delay="auto"`` a replica lands a round at the first step its comm lane has finished
it, so at the step of a save one replica may hold the round landed and the other still in
flight: the resume must not wait for a round the other replica has already landed, and every
replica ends with the same parameters. With an integer ``sync_delay`` the resumed run is the one
that did not stop, bit for bit. A rank that resumes from nothing, or from another round than the
others, fails on every rank within the optimizer's ``timeout``, naming the round and its phase.

The fast tier resumes in the session's ranks (a new model and optimizer loading the files); the
stress tier in new processes, as torchrun starts them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import assert_identical_across_ranks, assert_params_equal
from tests.ranks import run_script
from tests.resume_job import run

JOB = str(Path(__file__).resolve().parent / "resume_job.py")
SHORT_TIMEOUT = 10.0  # the optimizer's timeout in the tests of failed resumes

pytestmark = pytest.mark.timeout(120)


def apart(slow: int, launch: int) -> dict[int, float]:
    """The slow rank's stalls (seconds before an inner step, by its index from 0) that put the
    replicas apart at the round launched after ``launch`` inner steps: its data loader stalls 2 s
    before the step ahead of the launch, so the other rank launches the round alone and takes
    the next steps while it waits for the slow one (a save it takes within a few steps holds the
    round in flight: state_dict() waits for it to finish); the slow rank launches it late, and
    waits 1 s more before its first step after the launch, at the end of which it lands it (a
    save it takes after that step holds the round landed)."""
    return {launch - 2: 2.0, launch: 1.0}


# The case: rank 0 stalls before round 1 (launched after 16 inner steps); the save after 21.
APART = {0: apart(0, 16)}


def run_rank(directory: str, delay: int | str, options: dict, pauses: dict) -> dict:
    return run(Path(directory), delay, pauses=pauses.get(dist.get_rank()), **options)


def test_a_resume_where_one_replica_had_landed_the_round_and_the_other_had_not(ranks, tmp_path) -> None:
    """The issue's hang: rank 1 saved round 1 in flight (finished, not landed), rank 0 saved it
    landed. The resume lands it on rank 1 from its own state (no collective): both replicas go on
    to step 40 and end identical."""
    saved = ranks(2).run(run_rank, str(tmp_path), "auto", {"save_at": (21,)}, APART)
    assert [r["error"] for r in saved] == [None, None]
    assert [r["in_flight"][21] for r in saved] == [False, True]  # the case under test (APART's stalls)
    resumed = ranks(2).run(run_rank, str(tmp_path), "auto", {"resume_from": 21}, {})
    assert [r["error"] for r in resumed] == [None, None]
    assert_identical_across_ranks(resumed)


@pytest.mark.parametrize("delay,save_at", [(0, 21), (3, 18)])
def test_an_integer_delay_resumes_bit_for_bit(ranks, tmp_path, delay, save_at) -> None:
    """Saved mid-round (blocking; or with the round launched after step 16 in flight until 19),
    the resumed run ends with the parameters of the run that saved, bit for bit, on every rank."""
    whole = ranks(2).run(run_rank, str(tmp_path), delay, {"save_at": (save_at,)}, {})
    assert [r["in_flight"][save_at] for r in whole] == [delay > 0] * 2
    resumed = ranks(2).run(run_rank, str(tmp_path), delay, {"resume_from": save_at}, {})
    for rank in range(2):
        assert resumed[rank]["error"] is None, resumed[rank]["error"]
        assert_params_equal(resumed[rank]["params"], whole[rank]["params"])
    assert_identical_across_ranks(resumed)


def drop_landing_values(directory: str, step: int) -> None:
    """This rank's state after ``step`` as an acco that kept no landing values saved it."""
    path = Path(directory) / f"step{step}.rank{dist.get_rank()}.pt"
    saved = torch.load(path, weights_only=True)
    del saved["optimizer"]["acco"]["local"]["landing_values"]
    torch.save(saved, path)


def test_a_state_saved_without_landing_values_replays_its_round(ranks, tmp_path) -> None:
    """A state saved by an earlier acco (a round in flight, no landing values) runs the round's
    gather leg again at the load, as it did then, and resumes bit for bit."""
    whole = ranks(2).run(run_rank, str(tmp_path), 3, {"save_at": (18,)}, {})
    ranks(2).run(drop_landing_values, str(tmp_path), 18)
    resumed = ranks(2).run(run_rank, str(tmp_path), 3, {"resume_from": 18}, {})
    for rank in range(2):
        assert resumed[rank]["error"] is None, resumed[rank]["error"]
        assert_params_equal(resumed[rank]["params"], whole[rank]["params"])


@pytest.mark.parametrize("other", ["fresh", "another round", "missing"])
def test_a_rank_that_cannot_resume_fails_every_rank_within_the_timeout(ranks, tmp_path, other) -> None:
    """Rank 0 resumes from its state after step 21; rank 1 from nothing (a fresh optimizer from
    step 0), from its state after step 13 (another round), or not at all (its file is missing:
    it raises at the load and stops). Every rank that trains on fails with an error naming the
    outer round and the phase it failed in, none hangs: at once where both ranks meet in the
    exchange of their next round (each says every rank's round), within ``timeout`` of its
    round's launch where rank 1 never comes."""
    ranks(2).run(run_rank, str(tmp_path), "auto", {"save_at": (13, 21)}, {})
    if other == "missing":
        (tmp_path / "step21.rank1.pt").unlink()
    load = {"fresh": None, "another round": 13, "missing": 21}[other]
    options = {"resume_from": 21, "timeout": SHORT_TIMEOUT}
    started = time.monotonic()
    results = ranks(2).run(run_other, str(tmp_path), options, load)
    assert time.monotonic() - started < SHORT_TIMEOUT + 20  # (the ranks' own start and steps)
    if other == "missing":
        assert results[1]["error"].startswith("FileNotFoundError")
        # Rank 0 alone reaches its round's exchange (after step 24), which waits ``timeout`` for rank 1.
        error = results[0]["error"]
        assert error is not None and results[0]["seconds"] < SHORT_TIMEOUT + 3, results[0]
        assert error.startswith("CommLaneError: outer round 2 failed on the comm lane during totals"), error
        return
    # Both replicas meet in the exchange of their next round (each at its own): they fail there at once.
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None and result["seconds"] < SHORT_TIMEOUT / 2, (rank, result)
        assert f"outer round {[2, 1 if load else 0][rank]} failed on the comm lane during totals" in error, error
        assert f"different outer rounds (rank 0: round 2, rank 1: round {1 if load else 0})" in error, error


def run_other(directory: str, options: dict, load: int | None) -> dict:
    """Rank 0 resumes from its own state; rank 1 loads ``load`` (None: nothing, from step 0)."""
    if dist.get_rank() == 0:
        return run(Path(directory), "auto", **options)
    return run(Path(directory), "auto", **{**options, "resume_from": load or 0}, load=load)


# ------------------------------------------------------------ in new processes (stress)


def launch(directory: Path, *args: str) -> list[dict]:
    """tests/resume_job.py on 2 new ranks; their records."""
    results = run_script(JOB, str(directory), *args, "--dump", "100", timeout=120)
    name = "whole" if "--resume-from" not in args else f"resumed{args[args.index('--resume-from') + 1]}"
    records = []
    for rank, result in enumerate(results):
        path = directory / f"{name}.rank{rank}.pt"
        assert path.exists(), f"rank {rank} wrote nothing (exit {result.returncode}):\n{result.stderr[-4000:]}"
        records.append(torch.load(path, weights_only=False))
    for rank, record in enumerate(records):
        assert record["error"] is None, (rank, record["error"], results[rank].stderr[-4000:])
    return records


def stalls(slow: int, launch: int) -> list[str]:
    """:func:`apart`'s stalls as tests/resume_job.py's ``--pause`` arguments."""
    return [word for step, seconds in apart(slow, launch).items() for word in ("--pause", str(slow), str(step), str(seconds))]


# Two runs, 10 saves each, all but two inside a round (not right after a launch), the ranks apart
# at two of them (:func:`apart`: no other save between the launch and that one, which would
# wait for the round) and drifting (--jitter: waits of up to 0.1 s before a fifth of each rank's
# steps). Per run: its options, its saves, and the saves where rank 0 holds the round in flight
# and rank 1 landed it ("10") or the reverse ("01").
AUTO_RUNS = [
    (["--jitter", "1", *stalls(0, 16), *stalls(1, 32)], (3, 5, 9, 10, 13, 18, 21, 27, 29, 35), {18: "01", 35: "10"}),
    (["--jitter", "2", *stalls(1, 8), *stalls(0, 24)], (2, 11, 14, 16, 19, 20, 26, 30, 33, 37), {11: "10", 26: "01"}),
]


@pytest.mark.stress
@pytest.mark.timeout(900)
def test_twenty_auto_resumes_in_new_processes(tmp_path) -> None:
    """sync_delay="auto": 20 resumes, each in 2 new processes, from states saved at 20 inner
    steps, some with the replicas apart (one holding the round in flight, the other landed): none
    hangs, and every replica ends with the same parameters."""
    for number, (options, saves, split) in enumerate(AUTO_RUNS):
        directory = tmp_path / f"run{number}"
        directory.mkdir()
        whole = launch(directory, "--delay", "auto", "--save-at", *map(str, saves), *options)
        for save, pattern in split.items():  # the stalls put the replicas apart there
            assert "".join(str(int(r["in_flight"][save])) for r in whole) == pattern, (save, whole[0]["in_flight"])
        for save in saves:
            assert_identical_across_ranks(launch(directory, "--delay", "auto", "--resume-from", str(save)))


@pytest.mark.stress
@pytest.mark.timeout(600)
@pytest.mark.parametrize("delay", [0, 3])
def test_integer_delay_resumes_in_new_processes_are_bit_for_bit(tmp_path, delay) -> None:
    """An integer sync_delay: resumes in new processes from states saved at 5 inner steps end
    with the saving run's parameters on every rank, bit for bit."""
    saves = (4, 11, 17, 18, 30)
    whole = launch(tmp_path, "--delay", str(delay), "--save-at", *map(str, saves), "--jitter", "3")
    for save in saves:
        resumed = launch(tmp_path, "--delay", str(delay), "--resume-from", str(save))
        for rank in range(2):
            assert_params_equal(resumed[rank]["params"], whole[rank]["params"])
