"""Run N ranks on this machine behind a rate-limited network: a fresh network namespace
whose loopback carries a token-bucket filter, or two namespaces (two emulated nodes, each
with a fast loopback) joined by a veth pair that carries the filter; always removed
afterwards. Needs root and iproute2; what the links are and are not: benchmarks/README.md,
"A slow cluster on one machine".

    sudo $(which python) benchmarks/netns.py --nproc 2 --rate 200mbit -- examples/train_gpt.py
    sudo $(which python) benchmarks/netns.py --nproc 2 -- examples/train_gpt.py        # no limit
    sudo $(which python) benchmarks/netns.py --nodes 2 --nproc 2 --rate 200mbit -- examples/train_gpt.py
    sudo $(which python) benchmarks/netns.py --nproc 2 --rate 500mbit:20,20mbit -- examples/train_gpt.py

A rate may be a schedule, ``RATE:SECONDS,RATE:SECONDS,...,RATE`` (``unlimited`` for no limit):
``500mbit:20,20mbit`` is 500 Mbit/s for 20 s, then 20 Mbit/s to the end, a link that changes
speed during a run. The schedule's clock starts at the launch, and starts again from its first
rate each time a rank writes a new line to the file named by ``ACCO_BENCH_START_FILE`` (what
benchmarks/time_to_loss.py does as each method's training starts); every change is logged on
stderr with its time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Node", "NetnsError", "Phase", "RateSchedule", "check_requirements", "namespace", "parse_rates", "run_nodes",
           "run_ranks", "two_nodes"]

DEFAULT_BURST = "256kb"  # at least one 64 KiB loopback packet
DEFAULT_LATENCY = "50ms"  # how long a packet may wait in the queue before it is dropped
MASTER_PORT = 29500  # a fresh namespace has every port free
SUBNET = "10.77.{}.{}"  # the link between two emulated nodes; private to their namespaces


class NetnsError(RuntimeError):
    """The namespace cannot be made here (not root, no iproute2, no permission)."""


UNLIMITED = "unlimited"
_RATE = re.compile(r"^\d+(?:\.\d+)?(?:bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")


@dataclass(frozen=True)
class Phase:
    """One rate of a schedule: a tc rate (None: no limit), for ``seconds`` (None: to the end)."""

    rate: str | None
    seconds: float | None


def parse_rates(text: str | None) -> list[Phase]:
    """``"200mbit"``, ``"unlimited"`` or None (one phase), or a schedule
    ``"500mbit:20,20mbit"`` (every phase but the last with its seconds).

    Raises:
        ValueError: a rate tc would not read, a phase without seconds before the last, or
            seconds that are not positive.
    """
    if text is None:
        return [Phase(None, None)]
    phases = []
    parts = text.split(",")
    for i, part in enumerate(parts):
        rate, _, seconds = part.strip().partition(":")
        if rate != UNLIMITED and not _RATE.match(rate):
            raise ValueError(f"Invalid rate {rate!r} in {text!r}: a tc rate such as 200mbit, or {UNLIMITED}")
        last = i == len(parts) - 1
        if not last and not seconds:
            raise ValueError(f"Invalid rate schedule {text!r}: every rate but the last needs its seconds (RATE:SECONDS)")
        try:
            duration = float(seconds) if seconds else None
        except ValueError:
            raise ValueError(f"Invalid seconds {seconds!r} in {text!r}") from None
        if duration is not None and not duration > 0:
            raise ValueError(f"Invalid seconds {seconds!r} in {text!r}: a phase lasts more than 0 s")
        phases.append(Phase(None if rate == UNLIMITED else rate, None if last else duration))
    return phases


def _set_rate(links: Sequence[tuple[str, str]], rate: str | None, burst: str, latency: str) -> None:
    """Each (namespace, device)'s tbf at ``rate``, or none."""
    for netns, device in links:
        inside = ["ip", "netns", "exec", netns, "tc", "qdisc"]
        if rate is None:
            subprocess.run([*inside, "del", "dev", device, "root"], capture_output=True)  # none there: nothing to do
        else:
            _run([*inside, "replace", "dev", device, "root", "tbf", "rate", rate, "burst", burst, "latency", latency])


