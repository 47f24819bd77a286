"""Two simulated hosts on one machine: separate network stacks, names and local disks.

Each "host" is a network namespace (``ip netns``) holding one long-lived process, the host's
*holder*, started with ``unshare --mount --uts``: its own mount namespace (a private tmpfs at
``DISK``, so what host 0 writes there host 1 never sees) and its own host name. A veth pair links
the two namespaces (``10.77.0.1/24`` <-> ``10.77.0.2/24``) and nothing else; each host resolves
both names through its own ``/etc/hosts`` (``/etc/netns/NS/hosts``, which ``ip netns exec``
mounts over ``/etc/hosts``), as cluster DNS would. Commands run *in* a host through ``nsenter``
into the holder's mount, network and UTS namespaces; the repository and the virtual environment
are on the root filesystem, so they are the same on both hosts (only ``DISK`` is private).

The whole cluster is torn down by ``Cluster.close()`` (a context manager, also registered with
``atexit`` and ``weakref.finalize``): every process of each host is SIGKILLed, the namespaces are
deleted, and the tmpfs goes away with the last process of its mount namespace. The holders die
with the test process (``PR_SET_PDEATHSIG``), and ``clean_stale()`` removes namespaces left behind
by a test process that no longer exists (one killed by ``pytest-timeout``'s thread method, or
kill -9), so a failed or timed-out test never leaves hosts behind.

Needs root, ``ip``, ``unshare`` and ``nsenter``; ``unavailable()`` says why not, and the tests
skip with that reason. Names: ``idh-<pid>-<i>`` (namespaces, host names), ``idh<pid>x<i>`` (veth).
"""
import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import weakref
from pathlib import Path

import cluster_sim

# Each host's private disk (a tmpfs mounted only in that host's mount namespace).
DISK = "/mnt/idh-host"
SUBNET = "10.77.0"
PREFIX = "idh-"
_TOOLS = ("ip", "unshare", "nsenter")
_libc = ctypes.CDLL(None, use_errno=True)


