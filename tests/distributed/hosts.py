"""Simulated hosts on one Linux machine: each a set of UTS + pid + mount namespaces, on the loopback network or
(``own_network=True``) each in its own network namespace, joined by rate-limited links (``hosts_net.py``).

A "host" is one ``unshare --uts --pid --mount --fork --mount-proc`` whose first process (pid 1 there) sets
its own hostname, mounts a private tmpfs on ``/dev/shm`` and starts that host's ranks, with the environment
a launcher sets on a real multi-node job (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK /
GROUP_RANK, MASTER_ADDR/PORT). The network namespace stays shared, so gloo and the TCP store connect over
127.0.0.1 as they would between machines. Ranks of one host share its pid space (they see each other's
pids, and the numbers repeat from host to host: both hosts' ranks are pids 3 and 4); ranks of different
hosts see none of each other's processes. The boot id is the one machine's (it cannot be namespaced).

With ``own_network=True`` each host also gets ``unshare --net``: its ranks see only ``lo`` and ``eth0``
(``10.77.0.<h+1>``), the store and gloo use those addresses (``MASTER_ADDR`` is host 0's, ``GLOO_SOCKET_IFNAME``
``eth0``), and every byte between hosts crosses host ``h``'s link, whose counters the host reports. A host's
pid 1 starts its ranks only once :func:`run_hosts` has plugged every host in.

The test calls :func:`run_hosts`; this file is also the host's program (``python -m tests.distributed.hosts
host ...``, inside the namespaces). Every process is accounted for: a host's pid 1 reaps its ranks (and any
orphan, as init must) and SIGKILLs them past a deadline; its exit takes every process of its pid namespace
with it (the kernel's rule for a namespace's init); ``unshare --kill-child`` kills pid 1 when unshare dies;
and :func:`run_hosts` kills unshare's whole session past its own deadline, then looks for survivors by a
token that every process of the run carries on its command line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.distributed import hosts_net

ROOT = Path(__file__).resolve().parents[2]
_UNSHARE = ["--uts", "--pid", "--mount", "--fork", "--mount-proc", "--kill-child"]
# enough for anything a rank might put there; a tmpfs only takes what is written
_SHM_SIZE = "256m"


_PREFIX: list[str] | None = None
_WHY_NOT: str | None = None


def namespaces_unavailable() -> str | None:
    """Why simulated hosts cannot be made here (None: they can). Probed once: a namespace is made, named and
    given its own /dev/shm, as a host would be."""
    global _PREFIX, _WHY_NOT
    if _PREFIX is not None or _WHY_NOT is not None:
        return _WHY_NOT
    if not sys.platform.startswith("linux"):
        _WHY_NOT = f"simulated hosts need Linux namespaces (this is {sys.platform})"
        return _WHY_NOT
    if shutil.which("unshare") is None:
        _WHY_NOT = "simulated hosts need util-linux's unshare (not found)"
        return _WHY_NOT
    if os.geteuid() != 0:
        # an unprivileged user namespace (unshare --user --map-root-user) may grant the rest where the kernel
        # allows it; not relied on: the runs were only ever checked as root
        _WHY_NOT = "simulated hosts need root (to make UTS, pid and mount namespaces and mount /dev/shm)"
        return _WHY_NOT
    probe = (
        "import socket, subprocess; socket.sethostname('lr-probe'); "
        "subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'lr-shm', '/dev/shm'], check=True)"
    )
    prefix = [shutil.which("unshare"), *_UNSHARE, "--"]
    try:
        done = subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        error = str(e)
    else:
        if done.returncode == 0:
            _PREFIX = prefix
            return None
        error = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    # a container without CAP_SYS_ADMIN, a seccomp profile refusing unshare, an old unshare without --kill-child
    _WHY_NOT = f"cannot make UTS + pid + mount namespaces with a private /dev/shm here: {error}"
    return _WHY_NOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ancestors() -> set[int]:
    """This process and its ancestors (whose command lines may well hold the token: a shell that ran us)."""
    pids, pid = set(), os.getpid()
    while pid > 0 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def processes_carrying(token: str) -> list[tuple[int, str]]:
    """Processes of the machine (every pid namespace below this one) whose command line holds ``token``."""
    found, mine = [], _ancestors()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if token in cmd:
            found.append((int(entry), cmd.strip()))
    return found


def explain(run: dict) -> str:
    """A :func:`run_hosts` result for an assertion message: the hosts' reports, what was left running and the tail
    of every log."""
    logs = "\n".join(f"--- log {i} ---\n{text[-3000:]}" for i, text in enumerate(run["logs"]) if text.strip())
    return f"hosts: {json.dumps(run['hosts'])}\nleftover: {run['leftover']}\n{logs}"


def phase_data(run: dict, rank: int, phase: str) -> dict:
    """What ``rank`` reported for ``phase`` of a :func:`run_hosts` run; fails the test, explaining the run, where
    the rank did not finish the phase or failed it."""
    result = run["ranks"][rank]
    assert result is not None and phase in result, f"rank {rank} did not finish {phase!r}:\n{explain(run)}"
    got = result[phase]
    assert got["ok"], f"rank {rank} failed {phase!r}:\n{got['error']}\n{explain(run)}"
    return got["data"]


# what a link carries beyond the payload (0.2-0.7% measured): TCP/IP headers (GSO segments of up to 64 KiB), ACKs
# of what the host received, the window's barrier
LINK_OVERHEAD = 0.02
LINK_SLACK_BYTES = 64 * 1024


def check_all_types(run: dict, world: int, kinds: set[str]) -> None:
    """Every rank of a run with the ``all_types`` phase trained each sharding kind, pooled and sequence."""
    for rank in range(world):
        cases = phase_data(run, rank, "all_types")["cases"]
        assert {c["kind"] for c in cases} == kinds
        assert {c["sequence"] for c in cases} == {False, True}


def check_link_bytes(run: dict, n_hosts: int, per_host: int) -> None:
    """Per collective of the ``wire`` phase (read by each host's first rank), the cross-host bytes the transport
    counted are what the host's link carried, give or take the link's own overhead."""
    for host in range(n_hosts):
        got = phase_data(run, host * per_host, "wire")
        for name, seen in got.items():
            counted, carried = seen["counted"], seen["link_tx"]
            assert counted > 0, (name, seen)
            assert counted <= carried <= counted * (1 + LINK_OVERHEAD) + LINK_SLACK_BYTES, (host, name, seen)


def run_hosts(
    module: str,
    args: list[str],
    out_dir: Path,
    n_hosts: int = 2,
    per_host: int = 2,
    deadline_s: float = 150.0,
    grace_s: float = 60.0,
    own_network: bool = False,
    link_rate: str | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run ``python -m module OUT_DIR *args`` as ``per_host`` ranks on each of ``n_hosts`` simulated hosts.

    Returns ``{"hosts": [...], "ranks": [...], "logs": [...], "leftover": [...], "timed_out": bool}``: each
    host's report (hostname, pid namespace, each rank's exit code, what its /dev/shm held at the end), each
    rank's ``rank<R>.json`` (None if it wrote none), each rank's output, and any process of this run still
    alive once every host has ended. A rank still running after ``deadline_s`` is killed by its host; a host
    still running ``grace_s`` later is killed from here, with everything in it.

    ``own_network``: each host in its own network namespace, its link limited to ``link_rate`` (``"1gbit"``;
    None: unshaped) in each direction; each host's report then has its ``eth0`` byte counters before its ranks
    started and after they ended (``"net"``). ``env``: more variables for every rank.
    """
    why = namespaces_unavailable() or (hosts_net.network_unavailable() if own_network else None)
    if why is not None:
        raise RuntimeError(why)
    out_dir.mkdir(parents=True, exist_ok=True)
    token = str(out_dir.resolve())  # on every process's command line: how stragglers are found
    port = _free_port()
    procs = []
    timed_out = False
    switch = None
    prefix = list(_PREFIX or [])
    if own_network:
        prefix.insert(1, "--net")
    ready = out_dir / "network_ready"
    try:
        if own_network:
            switch = hosts_net.Switch(token)
        for h in range(n_hosts):
            cmd = [
                *prefix,
                sys.executable,
                "-m",
                "tests.distributed.hosts",
                "host",
                str(h),
                str(n_hosts),
                str(per_host),
                str(port),
                str(deadline_s),
                hosts_net.IFNAME if own_network else "lo",
                json.dumps(env or {}),
                module,
                token,
                *args,
            ]
            log = open(out_dir / f"host{h}.log", "w")  # noqa: SIM115 - closed below, after the host ends
            procs.append(
                (
                    subprocess.Popen(
                        cmd,
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        # a run killed outright takes its hosts along (unshare --kill-child then ends pid 1)
                        preexec_fn=hosts_net.die_with_parent(),
                    ),
                    log,
                )
            )
        if switch is not None:
            for h, (p, _) in enumerate(procs):
                _wait_for_own_network(p.pid)
                switch.attach(h, p.pid, link_rate)
            ready.write_text("")
        end = time.monotonic() + deadline_s + grace_s  # the hosts' own deadline first, then this one
        for p, _ in procs:
            try:
                p.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for p, log in procs:
            if p.poll() is None:
                # unshare's session: unshare itself (--kill-child then kills the host's pid 1, and with it the
                # whole pid namespace)
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            log.close()
        if switch is not None:
            switch.close()
    # a namespace's processes are gone once its init is reaped; allow the kernel a moment all the same
    leftover = processes_carrying(token)
    for _ in range(50):
        if not leftover:
            break
        time.sleep(0.1)
        leftover = processes_carrying(token)

    def read(name: str):
        path = out_dir / name
        return json.loads(path.read_text()) if path.exists() else None

    world = n_hosts * per_host
    return {
        "hosts": [read(f"host{h}.json") for h in range(n_hosts)],
        "ranks": [read(f"rank{r}.json") for r in range(world)],
        "logs": [
            (out_dir / f"rank{r}.log").read_text(errors="replace") if (out_dir / f"rank{r}.log").exists() else ""
            for r in range(world)
        ]
        + [(out_dir / f"host{h}.log").read_text(errors="replace") for h in range(n_hosts)],
        "leftover": leftover,
        "timed_out": timed_out,
        # the switch's namespace, and with it every link, is gone once its holder is
        "switch_left": switch is not None and os.path.exists(switch.namespace),
    }


def run_bench_ranks(
    module: str, cfg: dict, out_dir: Path, n_hosts: int, per_host: int, rate: str, env: dict[str, str], what: str
) -> dict:
    """A benchmark's ranks (``python -m module OUT_DIR <cfg as JSON>``) on hosts with their own network, links
    at ``rate``; the run (:func:`run_hosts`'s result). Exits naming ``what`` and the logs' tails where a rank
    wrote no report, the hosts' deadline passed, or a rank exited non-zero (a rank that raised in a later part
    of its run has still written the parts before it)."""
    run = run_hosts(
        module,
        [json.dumps(cfg)],
        out_dir,
        n_hosts,
        per_host,
        deadline_s=900.0,
        own_network=True,
        link_rate=rate,
        env=env,
    )
    failed = [r for h in run["hosts"] if h for r, code in h["exit_codes"].items() if code != 0]
    if any(r is None for r in run["ranks"]) or run["timed_out"] or failed:
        tail = "\n".join(text[-2000:] for text in run["logs"] if text.strip())
        raise SystemExit(f"{what} failed (ranks {failed or 'without a report'}):\n{tail}")
    return run


def _wait_for_own_network(pid: int) -> None:
    """Until unshare (``pid``) is in a network namespace of its own."""
    mine = os.stat("/proc/self/ns/net").st_ino
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino != mine:
                return
        except OSError:
            raise RuntimeError(f"host process {pid} ended before it had its network namespace") from None
        time.sleep(0.01)
    raise RuntimeError(f"host process {pid} made no network namespace within 10 s")


def _host(
    index: int,
    n_hosts: int,
    per_host: int,
    port: int,
    deadline_s: float,
    ifname: str,
    extra_env: dict[str, str],
    module: str,
    out_dir: str,
    args: list[str],
) -> None:
    """pid 1 of one simulated host: name it, give it its own /dev/shm, run its ranks, reap, report."""
    hostname = f"lr-host{index}"
    socket.sethostname(hostname)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={_SHM_SIZE}", "lr-shm", "/dev/shm"], check=True)
    own_network = ifname != "lo"
    if own_network:
        ready = Path(out_dir) / "network_ready"
        give_up = time.monotonic() + 60
        while not ready.exists():
            if time.monotonic() > give_up:
                raise SystemExit(f"host {index}: no network after 60 s")
            time.sleep(0.01)
    net_before = hosts_net.interface_bytes() if own_network else None
    base = {k: v for k, v in os.environ.items() if k != "LIGHTNING_REC_SHM"}  # the transport's default: on
    base.update(
        MASTER_ADDR=hosts_net.address(0) if own_network else "127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(n_hosts * per_host),
        LOCAL_WORLD_SIZE=str(per_host),
        NODE_RANK=str(index),
        GROUP_RANK=str(index),
        GROUP_WORLD_SIZE=str(n_hosts),
        ROLE_NAME="default",
        ROLE_WORLD_SIZE=str(n_hosts * per_host),
        # the hostname resolves nowhere: bind gloo to the host's interface (loopback, where the network is shared)
        GLOO_SOCKET_IFNAME=ifname,
        OMP_NUM_THREADS="1",
        **extra_env,
    )
    ranks: dict[int, int] = {}  # pid -> global rank
    for local in range(per_host):
        rank = index * per_host + local
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(local), ROLE_RANK=str(rank))
        with open(Path(out_dir) / f"rank{rank}.log", "w") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", module, out_dir, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        ranks[p.pid] = rank
    codes: dict[int, int] = {}
    ended_at: dict[int, float] = {}
    killed_at_deadline: list[int] = []
    deadline = time.monotonic() + deadline_s
    while len(codes) < len(ranks):
        # reap whatever ended (pid 1 inherits orphans too): a dead rank is reaped within a few ms, as under
        # torchrun, whose agent polls its workers
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in ranks:
            codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
            ended_at[ranks[pid]] = time.monotonic()
            continue
        if pid:
            continue
        if time.monotonic() > deadline and not killed_at_deadline:
            killed_at_deadline = sorted(r for p, r in ranks.items() if r not in codes)
            for p, r in ranks.items():
                if r not in codes:
                    os.kill(p, signal.SIGKILL)
        time.sleep(0.005)
    report = {
        "hostname": socket.gethostname(),
        "pid_namespace": os.stat("/proc/self/ns/pid").st_ino,
        "pids": {str(r): p for p, r in ranks.items()},
        "exit_codes": {str(r): c for r, c in sorted(codes.items())},
        "ended_at": {str(r): t for r, t in sorted(ended_at.items())},  # CLOCK_MONOTONIC: one clock for all hosts
        "killed_at_deadline": killed_at_deadline,
        "dev_shm_left": sorted(os.listdir("/dev/shm")),
        "net": {"before": net_before, "after": hosts_net.interface_bytes()} if own_network else None,
        "interfaces": _interfaces(),
    }
    path = Path(out_dir) / f"host{index}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").rename(path)


def _interfaces() -> list[str]:
    """The network interfaces this host sees (its own namespace's, or the machine's where it shares that)."""
    with open("/proc/net/dev") as f:
        return sorted(line.partition(":")[0].strip() for line in f if ":" in line)


if __name__ == "__main__":
    if sys.argv[1] != "host":
        raise SystemExit(
            f"usage: {sys.argv[0]} host INDEX N_HOSTS PER_HOST PORT DEADLINE_S IFNAME ENV_JSON MODULE OUT_DIR ARGS..."
        )
    i, n, per, port_, deadline_, ifname_, env_, module_, out_ = sys.argv[2:11]
    _host(
        int(i), int(n), int(per), int(port_), float(deadline_), ifname_, json.loads(env_), module_, out_, sys.argv[11:]
    )