class RateSchedule:
    """Applies a schedule's later phases on a thread, from the launch or from each new line of
    ``start_file`` (a new method's training: the schedule starts again at its first rate)."""

    def __init__(self, phases: Sequence[Phase], links: Sequence[tuple[str, str]], burst: str, latency: str,
                 start_file: str | None) -> None:
        self.phases, self.links, self.burst, self.latency = list(phases), list(links), burst, latency
        self.start_file = start_file
        self.applied: list[tuple[float, str]] = []  # (seconds since its start, rate), for the log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rate-schedule", daemon=True)

    def __enter__(self) -> RateSchedule:
        if len(self.phases) > 1:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _starts(self) -> int:
        try:
            with open(self.start_file or "", encoding="utf-8") as file:
                return sum(1 for _ in file)
        except OSError:
            return 0

    def _run(self) -> None:
        seen, started, phase = self._starts(), time.monotonic(), 0
        while not self._stop.wait(0.02):
            now = time.monotonic()
            if self.start_file is not None and (count := self._starts()) != seen:
                seen, started, phase = count, now, 0
                self._apply(0, 0.0)
            ends = sum(p.seconds or 0.0 for p in self.phases[:phase + 1])
            if phase < len(self.phases) - 1 and now - started >= ends:
                phase += 1
                self._apply(phase, now - started)

    def _apply(self, phase: int, at: float) -> None:
        rate = self.phases[phase].rate
        _set_rate(self.links, rate, self.burst, self.latency)
        self.applied.append((at, rate or UNLIMITED))
        print(f"netns: {at:.2f} s: {rate or UNLIMITED}", file=sys.stderr, flush=True)


def check_requirements() -> None:
    """Raise NetnsError with what is missing, before anything is created."""
    without = "or run the benchmark under plain torchrun (no rate limit)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"{' and '.join(missing)} not found: the rate-limited network needs iproute2 "
                         f"(Debian/Ubuntu: apt-get install iproute2), {without}")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        raise NetnsError("the rate-limited network needs root (network namespaces and tc): run with sudo, e.g. "
                         f"`sudo {sys.executable} {' '.join(sys.argv)}`, {without}")


def _run(command: Sequence[str]) -> None:
    result = subprocess.run(list(command), capture_output=True, text=True)
    if result.returncode:
        raise NetnsError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}")


@contextmanager
def namespace(rate: str | None, burst: str = DEFAULT_BURST, latency: str = DEFAULT_LATENCY) -> Iterator[str]:
    """A network namespace with loopback up and, if ``rate`` (a tc rate: ``"200mbit"``; of a
    schedule, its first) is given, a tbf on it; yields its name and deletes it on exit,
    whatever happens.

    Raises:
        NetnsError: not root, iproute2 missing, or a command failed (the message says which).
    """
    check_requirements()
    name = f"acco-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _run(["ip", "netns", "add", name])
    try:
        _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        _set_rate([(name, "lo")], parse_rates(rate)[0].rate, burst, latency)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass(frozen=True)
class Node:
    """One emulated node: its network namespace, its end of the link and that end's address."""

    netns: str
    interface: str
    address: str


@contextmanager
def two_nodes(rate: str | None, burst: str = DEFAULT_BURST,
              latency: str = DEFAULT_LATENCY) -> Iterator[tuple[Node, Node]]:
    """Two network namespaces, each with its loopback up (the fast link inside a node),
    joined by a veth pair whose two ends each carry a tbf at ``rate`` (a full-duplex link
    between the nodes; none if ``rate`` is None). Ranks of one node that bind to the node's
    address still talk over its loopback: Linux routes a namespace's own addresses through
    ``lo``. Yields the two nodes; deletes both namespaces (and with them the veth pair) on
    exit, whatever happens.

    Raises:
        NetnsError: not root, iproute2 missing, or a command failed (the message says which).
    """
    check_requirements()
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    subnet = 1 + int(uuid.uuid4().hex[:2], 16) % 250  # two runs at once get two subnets (separate namespaces anyway)
    nodes = tuple(Node(f"acco-bench-{tag}-{'ab'[i]}", f"node{i}", SUBNET.format(subnet, i + 1)) for i in range(2))
    created: list[str] = []
    try:
        for node in nodes:
            _run(["ip", "netns", "add", node.netns])
            created.append(node.netns)
        # Made inside the namespaces in one command: no end is ever left in the host's.
        _run(["ip", "link", "add", nodes[0].interface, "netns", nodes[0].netns, "type", "veth", "peer", "name",
              nodes[1].interface, "netns", nodes[1].netns])
        for node in nodes:
            inside = ["ip", "netns", "exec", node.netns]
            _run([*inside, "ip", "link", "set", "lo", "up"])
            _run([*inside, "ip", "addr", "add", f"{node.address}/24", "dev", node.interface])
            _run([*inside, "ip", "link", "set", node.interface, "up"])
            _set_rate([(node.netns, node.interface)], parse_rates(rate)[0].rate, burst, latency)
        yield nodes  # type: ignore[misc]
    finally:
        for name in created:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_nodes(nproc_per_node: int, script_and_args: Sequence[str], rate: str | None = None, *,
              burst: str = DEFAULT_BURST, latency: str = DEFAULT_LATENCY, env: dict[str, str] | None = None) -> int:
    """Run ``SCRIPT ARGS`` on two emulated nodes (:func:`two_nodes`), one ``torchrun
    --nnodes 2 --node-rank I --nproc-per-node nproc_per_node`` in each namespace, rendezvous
    at node 0's address, as on a real two-node cluster: global ranks 0 .. n-1 on node 0, n ..
    2n-1 on node 1. gloo binds each rank to its node's end of the link. The ranks see
    ``ACCO_BENCH_NETNS``, ``ACCO_BENCH_LINK`` (their node's interface), ``ACCO_BENCH_RATE`` and
    ``ACCO_BENCH_START_FILE`` (a rate schedule's restart: the module's docstring).
    Returns the first non-zero exit status (the other node's ranks are then stopped), else 0."""
    phases = parse_rates(rate)
    with two_nodes(rate, burst, latency) as nodes, tempfile.TemporaryDirectory() as scratch, \
            RateSchedule(phases, [(n.netns, n.interface) for n in nodes], burst, latency, f"{scratch}/starts"):
        processes: list[subprocess.Popen] = []
        try:
            for index, node in enumerate(nodes):
                child_env = {**os.environ, **(env or {}), "ACCO_BENCH_NETNS": node.netns,
                             "ACCO_BENCH_LINK": node.interface, "ACCO_BENCH_RATE": rate or UNLIMITED,
                             "ACCO_BENCH_START_FILE": f"{scratch}/starts", "GLOO_SOCKET_IFNAME": node.interface}
                command = ["ip", "netns", "exec", node.netns, sys.executable, "-m", "torch.distributed.run",
                           "--nnodes", "2", "--node-rank", str(index), "--nproc-per-node", str(nproc_per_node),
                           "--master-addr", nodes[0].address, "--master-port", str(MASTER_PORT), *script_and_args]
                processes.append(subprocess.Popen(command, env=child_env, start_new_session=True))
            while True:
                codes = [p.poll() for p in processes]
                failed = [c for c in codes if c]
                if failed or all(c is not None for c in codes):
                    break
                time.sleep(0.2)
            return failed[0] if failed else 0
        finally:
            for process in processes:
                _stop(process)