def unavailable():
    """Why two hosts cannot be simulated here (a reason to skip), or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns, unshare --mount, nsenter)"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"simulated hosts need {', '.join(_TOOLS)}; missing: {', '.join(missing)}"
    return None


def _sh(*cmd, check=True):
    proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=cluster_sim.hang_s(30),
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise HostSetupError(f"{' '.join(map(str, cmd))}: exit {proc.returncode}: "
                             f"{proc.stdout.strip()}")
    return proc


class HostSetupError(RuntimeError):
    """The machine refused to create a simulated host (no CAP_NET_ADMIN, no netns support...)."""


def _die_with_parent():
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die when the test process dies


def _netns_pids(ns):
    proc = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()] if proc.returncode == 0 else []


def _kill_netns(ns, keep=()):
    """SIGKILL every process in network namespace ``ns`` except ``keep``; returns their pids."""
    pids = [p for p in _netns_pids(ns) if p not in keep]
    cluster_sim.signal_all(pids, signal.SIGKILL)
    return pids


def _remove_netns(ns):
    _kill_netns(ns)
    _sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def clean_stale():
    """Delete ``idh-<pid>-*`` namespaces (and their processes) whose test process is gone."""
    listing = _sh("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listing:
        ns = line.split(" ")[0]
        parts = ns.split("-")
        if not ns.startswith(PREFIX) or len(parts) != 3 or not parts[1].isdigit():
            continue
        if not cluster_sim.alive(int(parts[1])):
            _remove_netns(ns)


class Host:
    """One simulated host: ``index``, ``name`` (netns and host name), ``addr``, ``holder`` pid."""

    def __init__(self, index, name, addr):
        self.index, self.name, self.addr = index, name, addr
        self.holder = None  # Popen of the process whose namespaces the host's commands enter
        self.procs = []
        self.link = None  # its end of the veth pair

    def _start_holder(self):
        script = (f"mkdir -p {DISK} && mount -t tmpfs -o size=512m,mode=0755 idh-disk {DISK} && "
                  f"hostname {self.name} && echo ready && exec sleep 86400")
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", self.name, "unshare", "--mount", "--uts",
             "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, preexec_fn=_die_with_parent)
        line = self.holder.stdout.readline().strip()
        if line != "ready":
            rest = line + self.holder.stdout.read() if self.holder.poll() is not None else line
            raise HostSetupError(f"host {self.name}: the holder did not start: {rest.strip()}")

    def disk(self, *parts):
        """A path on this host's private disk, as the test process (outside the host) sees it."""
        return Path(f"/proc/{self.holder.pid}/root{DISK}", *map(str, parts))

    def command(self, cmd):
        """``cmd`` wrapped to run inside this host (its disk, network and name), from REPO."""
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--net", "--uts",
                f"--wd={cluster_sim.REPO}", "--", *map(str, cmd)]

    def start(self, cmd, out_path, env=None):
        """Popen ``cmd`` in this host, in a session of its own, output to ``out_path``."""
        with open(out_path, "w") as out:
            proc = subprocess.Popen(self.command(cmd), cwd=str(cluster_sim.REPO),
                                    env=cluster_sim.child_env(env), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append(proc)
        return proc

    def run(self, cmd, timeout, env=None):
        """Run ``cmd`` in this host; CompletedProcess (text, stdout+stderr). Raises on timeout
        (after killing what it started in the host)."""
        try:
            return subprocess.run(self.command(cmd), cwd=str(cluster_sim.REPO),
                                  env=cluster_sim.child_env(env), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                  timeout=cluster_sim.hang_s(timeout), preexec_fn=_die_with_parent)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise

    def pids(self):
        """Every process running in this host (its network namespace), the holder excluded."""
        return [p for p in _netns_pids(self.name) if p != self.holder.pid]

    def set_link(self, up):
        """Plug (``up=True``) or pull this host's network cable: with the link down its packets
        go nowhere and nothing answers, as when a host loses power or its switch port."""
        _sh("ip", "-n", self.name, "link", "set", self.link, "up" if up else "down")

    def kill_all(self):
        """The host dies: SIGKILL every process in it at once (its disk survives, as a local
        disk does when its machine loses power). Returns the pids killed."""
        pids = _kill_netns(self.name, keep=(self.holder.pid,))
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        return pids


class Cluster:
    """``n`` simulated hosts on one veth link; use as a context manager (see module docstring)."""

    def __init__(self, n=2):
        if n != 2:
            raise ValueError("a veth pair links exactly 2 hosts")
        clean_stale()
        tag = os.getpid()
        self.hosts = [Host(i, f"{PREFIX}{tag}-{i}", f"{SUBNET}.{i + 1}") for i in range(n)]
        self._closed = False
        self._finalizer = weakref.finalize(self, _teardown, [h.name for h in self.hosts],
                                           self.hosts)
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self):
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.addr} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            _sh("ip", "netns", "add", h.name)
            Path(f"/etc/netns/{h.name}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{h.name}/hosts").write_text(hosts_file)
        tag = self.hosts[0].name.split("-")[1]
        veth = [f"idh{tag}x{h.index}" for h in self.hosts]
        _sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for h, dev in zip(self.hosts, veth):
            h.link = dev
            _sh("ip", "link", "set", dev, "netns", h.name)
            _sh("ip", "-n", h.name, "addr", "add", f"{h.addr}/24", "dev", dev)
            _sh("ip", "-n", h.name, "link", "set", dev, "up")
            _sh("ip", "-n", h.name, "link", "set", "lo", "up")
        for h in self.hosts:
            h._start_holder()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if not self._closed:
            self._closed = True
            self._finalizer()
            atexit.unregister(self.close)


def _teardown(names, hosts):
    for h in hosts:
        if h.holder is not None:
            _kill_netns(h.name)
            h.holder.kill()
    for h in hosts:
        for p in ([h.holder] if h.holder is not None else []) + h.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()
    for name in names:
        _remove_netns(name)


def write_launcher(hosts, path):
    """Write ``path``: an executable that MPICH's hydra can use instead of ssh
    (``mpiexec -launcher ssh -launcher-exec PATH -hosts NAME0,NAME1``): it runs the command it is
    given inside the named host. Returns ``path``."""
    cases = "".join(f"  {h.name}) pid={h.holder.pid} ;;\n" for h in hosts)
    Path(path).write_text(
        "#!/bin/sh\n"
        "# called as: launcher [ssh options] HOST COMMAND...\n"
        'while [ "${1#-}" != "$1" ]; do shift; done\n'
        'host=$1; shift\n'
        'case "$host" in\n'
        f"{cases}"
        '  *) echo "no simulated host $host" >&2; exit 255 ;;\n'
        "esac\n"
        f'exec nsenter --target="$pid" --mount --net --uts --wd={cluster_sim.REPO} -- sh -c "$*"\n')
    os.chmod(path, 0o755)
    return path
