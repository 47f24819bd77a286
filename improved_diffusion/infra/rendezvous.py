"""The rendezvous under ``mpiexec``: which address of rank 0's host the other ranks can reach.

MPI is used only here, to meet: every rank sends what it knows of its host (``host_info``: its
name, its addresses, its network stack), rank 0 chooses the address (``_choose_address``), opens
the TCP store there on a free port (or ``MASTER_PORT``) and MPI-broadcasts host and port, and the
others connect. On one host (one network stack: the same boot and network namespace, whatever
the host names say) the address is 127.0.0.1. Across hosts it is ``MASTER_ADDR`` when set, else
the source address of a route from rank 0's host towards another rank's host, else an address
of one of rank 0's interfaces, never a loopback one; when there is none, every rank fails at
once with the same ``RendezvousError`` saying to set ``MASTER_ADDR``.

Example (two hosts, no MASTER_ADDR)::

    infos = [{"host": "a", "addrs": ["10.77.0.1"], "stack": "boot-a/net:1"},
             {"host": "b", "addrs": ["10.77.0.2"], "stack": "boot-b/net:1"}]
    _choose_address(infos, {})   # "10.77.0.1": rank 0's source address towards 10.77.0.2

dist_util.setup_dist calls ``mpi_rendezvous`` (collective over MPI); ``network_stack`` and
``boot_id`` also tell dist_util which ranks share a host and a machine.
"""
import ipaddress
import os
import socket

import torch.distributed as dist

from .errors import UserError, typed_one_line
from .heartbeat import bounded


class RendezvousError(UserError):
    """The ranks could not form a process group; the one-line message says what to set."""


def _attempt(fn):
    """("ok", fn()) or ("err", one-line message): something that can travel over MPI."""
    try:
        return "ok", fn()
    except Exception as e:  # sent to every rank, which all raise it
        return "err", typed_one_line(e)


def mpi_rendezvous(comm, timeout):
    """
    Open the TCP store: rank 0 serves it, the others connect; host and port travel over MPI.
    Every failure (on any rank, at any stage) raises the same RendezvousError on every rank.

    Collective (MPI): call from all ranks with the same arguments.
    """
    rank, world = comm.Get_rank(), comm.Get_size()
    seconds = timeout.total_seconds()
    infos = comm.allgather(_attempt(lambda: bounded(_host_info, seconds, "looking up this host")))
    bad = [(r, v) for r, (k, v) in enumerate(infos) if k == "err"]
    if bad:
        r, msg = bad[0]
        raise RendezvousError(f"rank {r} could not look up its host for the rendezvous: {msg}")
    infos = [v for _, v in infos]

    store = None
    if rank == 0:
        def open_store():
            nonlocal store
            host = _choose_address(infos, os.environ)
            port = int(os.environ.get("MASTER_PORT", 0) or 0)
            store = dist.TCPStore("0.0.0.0", port, world, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            return host, store.port

        decided = _attempt(open_store)
    else:
        decided = None
    kind, value = comm.bcast(decided, root=0)
    if kind == "err":
        if value.startswith("RendezvousError: "):
            raise RendezvousError(value[len("RendezvousError: "):])
        raise RendezvousError(f"rank 0 could not open the rendezvous store: {value}")
    host, port = value

    if rank != 0:
        joined = _attempt(lambda: dist.TCPStore(host, port, world, is_master=False,
                                                timeout=timeout))
        store = joined[1] if joined[0] == "ok" else None
        joined = (joined[0], None if joined[0] == "ok" else joined[1])
    else:
        joined = ("ok", None)
    results = comm.allgather(joined)
    failed = [r for r, (k, _) in enumerate(results) if k == "err"]
    if failed:
        raise RendezvousError(
            f"rank(s) {', '.join(map(str, failed))} could not reach the rendezvous store at "
            f"{host}:{port} within {seconds:g} s ({results[failed[0]][1]}); set MASTER_ADDR to an "
            f"address of rank 0's host that every host can reach (e.g. mpiexec -genv MASTER_ADDR "
            f"ADDR), or raise --dist_timeout")
    return store


def _host_info():
    """{"host": this host's name, "addrs": its non-loopback IPv4 addresses (interfaces first),
    "stack": its network stack (``network_stack()``)}."""
    name = socket.gethostname()
    addrs = _interface_addresses()
    try:
        addrs += [a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)]
    except OSError:
        pass
    return {"host": name, "addrs": _dedup(a for a in addrs if _reachable_kind(a)),
            "stack": network_stack()}


def boot_id():
    """The running kernel's boot id (Linux), different on every machine; None where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def network_stack():
    """Which network stack this process uses: "<boot id>/<network namespace inode>" (Linux), so
    two ranks can share 127.0.0.1 exactly when theirs are equal, whatever their host names say
    (two machines, or two containers, may carry the same name); None where unknown."""
    boot = boot_id()
    try:
        ns = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return f"{boot}/{ns.st_dev}:{ns.st_ino}" if boot else None


def _same_host(a, b):
    """True when ``_host_info()`` results ``a`` and ``b`` share a network stack (by the stack when
    both know it, else by the host name)."""
    if a.get("stack") and b.get("stack"):
        return a["stack"] == b["stack"]
    return a["host"] == b["host"]


def _interface_addresses():
    """IPv4 addresses of this host's network interfaces (Linux; [] where unsupported)."""
    try:
        import fcntl
        import struct

        names = [n for _, n in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):
        return []
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for n in names:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", n[:15].encode()))
            except OSError:
                continue  # no IPv4 address on this interface
            out.append(socket.inet_ntoa(packed[20:24]))
    return out


def _reachable_kind(addr):
    """True for an address another host could use: not loopback, not unspecified."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_unspecified)


def _dedup(items):
    return list(dict.fromkeys(items))


def _source_address_towards(addr):
    """The local address this host would send from to reach ``addr`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _choose_address(infos, env, probe=_source_address_towards):
    """
    The address rank 0 publishes for the store, given every rank's ``_host_info()``: 127.0.0.1
    when all ranks share rank 0's network stack (``_same_host``: never by host name alone); else
    ``MASTER_ADDR`` from ``env`` (never a loopback one); else the source address of a route from
    rank 0's host towards another host's address; else one of rank 0's own non-loopback
    addresses. Raises RendezvousError (saying to set MASTER_ADDR) when there is none.
    """
    home = infos[0]["host"]
    others = [i for i in infos[1:] if not _same_host(infos[0], i)]
    if not others:
        return "127.0.0.1"
    hint = ("set MASTER_ADDR to an address of rank 0's host that every host can reach "
            "(e.g. mpiexec -genv MASTER_ADDR 10.0.0.5 ...)")
    explicit = env.get("MASTER_ADDR", "").strip()
    if explicit:
        try:
            resolved = socket.gethostbyname(explicit)
        except OSError as e:
            raise RendezvousError(f"MASTER_ADDR={explicit}: cannot resolve it ({e}); {hint}")
        if not _reachable_kind(resolved):
            raise RendezvousError(
                f"MASTER_ADDR={explicit} is {resolved}, a loopback address that the ranks on "
                f"other hosts cannot reach; {hint}")
        return explicit
    for info in others:
        for addr in info["addrs"]:
            src = probe(addr)
            if src and _reachable_kind(src):
                return src
    if infos[0]["addrs"]:
        return infos[0]["addrs"][0]
    raise RendezvousError(
        f"rank 0's host {home!r} has no address that the other hosts can reach (its name "
        f"resolves to a loopback address and no interface has another); {hint}")