def run_ranks(nproc: int, script_and_args: Sequence[str], rate: str | None = None, *, burst: str = DEFAULT_BURST,
              latency: str = DEFAULT_LATENCY, env: dict[str, str] | None = None) -> int:
    """Run ``torchrun --nproc-per-node nproc SCRIPT ARGS`` inside a rate-limited namespace,
    every rank on 127.0.0.1; torchrun's exit status. The ranks see ``ACCO_BENCH_NETNS`` (the
    namespace's name), ``ACCO_BENCH_RATE`` and ``ACCO_BENCH_START_FILE`` (a rate schedule's
    restart: the module's docstring) in their environment."""
    phases = parse_rates(rate)
    with namespace(rate, burst, latency) as name, tempfile.TemporaryDirectory() as scratch, \
            RateSchedule(phases, [(name, "lo")], burst, latency, f"{scratch}/starts"):
        # GLOO_SOCKET_IFNAME: the host name does not resolve to an address in the namespace.
        child_env = {**os.environ, **(env or {}), "ACCO_BENCH_NETNS": name, "ACCO_BENCH_RATE": rate or UNLIMITED,
                     "ACCO_BENCH_START_FILE": f"{scratch}/starts", "GLOO_SOCKET_IFNAME": "lo"}
        command = ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(MASTER_PORT),
                   *script_and_args]
        process = subprocess.Popen(command, env=child_env, start_new_session=True)
        try:
            return process.wait()
        except BaseException:
            _stop(process)
            raise


def _stop(process: subprocess.Popen) -> None:
    """End the launched torchrun and its ranks (its own session) so the namespace can go."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) to start, per node")
    parser.add_argument("--nodes", type=int, default=1, choices=[1, 2],
                        help="1: one namespace, the rate on its loopback; 2: two namespaces, the rate on the link "
                             "between them")
    parser.add_argument("--rate", default=None,
                        help="tc rate of the limited link, e.g. 200mbit, or a schedule, e.g. 500mbit:20,20mbit "
                             "(default: no limit)")
    parser.add_argument("--burst", default=DEFAULT_BURST)
    parser.add_argument("--latency", default=DEFAULT_LATENCY)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] run by torchrun")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the script to run after --")
    try:
        parse_rates(args.rate)
    except ValueError as error:
        parser.error(str(error))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # an exception: the namespace's `finally` runs
    try:
        if args.nodes == 2:
            return run_nodes(args.nproc, command, args.rate, burst=args.burst, latency=args.latency)
        return run_ranks(args.nproc, command, args.rate, burst=args.burst, latency=args.latency)
    except NetnsError as error:
        print(f"netns.py: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
