"""A network for simulated hosts (``hosts.py``): each host its own network namespace, joined by a shaped link.

Layout: a "switch" namespace holds a bridge; each host's namespace holds ``eth0`` (address ``10.77.0.<h+1>/24``),
one end of a veth pair whose other end is a port of the bridge. Each link's rate is set with ``tbf`` on both
ends' egress, so host -> switch and switch -> host are each limited to it. ``netem`` is missing from the kernels
this ran on, so no delay is added: a link here is as fast as its rate and the machine's own loopback latency
(tens of microseconds), never slower in latency than that.

Nothing lasts beyond the processes that hold it: every namespace is anonymous (``unshare --net``), the switch's
held by one process that the kernel kills when its parent dies (``PR_SET_PDEATHSIG``), each host's by that
host's own processes; a veth pair goes when either of its namespaces goes. No interface is ever made in the
machine's own namespace: pairs are made inside the switch's namespace and their far end put straight into the
host's.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

SUBNET = "10.77.0"
IFNAME = "eth0"
_PR_SET_PDEATHSIG = 1
_TOOLS = ("ip", "tc", "nsenter", "unshare")


def address(host: int) -> str:
    return f"{SUBNET}.{host + 1}"


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: the child is SIGKILLed when the process that started it dies (however it dies)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return arm


def _run(pid: int, *cmd: str) -> None:
    """``cmd`` in the network namespace of process ``pid``."""
    done = subprocess.run(["nsenter", "-t", str(pid), "-n", *cmd], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} (in the namespace of pid {pid}) failed: {done.stderr.strip()}")


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate (``1gbit``, ``10gbit``, ``500mbit``)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate)
    if not m:
        raise ValueError(f"link rate: expected e.g. 1gbit or 500mbit, got {rate!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _tbf(rate: str) -> list[str]:
    """tbf for ``rate``: a bucket of 1 ms at that rate (at least 64 KiB, so one GSO packet fits), and a queue
    of up to 50 ms before drops."""
    bits = rate_bits(rate)
    burst = max(64 * 1024, int(bits / 8 / 1000))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


class Switch:
    """The bridge every host's link plugs into; :meth:`attach` one host, :meth:`close` it all."""

    def __init__(self, token: str) -> None:
        # the token on its command line: the harness finds stragglers by it
        hold = "import signal; signal.pause()"
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--", sys.executable, "-c", hold, token], preexec_fn=die_with_parent()
        )
        try:
            self._wait_for_namespace()
            _run(self.proc.pid, "ip", "link", "add", "br0", "type", "bridge")
            _run(self.proc.pid, "ip", "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _wait_for_namespace(self) -> None:
        """Until unshare has made the namespace (the pid's differs from ours)."""
        mine = os.stat("/proc/self/ns/net").st_ino
        for _ in range(500):
            try:
                if os.stat(f"/proc/{self.proc.pid}/ns/net").st_ino != mine:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"unshare --net exited with {self.proc.returncode}")
            time.sleep(0.01)
        raise RuntimeError("unshare --net made no network namespace within 5 s")

    def attach(self, host: int, pid: int, rate: str | None) -> None:
        """Plug host ``host`` (whose namespace process ``pid`` is in) in at ``address(host)``; ``rate`` None:
        unshaped."""
        port = f"h{host}"
        _run(self.proc.pid, "ip", "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", str(pid))
        _run(self.proc.pid, "ip", "link", "set", port, "master", "br0", "up")
        _run(pid, "ip", "addr", "add", f"{address(host)}/24", "dev", IFNAME)
        _run(pid, "ip", "link", "set", IFNAME, "up")
        _run(pid, "ip", "link", "set", "lo", "up")
        if rate is not None:
            _run(self.proc.pid, "tc", "qdisc", "add", "dev", port, "root", *_tbf(rate))
            _run(pid, "tc", "qdisc", "add", "dev", IFNAME, "root", *_tbf(rate))

    @property
    def namespace(self) -> str:
        return f"/proc/{self.proc.pid}/ns/net"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def interface_bytes(name: str = IFNAME) -> dict[str, int]:
    """``rx_bytes`` / ``tx_bytes`` of ``name`` in this process's network namespace (``/proc/net/dev`` shows
    the reader's namespace; ``/sys/class/net`` would show the one sysfs was mounted in)."""
    with open("/proc/net/dev") as f:
        for line in f:
            iface, _, rest = line.partition(":")
            if iface.strip() == name:
                fields = rest.split()
                return {"rx_bytes": int(fields[0]), "tx_bytes": int(fields[8])}
    return {"rx_bytes": 0, "tx_bytes": 0}


_WHY_NOT: list[str | None] = []


def network_unavailable() -> str | None:
    """Why hosts with their own network namespaces and shaped links cannot be made here (None: they can).
    Probed once: a switch and one shaped link are made and taken down."""
    if _WHY_NOT:
        return _WHY_NOT[0]
    why: str | None = None
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if not sys.platform.startswith("linux"):
        why = f"network namespaces need Linux (this is {sys.platform})"
    elif missing:
        why = f"shaped links need {', '.join(missing)} (not found)"
    elif os.geteuid() != 0:
        why = "network namespaces and tc need root"
    else:
        host = None
        switch = None
        try:
            switch = Switch("lr-net-probe")
            host = subprocess.Popen(
                ["unshare", "--net", "--", sys.executable, "-c", "import signal; signal.pause()", "lr-net-probe"],
                preexec_fn=die_with_parent(),
            )
            mine = os.stat("/proc/self/ns/net").st_ino
            deadline = time.monotonic() + 5
            while os.stat(f"/proc/{host.pid}/ns/net").st_ino == mine and time.monotonic() < deadline:
                time.sleep(0.01)
            switch.attach(0, host.pid, "1gbit")
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            why = f"cannot make network namespaces joined by a tbf-shaped veth link here: {e}"
        finally:
            if host is not None:
                host.kill()
                host.wait()
            if switch is not None:
                switch.close()
    _WHY_NOT.append(why)
    return why
