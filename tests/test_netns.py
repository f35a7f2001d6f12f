"""benchmarks/netns.py's rate schedules: a link that changes speed during a run (the
``sync_every="auto"`` benchmarks' changing links). Needs root and iproute2 (skipped without)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import netns  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_a_schedule_is_read_or_refused_before_anything_is_made() -> None:
    assert netns.parse_rates("500mbit:20,20mbit") == [netns.Phase("500mbit", 20.0), netns.Phase("20mbit", None)]
    assert netns.parse_rates("unlimited:2.5,20mbit") == [netns.Phase(None, 2.5), netns.Phase("20mbit", None)]
    assert netns.parse_rates("200mbit") == [netns.Phase("200mbit", None)]
    assert netns.parse_rates(None) == [netns.Phase(None, None)]
    for bad, says in (("500mbit,20mbit", "needs its seconds"), ("fast", "tc rate"), ("1mbit:0,2mbit", "more than 0"),
                      ("1mbit:x,2mbit", "Invalid seconds")):
        with pytest.raises(ValueError, match=says):
            netns.parse_rates(bad)


def tbf_rate(name: str) -> str | None:
    shown = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                           text=True, check=True).stdout
    words = shown.split()
    return words[words.index("rate") + 1].lower() if "tbf" in words else None


def wait_for(condition, limit: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the schedule did not move on"
        time.sleep(0.01)


@pytest.mark.skipif(shutil.which("tc") is None or os.geteuid() != 0, reason="needs root and iproute2")
def test_the_schedule_changes_the_link_and_starts_again_at_each_start(tmp_path: Path) -> None:
    """The namespace starts at the first rate; the next one follows after its seconds; a new
    line in the start file (a method's training starting) puts the first rate back and the
    clock at 0; "unlimited" takes the filter off."""
    starts = tmp_path / "starts"
    phases = netns.parse_rates("100mbit:0.3,20mbit:0.3,unlimited")
    with netns.namespace("100mbit:0.3,20mbit:0.3,unlimited") as name:
        assert tbf_rate(name) == "100mbit"
        with netns.RateSchedule(phases, [(name, "lo")], netns.DEFAULT_BURST, netns.DEFAULT_LATENCY,
                                str(starts)) as schedule:
            wait_for(lambda: len(schedule.applied) == 2)  # from the launch: 20 Mbit/s, then no limit
            assert [rate for _, rate in schedule.applied] == ["20mbit", "unlimited"]
            assert tbf_rate(name) is None
            starts.write_text("method 1\n")
            wait_for(lambda: len(schedule.applied) == 5)
            assert [rate for _, rate in schedule.applied[2:]] == ["100mbit", "20mbit", "unlimited"]
            at = [seconds for seconds, _ in schedule.applied[2:]]
            assert at[0] == 0.0 and 0.3 <= at[1] and 0.6 <= at[2]  # each after its phase, never before
            starts.write_text("method 1\nmethod 2\n")
            wait_for(lambda: len(schedule.applied) == 6)
            assert schedule.applied[5] == (0.0, "100mbit")  # (the link itself may have moved on since)
