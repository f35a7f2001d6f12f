"""Run N ranks on this machine behind a rate-limited network: a fresh network namespace
whose loopback carries a token-bucket filter, always removed afterwards. Needs root and
iproute2; what the link is and is not: benchmarks/README.md, "A slow cluster on one machine".

    sudo $(which python) benchmarks/netns.py --nproc 2 --rate 200mbit -- examples/train_gpt.py
    sudo $(which python) benchmarks/netns.py --nproc 2 -- examples/train_gpt.py        # no limit
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["NetnsError", "check_requirements", "namespace", "run_ranks"]

DEFAULT_BURST = "256kb"  # at least one 64 KiB loopback packet
DEFAULT_LATENCY = "50ms"  # how long a packet may wait in the queue before it is dropped
MASTER_PORT = 29500  # a fresh namespace has every port free


class NetnsError(RuntimeError):
    """The namespace cannot be made here (not root, no iproute2, no permission)."""


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
    """A network namespace with loopback up and, if ``rate`` (a tc rate: ``"200mbit"``) is
    given, a tbf on it; yields its name and deletes it on exit, whatever happens.

    Raises:
        NetnsError: not root, iproute2 missing, or a command failed (the message says which).
    """
    check_requirements()
    name = f"acco-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _run(["ip", "netns", "add", name])
    try:
        _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        if rate is not None:
            _run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                  "rate", rate, "burst", burst, "latency", latency])
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_ranks(nproc: int, script_and_args: Sequence[str], rate: str | None = None, *, burst: str = DEFAULT_BURST,
              latency: str = DEFAULT_LATENCY, env: dict[str, str] | None = None) -> int:
    """Run ``torchrun --nproc-per-node nproc SCRIPT ARGS`` inside a rate-limited namespace,
    every rank on 127.0.0.1; torchrun's exit status. The ranks see ``ACCO_BENCH_NETNS`` (the
    namespace's name) and ``ACCO_BENCH_RATE`` in their environment."""
    with namespace(rate, burst, latency) as name:
        # GLOO_SOCKET_IFNAME: the host name does not resolve to an address in the namespace.
        child_env = {**os.environ, **(env or {}), "ACCO_BENCH_NETNS": name, "ACCO_BENCH_RATE": rate or "unlimited",
                     "GLOO_SOCKET_IFNAME": "lo"}
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
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes) to start")
    parser.add_argument("--rate", default=None, help="tc rate of the loopback, e.g. 200mbit (default: no limit)")
    parser.add_argument("--burst", default=DEFAULT_BURST)
    parser.add_argument("--latency", default=DEFAULT_LATENCY)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] run by torchrun")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the script to run after --")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # an exception: the namespace's `finally` runs
    try:
        return run_ranks(args.nproc, command, args.rate, burst=args.burst, latency=args.latency)
    except NetnsError as error:
        print(f"netns.py: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
