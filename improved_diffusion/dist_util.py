"""Process-group setup and the few collectives the trainer needs.

Three ways to start:

* ``torchrun`` (env ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): the ``env://``
  store, behind a prefix of this restart (``TORCHELASTIC_RESTART_COUNT``), so that the ranks of
  a ``--max_restarts`` restart never read the keys of the attempt before.
* ``mpiexec -n N`` (mpi4py): MPI is used ONLY for the rendezvous (rank 0 opens a TCP store on a
  free port, or ``MASTER_PORT`` when set, and MPI-broadcasts host and port); every collective
  afterwards is torch.distributed. On one host (one network stack: the same boot and network
  namespace, whatever the host names say) the address is 127.0.0.1. Across hosts it is
  ``MASTER_ADDR`` when set in the environment (e.g. ``mpiexec -genv MASTER_ADDR 10.0.0.5 ...``),
  else an address of rank 0's host that is never a loopback one: the source address of a route
  towards another rank's host, else an address of one of rank 0's interfaces. When none exists
  the job fails at once on every rank, saying to set ``MASTER_ADDR``; any error of rank 0 while
  finding the address or opening the store reaches every rank.
* a plain ``python`` process: no process group at all; every helper below degrades to the
  identity / a no-op, so single-process code paths need no special casing.

Every wait is bounded by ``timeout`` (``--dist_timeout``, default 600 s): the rendezvous, each
collective, and so a rank that dies. Each rank of a process group beats a heartbeat in the group's
TCP store (a daemon thread); when a collective fails, ``diagnose_failure`` names the ranks whose
heartbeat stopped (``RankLostError``), so a dead rank or host ends the job with a message naming it.

Backend: ``nccl`` when CUDA is available, else ``gloo``. The device comes from the rank's index on
its host (``local_rank_from_env``: ``LOCAL_RANK``, else ``SLURM_LOCALID``,
``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``, ``MV2_COMM_WORLD_LOCAL_RANK``; else the
ranks sharing this host, counted in the MPI shared-memory split or the process group's store):
cuda:(local rank), or cuda:0 when the launcher shows each rank only its own GPU. More ranks on a
host than GPUs, or two ranks on one GPU, is a one-line ``DeviceError`` (``local_device_index``),
never NCCL's "Duplicate GPU detected" at the first collective.

No hidden global settings beyond the process-group state itself. Rules (docs/ARCHITECTURE.md): every
collective is called by every rank in the same order; each function that synchronises ranks says
"Collective: call from all ranks with the same arguments." in its docstring.
"""

import atexit
import datetime
import io
import ipaddress
import math
import os
import pickle
import socket
import sys
import threading
import time
import warnings

import blobfile as bf
import torch as th
import torch.distributed as dist

from .errors import UserError, typed_one_line

# Payloads bigger than this are broadcast in pieces (bounded extra memory, works over gloo).
_CHUNK_BYTES = 64 * 1024 * 1024

# Environment variables that only exist when a process was started by an MPI launcher.
# mpi4py is imported (and MPI initialised) only when one of them is present, so a plain
# `python` process never pays for, or trips over, MPI singleton initialisation.
_MPI_LAUNCHER_VARS = (
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "HYDRA_CONTROL_FD",
    "MV2_COMM_WORLD_SIZE",
)

# Bound of the rendezvous and of every collective, in seconds (scripts: --dist_timeout).
DEFAULT_TIMEOUT_S = 600.0
# The bound setup_dist gave the process group (timeout_s()).
_timeout_s = None


class DistMismatchError(UserError):
    """Ranks called a collective with different arguments (e.g. asked to load different files)."""


class DistLoadError(UserError):
    """The bytes of a file could be read, but torch.load refused them."""


class RendezvousError(UserError):
    """The ranks could not form a process group; the one-line message says what to set."""


class DeviceError(UserError):
    """This rank has no GPU of its own (more ranks on its host than visible GPUs, or two ranks
    on one GPU); the one-line message says how to start one rank per GPU."""


class RankLostError(UserError):
    """A collective failed because some rank died or ended; the message names the rank(s).

    ``lost``: ranks whose heartbeat stopped; ``ended``: {rank: state} of ranks that stopped on
    their own ("exited", "ended the job (cause)").
    """

    lost = ()
    ended = {}


# --------------------------------------------------------------------------------------------
# setup


def _launched_by_mpi():
    return any(v in os.environ for v in _MPI_LAUNCHER_VARS)


def _mpi_comm():
    """mpi4py's COMM_WORLD when launched by an MPI launcher with more than one rank, else None."""
    if not _launched_by_mpi():
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() <= 1:
        return None
    return comm


def _default_backend():
    return "nccl" if th.cuda.is_available() else "gloo"


def _set_threads(local_world_size):
    """Give this rank's torch its share of the host's cores (``cpu_share``) when several ranks
    share the host and OMP_NUM_THREADS does not say otherwise; on a GPU host too, where
    otherwise every rank's host-side work (data, sampling noise) runs on all cores at once."""
    if local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        th.set_num_threads(cpu_share(local_world_size))


def _affinity():
    """The cores this process may run on (its CPU affinity; all cores where unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_share(local_world_size, affinity=None, host_cpus=None):
    """The cores one of ``local_world_size`` ranks on this host may use: its own affinity when a
    launcher bound it to fewer cores than the host has (``srun --cpus-per-task=6``: that is its
    share already), else the host's cores divided among the ranks; at least 1."""
    affinity = _affinity() if affinity is None else affinity
    host_cpus = (os.cpu_count() or affinity) if host_cpus is None else host_cpus
    if affinity < host_cpus:
        return max(1, affinity)
    return max(1, affinity // max(1, local_world_size))


# Where launchers put a rank's index on its host, and the number of ranks there: (index variable,
# count variable), in order of preference. SLURM's count comes from its tasks-per-node list.
_LOCAL_RANK_VARS = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun (and setup_dist itself, once known)
    ("SLURM_LOCALID", None),  # srun
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Intel MPI (hydra)
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),  # MVAPICH2
)


def local_rank_from_env(env=None):
    """(local rank, ranks on this host or None when unknown) from the first launcher variable of
    _LOCAL_RANK_VARS present in ``env`` (default os.environ), else None."""
    env = os.environ if env is None else env
    for rank_var, size_var in _LOCAL_RANK_VARS:
        value = env.get(rank_var, "").strip()
        if not value:
            continue
        size = _slurm_tasks_on_this_node(env) if size_var is None else env.get(size_var, "")
        try:
            return int(value), int(size) if str(size or "").strip() else None
        except ValueError:
            raise DeviceError(f"{rank_var}={value!r} ({size_var}={size!r}): not an integer; "
                              f"check how the launcher sets it") from None
    return None


def _slurm_tasks_on_this_node(env):
    """The number of this step's tasks on this node from SLURM_STEP_TASKS_PER_NODE ("8(x4)" or
    "2(x3),1", indexed by SLURM_NODEID when the nodes differ), else None."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts = []
    for part in filter(None, spec.split(",")):
        n, _, times = part.partition("(x")
        try:
            counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
        except ValueError:
            return None
    if counts and all(c == counts[0] for c in counts):
        return counts[0]
    node = env.get("SLURM_NODEID", "")
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None


def local_device_index(local_rank, local_world, visible):
    """The CUDA device of the rank with index ``local_rank`` on its host (of ``local_world``
    ranks there; None when unknown) that sees ``visible`` GPUs: 0 when it sees only one (the
    launcher gave each rank its own, e.g. ``srun --gpus-per-task=1``; two ranks on one GPU are
    caught later, by ``_check_distinct_gpus``), else its local rank. Raises DeviceError when
    the host has more ranks than visible GPUs."""
    if visible == 1:
        return 0
    if local_rank < 0 or local_rank >= visible or (local_world or 0) > visible:
        ranks = (f"{local_world} ranks on this host" if local_world
                 else f"local rank {local_rank} on this host")
        raise DeviceError(
            f"{ranks} but {visible} GPUs visible to each (local rank {local_rank} has none of "
            f"its own); start at most one rank per GPU (torchrun --nproc_per_node {visible}, "
            f"srun --ntasks-per-node {visible}), or give each rank its own GPU (srun "
            f"--gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank)")
    return local_rank


# cuBLAS's workspace setting for reproducible results (NVIDIA's cuBLAS docs, "Results
# reproducibility"): read when cuBLAS makes its first handle.
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def set_deterministic(on):
    """``--deterministic True``: deterministic kernels wherever torch has them
    (``torch.use_deterministic_algorithms``, warning once for an op that has none), cuDNN's
    deterministic algorithms without autotuning, and cuBLAS's fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG``, unless set already); a ProcessGroupNCCL created afterwards
    also leaves out NCCL's NVLS all-reduce (recent torch), whose sums are not reproducible. Call
    before CUDA initialises and before the process group exists (train_job.start_job calls it
    first). ``on`` False: nothing changes (torch's defaults: fast, not reproducible on a GPU)."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    th.use_deterministic_algorithms(True, warn_only=True)
    th.backends.cudnn.deterministic = True
    th.backends.cudnn.benchmark = False


def as_timedelta(timeout):
    """``timeout`` (seconds, int/float, or a timedelta) as a timedelta; must be finite and > 0."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"timeout must be a number of seconds > 0 (got {timeout!r})")
    return datetime.timedelta(seconds=float(seconds))


def setup_dist(backend=None, *, timeout=DEFAULT_TIMEOUT_S):
    """
    Set up the process group if this process is one of several; idempotent.

    torchrun env vars -> the ``env://`` store with a per-restart prefix; else mpi4py under an MPI
    launcher with size > 1 -> TCP store rendezvous (host/port broadcast over MPI, see the module
    docstring); else nothing (single process, no process group). ``timeout`` (seconds, or a
    timedelta) bounds the rendezvous and every later collective, so a rank that never arrives or
    dies fails the job instead of hanging it. Raises ``RendezvousError`` (the same one line on
    every rank) when the ranks cannot meet. Starts this rank's heartbeat (see ``diagnose_failure``).

    Collective: call from all ranks with the same arguments.
    """
    global _timeout_s
    if dist.is_available() and dist.is_initialized():
        return
    timeout = as_timedelta(timeout)
    _timeout_s = timeout.total_seconds()
    backend = backend or _default_backend()
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        world = int(env["WORLD_SIZE"])
        if world > 1:
            local = local_rank_from_env(env)
            if local is None and _mpi_comm() is not None:  # e.g. srun --mpi=pmi2 of an MPI
                local = _mpi_local_split(_mpi_comm())
            if local is not None:
                _select_device(local[0], local[1])
            dist.init_process_group(backend=backend, store=_attempt_store(timeout),
                                    rank=int(env["RANK"]), world_size=world, timeout=timeout)
            atexit.register(_cleanup_at_exit)
            if local is None:  # no launcher said it: count the ranks of this host in the store
                local = _store_local_split(_launch_store("local"), world, timeout)
                _select_device(local[0], local[1])
            _set_threads(local[1] or world)
            _after_init(timeout, local[1])
        return

    comm = _mpi_comm()
    if comm is None:
        return  # single process: no process group

    from mpi4py import MPI

    rank, world = comm.Get_rank(), comm.Get_size()
    local_rank, local_world = _mpi_local_split(comm)
    store = _mpi_rendezvous(comm, timeout)

    if "LOCAL_RANK" in env:
        local_rank = int(env["LOCAL_RANK"])
    # every rank learns the first rank's device error: all raise it, none waits in a collective
    errors = [e for e in comm.allgather(_device_problem(local_rank, local_world)) if e]
    if errors:
        raise DeviceError(errors[0])
    _select_device(local_rank, local_world)
    _set_threads(local_world)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                            timeout=timeout)
    # Registered after mpi4py's MPI_Finalize hook, so it runs first (atexit is LIFO).
    atexit.register(_cleanup_at_exit)
    _after_init(timeout, local_world)


def _mpi_local_split(comm):
    """(this rank's index, the number of ranks) among the ranks of ``comm`` that share its host
    (MPI's shared-memory split). Collective (MPI)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def _after_init(timeout, local_world):
    """What every rank does once its process group exists: check that no two ranks drive one
    GPU (raises DeviceError on the ranks that share one), then start the heartbeat."""
    _start_heartbeat(timeout)
    if th.cuda.is_available() and (local_world or 2) > 1:
        uuid = _gpu_uuid(th.cuda.current_device())
        if uuid is not None:
            _check_distinct_gpus(_launch_store("gpus"), get_world_size(), get_rank(), uuid,
                                 timeout)


def _attempt_store(timeout):
    """
    The store of this launch under torchrun (``env://``: MASTER_ADDR/MASTER_PORT), seen through
    a prefix of its own restart (``TORCHELASTIC_RESTART_COUNT``). torchrun's agent keeps one
    store across the restarts of ``--max_restarts``, so without the prefix the restarted ranks
    would read the previous attempt's keys (its ranks' addresses, its barrier counts) and gloo
    would connect to the dead ranks ("connectFullMesh failed ... Connection refused"), or hang.
    """
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(_store_prefix(), store)


# --------------------------------------------------------------------------------------------
# rendezvous under mpiexec


def _attempt(fn):
    """("ok", fn()) or ("err", one-line message): something that can travel over MPI."""
    try:
        return "ok", fn()
    except Exception as e:  # sent to every rank, which all raise it
        return "err", typed_one_line(e)


def _mpi_rendezvous(comm, timeout):
    """
    Open the TCP store: rank 0 serves it, the others connect; host and port travel over MPI.
    Every failure (on any rank, at any stage) raises the same RendezvousError on every rank.

    Collective (MPI): call from all ranks with the same arguments.
    """
    rank, world = comm.Get_rank(), comm.Get_size()
    seconds = timeout.total_seconds()
    infos = comm.allgather(_attempt(lambda: _bounded(_host_info, seconds, "looking up this host")))
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


def _bounded(fn, seconds, what):
    """``fn()`` in a daemon thread, waited for at most ``seconds`` (name lookups can hang)."""
    box = {}

    def run():
        try:
            box["ok"] = fn()
        except Exception as e:
            box["err"] = e

    t = threading.Thread(target=run, name="dist-lookup", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"{what} took more than {seconds:g} s")
    if "err" in box:
        raise box["err"]
    return box["ok"]


def _host_info():
    """{"host": this host's name, "addrs": its non-loopback IPv4 addresses (interfaces first),
    "stack": its network stack (``_network_stack()``)}."""
    name = socket.gethostname()
    addrs = _interface_addresses()
    try:
        addrs += [a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)]
    except OSError:
        pass
    return {"host": name, "addrs": _dedup(a for a in addrs if _reachable_kind(a)),
            "stack": _network_stack()}


def _boot_id():
    """The running kernel's boot id (Linux), different on every machine; None where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _network_stack():
    """Which network stack this process uses: "<boot id>/<network namespace inode>" (Linux), so
    two ranks can share 127.0.0.1 exactly when theirs are equal, whatever their host names say
    (two machines, or two containers, may carry the same name); None where unknown."""
    boot = _boot_id()
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


# This process's CUDA device index once setup_dist chose it (dev() returns it), else None.
_device_index = None


def _device_problem(local_rank, local_world):
    """The DeviceError message local_device_index gives this rank, else None."""
    try:
        if th.cuda.is_available():
            local_device_index(local_rank, local_world, th.cuda.device_count())
    except DeviceError as e:
        return str(e)
    return None


def _select_device(local_rank, local_world):
    """Make cuda:(local_device_index(...)) this process's device (no-op without CUDA); records
    the local rank and count (LOCAL_RANK, LOCAL_WORLD_SIZE) for get_local_rank() and
    get_local_world_size()."""
    global _device_index
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if local_world:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(local_world))
    if th.cuda.is_available():
        _device_index = local_device_index(local_rank, local_world, th.cuda.device_count())
        th.cuda.set_device(_device_index)


def _store_prefix():
    """The prefix of this launch's keys in the process group's store (a torchrun restart does
    not read the last attempt's)."""
    return "improved_diffusion/{}/{}/".format(os.environ.get("TORCHELASTIC_RUN_ID", "job"),
                                              os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _wait_for_all(store, key, world, timeout):
    """Add this rank to the counter ``key`` of ``store``, then wait (bounded by ``timeout``, a
    timedelta) until all ``world`` ranks have. Not a collective of the process group."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.01
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"not all {world} ranks reached the start within {timeout.total_seconds():g} s "
                f"(--dist_timeout); check that every rank was started")
        time.sleep(pause)
        pause = min(0.2, pause * 2)


def _launch_store(name):
    """The process group's store, under this launch's prefix and ``name``."""
    return dist.PrefixStore(f"{_store_prefix()}{name}/",
                            dist.distributed_c10d._get_default_store())


def _store_local_split(store, world, timeout):
    """(this rank's index among the ranks of its host, their number), counted in ``store``
    (each rank adds itself under its host's network stack, in arrival order): for a launcher
    that sets no local-rank variable. Collective: call from all ``world`` ranks."""
    host = _network_stack() or socket.gethostname()
    mine = store.add(f"host/{host}", 1) - 1
    _wait_for_all(store, "arrived", world, timeout)
    return mine, store.add(f"host/{host}", 0)


def _check_distinct_gpus(store, world, rank, uuid, timeout):
    """Raise DeviceError on the ranks whose GPU (``uuid``) another rank drives too: a launcher
    that shows each rank "its" GPU as cuda:0 may show two ranks the same one, which NCCL reports
    only at the first collective ("Duplicate GPU detected"). Collective: call from all
    ``world`` ranks, through ``store``."""
    store.add(f"uuid/{uuid}", 1)
    _wait_for_all(store, "arrived", world, timeout)
    sharing = store.add(f"uuid/{uuid}", 0)
    if sharing > 1:
        raise DeviceError(
            f"{sharing} ranks drive the same GPU ({uuid}; rank {rank} is one); start at most one "
            f"rank per GPU, or give each rank its own GPU (srun --gpus-per-task=1, or "
            f"CUDA_VISIBLE_DEVICES per rank)")


def _gpu_uuid(index):
    """The UUID of CUDA device ``index`` as text, None where torch does not report it."""
    uuid = getattr(th.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


def _cleanup_at_exit():
    # Without this, gloo's teardown at interpreter exit sometimes aborts the process
    # ("terminate called without an active exception", exit signal 6) after a clean run.
    try:
        cleanup()
    except Exception:
        pass


def cleanup():
    """
    Stop this rank's heartbeat and destroy the process group (if any).

    Collective: call from all ranks with the same arguments.
    """
    _stop_heartbeat("exited")
    if is_distributed():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# heartbeat: naming the ranks that died


def heartbeat_interval(timeout_s):
    """Seconds between two heartbeats of a rank, for a process group bounded by ``timeout_s``."""
    return min(5.0, max(0.5, float(timeout_s) / 60.0))


def watch_window(timeout_s):
    """Seconds without a beat after which a watching heartbeat (NCCL) takes its neighbour for
    lost: a few beats, and longer with a long ``timeout_s`` (a GIL held for a while delays a beat),
    but well within the timeout, before NCCL's watchdog acts."""
    interval = heartbeat_interval(timeout_s)
    return max(2.5 * interval + 0.5, min(0.25 * float(timeout_s), 30.0))


# Bound of one store operation made outside a collective (heartbeat marks, first_to_report,
# the count of failed ranks): a healthy store answers in milliseconds.
_STORE_CALL_S = 5.0


class _Heartbeat:
    """
    A daemon thread that adds 1 to ``beat/{rank}`` in the process group's TCP store every
    ``interval`` seconds, through its own connection; ``state/{rank}`` says why a rank stopped
    ("exited", or "ended: cause" from ``end_job_after_error``). Keys live under a prefix of this
    launch, so a torchrun restart does not read the last attempt's beats.

    With ``on_lost`` (NCCL, whose collectives do not raise in the host thread: its watchdog
    aborts the process at the timeout), the thread also watches the next rank's beats (one store
    read per beat, ring order) and the job's ``lost`` key: when the neighbour has not beaten for
    ``watch_window`` seconds and recorded no state, or another rank found a loss, it calls
    ``on_lost(RankLostError naming every lost rank)`` once, from this thread.
    """

    def __init__(self, host, port, rank, world, timeout_s, on_lost=None):
        self.host, self.port, self.rank, self.world = host, port, rank, world
        self.interval = heartbeat_interval(timeout_s)
        self.window = watch_window(timeout_s)
        self._on_lost = on_lost if world > 1 else None
        self._neighbour = (rank + 1) % world
        self._last_beat = (None, time.monotonic())  # the neighbour's count, when it changed
        self.prefix = _store_prefix() + "heartbeat/"
        self._lock = threading.Lock()
        self.store_lost = False  # set once peer_states found the store unreachable
        self._stop = threading.Event()
        self._client = self.connect(max(10.0, 3 * self.interval))
        self._client.add(f"beat/{rank}", 1)  # the first beat before returning from setup
        self._thread = threading.Thread(target=self._run, name="dist-heartbeat", daemon=True)
        self._thread.start()

    def connect(self, timeout_s):
        client = dist.TCPStore(self.host, self.port, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        return dist.PrefixStore(self.prefix, client)

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                with self._lock:
                    self._client.add(f"beat/{self.rank}", 1)
                    found = self._on_lost is not None and self._look_for_loss()
            except Exception:
                return  # the store is gone: the collectives will say so
            if found:
                self._report_loss(found)
                return

    def _look_for_loss(self):
        """(Under the lock.) The job's recorded loss, or "neighbour" when the watched rank has
        not beaten for the window and recorded no state; else None."""
        if self._client.check(["lost"]):
            return self._client.get("lost").decode()
        count = self._client.add(f"beat/{self._neighbour}", 0)
        now = time.monotonic()
        if count != self._last_beat[0]:
            self._last_beat = (count, now)
            return None
        if now - self._last_beat[1] < self.window:
            return None
        if self._client.check([f"state/{self._neighbour}"]):  # it stopped on purpose
            self._on_lost = None  # (exited, or ended the job itself, which names its cause)
            return None
        return "neighbour"

    def _report_loss(self, found):
        """Name every lost rank (the first rank to find the loss records the line for all), then
        hand it to on_lost."""
        if found == "neighbour":
            states = peer_states(self.window, hb=self)
            lost = sorted(r for r, st in states.items() if st == "lost") or [self._neighbour]
            message = (f"lost rank(s) {', '.join(map(str, lost))}: no heartbeat for "
                       f"{self.window:.1f} s (the process or its host died)")
            found = f"{','.join(map(str, lost))}|{message}"
            try:  # the first rank's finding is the job's (the others read it at their next beat)
                found = self.call(lambda c: c.compare_set("lost", "", found)).decode()
            except Exception:
                pass
        ranks, _, message = found.partition("|")
        err = RankLostError(f"{message}; ending the job (found by the heartbeats)")
        err.lost = [int(r) for r in ranks.split(",") if r]
        self._on_lost(err)

    def call(self, fn, seconds=_STORE_CALL_S):
        """``fn(client)`` under the lock, waited for at most ``seconds``: an operation on a store
        whose host became unreachable (cable pulled, host powered off) does not honour the
        store's timeout and can block for many minutes, holding the lock. Raises TimeoutError
        when the bound passes. Not collective."""
        if self.store_lost:
            raise ConnectionError(f"the store at {self.host}:{self.port} is unreachable")

        def locked():
            if not self._lock.acquire(timeout=seconds):
                raise TimeoutError("the heartbeat's store connection is busy")
            try:
                return fn(self._client)
            finally:
                self._lock.release()

        return _bounded(locked, seconds, "a heartbeat store operation")

    def mark(self, state, seconds=_STORE_CALL_S):
        """Record why this rank stops (best effort, bounded by ``seconds``)."""
        try:
            self.call(lambda c: c.set(f"state/{self.rank}", state), seconds)
        except Exception:
            pass

    def stop(self, state):
        self._stop.set()
        self._thread.join(self.interval + 1.0)
        self.mark(state)


_heartbeat = None


def _end_job_for_lost_ranks(error):
    """What a watching heartbeat (NCCL) does with a loss, as after a failed collective on gloo:
    the line naming the lost ranks (printed once for the job, then handed to the line hook), then
    every rank ends with exit 1."""
    message = str(error)
    if first_to_report("lost"):
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    if _error_line_hook is not None:
        _error_line_hook(message)
    end_job_after_error(1, cause=message, lost=error.lost)


_error_line_hook = None


def set_error_line_hook(hook):
    """``hook(message)`` is called (in the heartbeat thread) with the error line of a job that
    the heartbeats end (NCCL: a lost rank); cli.run_main writes it to the log files."""
    global _error_line_hook
    _error_line_hook = hook


def _start_heartbeat(timeout):
    """Start this rank's heartbeat when the process group's store is a TCPStore (best effort);
    on NCCL it also watches for lost ranks (see _Heartbeat)."""
    global _heartbeat
    _stop_heartbeat("restarted")
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return
    host = "127.0.0.1" if store.host in ("", "0.0.0.0", "::") else store.host
    try:
        watch = dist.get_backend() == "nccl"
        _heartbeat = _Heartbeat(host, store.port, get_rank(), get_world_size(),
                                timeout.total_seconds(),
                                on_lost=_end_job_for_lost_ranks if watch else None)
    except Exception:
        _heartbeat = None  # no heartbeat: failures are still bounded by the timeout


def _stop_heartbeat(state):
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop(state)
        _heartbeat = None


def peer_states(window_s=None, hb=None):
    """
    What became of the other ranks, from their heartbeats: ``{rank: state}`` for each rank that
    did not beat within ``window_s`` (default 2.5 heartbeat intervals): "lost" (no beat: the
    process or its host died) or the state it recorded ("exited", "ended: cause"). Ranks still
    beating are left out. Raises ``RankLostError`` when the store itself is unreachable (its host,
    rank 0's under mpiexec, is gone). {} without a heartbeat. ``hb``: the heartbeat to ask
    through (default this rank's). Not collective.
    """
    hb = _heartbeat if hb is None else hb
    if hb is None:
        return {}
    window = window_s if window_s is not None else 2.5 * hb.interval + 0.5
    others = [r for r in range(hb.world) if r != hb.rank]

    def look():
        client = hb.connect(window + 5.0)
        seen = {r: client.add(f"beat/{r}", 0) for r in others}
        deadline = time.monotonic() + window
        quiet = set(others)
        while quiet and time.monotonic() < deadline:
            time.sleep(min(0.2, hb.interval))
            quiet = {r for r in quiet if client.add(f"beat/{r}", 0) == seen[r]}
        states = {}
        for r in sorted(quiet):
            key = f"state/{r}"
            states[r] = client.get(key).decode() if client.check([key]) else "lost"
        return states

    try:
        # bounded: a store whose host went silent mid-way would not answer (see _Heartbeat.call)
        return _bounded(look, 2 * window + 10.0 + 2 * _STORE_CALL_S, "reading the heartbeats")
    except Exception as e:
        hb.store_lost = True  # later store calls of this rank fail at once
        raise RankLostError(
            f"the process group's store at {hb.host}:{hb.port} is unreachable "
            f"({type(e).__name__}): the rank that holds it (rank 0 under mpiexec; the rendezvous "
            f"host under torchrun) or its host is lost") from None


def diagnose_failure(error):
    """
    After ``error`` (a collective that raised, e.g. gloo's "Connection reset by peer", or a
    timeout): ``RankLostError`` naming the ranks that died or ended, or None when every other rank
    is still alive (``error`` is then something else). Waits up to a few heartbeat intervals.
    Not collective.
    """
    if _heartbeat is None:
        return None
    cause = " ".join(str(error).split())[:160] or type(error).__name__
    try:
        states = peer_states()
    except RankLostError as e:
        return RankLostError(f"{e} (the collective failed with: {cause})")
    lost = [r for r, s in states.items() if s == "lost"]
    ended = {r: s for r, s in states.items() if s != "lost"}
    if not lost and not ended:
        return None
    parts = []
    if lost:
        parts.append(f"lost rank(s) {', '.join(map(str, lost))}: no heartbeat for "
                     f"{2.5 * _heartbeat.interval + 0.5:.1f} s (the process or its host died)")
    for r, s in ended.items():
        parts.append(f"rank {r} {s}")
    err = RankLostError("; ".join(parts) + f"; the collective failed with: {cause}")
    err.lost = lost
    err.ended = ended
    return err


_COMM_FAILURE_WORDS = ("gloo", "nccl", "connection", "peer", "timed out", "timeout", "socket",
                       "broken pipe", "store")


def looks_like_comm_failure(error):
    """True for what a collective raises when a peer is gone or late (torch's DistError, or the
    RuntimeError gloo raises: "Connection reset by peer", "Timed out waiting ...")."""
    if isinstance(error, (dist.DistError, ConnectionError, TimeoutError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in _COMM_FAILURE_WORDS)


def first_to_report(topic):
    """True on the first rank that asks about ``topic`` (best effort: True without a store), so a
    cause shared by several ranks is printed once. Not collective."""
    hb = _heartbeat
    if hb is None or not is_distributed():
        return True
    try:
        return hb.call(lambda c: c.add(f"first_to_report/{topic}", 1)) == 1
    except Exception:
        return True


def mark_ending(cause, seconds=_STORE_CALL_S):
    """Record in this rank's heartbeat state that it ends the job (``cause``: one line), so that
    the other ranks can name it (``diagnose_failure``: "rank R ended the job (cause)"). Best
    effort, bounded by ``seconds``; safe from any thread. Not collective."""
    if _heartbeat is not None:
        _heartbeat.mark(f"ended the job ({cause})", seconds)


def end_job_after_error(code, wait_s=10.0, *, cause=None, lost=()):
    """
    After an error on this rank: if every rank failed (errors of the resume are raised on all
    ranks alike, since its decisions are broadcast), return so each exits normally; if the other
    ranks did not fail within ``wait_s`` (say, an unreadable image in one rank's batch, or a
    KeyboardInterrupt on one rank), they would stay blocked in a collective, so abort the whole
    job with exit ``code`` (MPI_Abort under mpiexec; under torchrun this rank's exit makes the
    launcher stop the rest). ``lost``: ranks known dead (not waited for). ``cause`` (one line) is
    recorded in this rank's heartbeat state, so the other ranks can name it.

    Failing ranks count themselves in the process group's store; no collective is entered, so
    this is safe to call from any rank at any point. No-op without a process group.
    """
    if not is_distributed():
        return
    mark_ending(cause or f"exit {code}")
    world = get_world_size()
    expected = world - len(set(lost))
    reached = []

    def count_and_wait():
        store = dist.distributed_c10d._get_default_store()
        store.add("end_job_after_error/failed", 1)
        reached.append(True)
        deadline = time.time() + wait_s
        while store.add("end_job_after_error/failed", 0) < expected:
            if time.time() > deadline:
                raise TimeoutError
            time.sleep(0.1)
        store.add("end_job_after_error/left", 1)
        while get_rank() == 0 and store.add("end_job_after_error/left", 0) < expected:
            if time.time() > deadline + wait_s:  # rank 0 holds the store: let the others read
                break
            time.sleep(0.05)

    try:
        if _heartbeat is not None and _heartbeat.store_lost:
            raise ConnectionError("the process group's store is unreachable")
        # bounded as a whole: the store's host may be unreachable (see _Heartbeat.call)
        _bounded(count_and_wait, 2 * wait_s + _STORE_CALL_S, "counting the failed ranks")
        if not lost:
            return
    except Exception:
        pass
    if lost:
        sys.stderr.write(f"note: ending the job ({len(set(lost))} of {world} ranks lost)\n")
    elif not reached:
        sys.stderr.write(f"note: the process group's store cannot be reached; ending this rank "
                         f"(of {world})\n")
    else:
        sys.stderr.write(f"note: the other ranks did not fail; aborting all {world} ranks\n")
    sys.stderr.flush()
    _abort(code)


def _abort(code):
    if _launched_by_mpi():
        try:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(code)
        except ImportError:
            pass
    os._exit(code)


# --------------------------------------------------------------------------------------------
# queries


def is_distributed():
    """True when a torch.distributed process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def timeout_s():
    """Seconds that bound every collective of the process group (``--dist_timeout``): how long a
    rank may wait for the others. None without a process group; DEFAULT_TIMEOUT_S for a group
    that setup_dist did not make."""
    if not is_distributed():
        return None
    return _timeout_s if _timeout_s is not None else DEFAULT_TIMEOUT_S


def get_rank():
    return dist.get_rank() if is_distributed() else 0


def get_world_size():
    return dist.get_world_size() if is_distributed() else 1


def get_local_rank():
    """This rank's index on its host (local_rank_from_env: set by the launcher, or by setup_dist
    once it counted the host's ranks), else 0."""
    local = local_rank_from_env()
    return local[0] if local is not None else 0


def get_local_world_size():
    """The number of ranks on this host (as get_local_rank), else 1."""
    local = local_rank_from_env()
    return local[1] if local is not None and local[1] else 1


def dev():
    """This rank's device: the CUDA device setup_dist chose (see local_device_index; in a single
    process, from the local rank of the environment) when CUDA is available, else cpu."""
    if th.cuda.is_available():
        if _device_index is not None:
            return th.device(f"cuda:{_device_index}")
        local = local_rank_from_env() or (0, None)
        return th.device(f"cuda:{local_device_index(local[0], local[1], th.cuda.device_count())}")
    return th.device("cpu")


def _comm_device():
    """Where tensors must live for collectives of the current backend."""
    if is_distributed() and dist.get_backend() == "nccl":
        return dev()
    return th.device("cpu")


# --------------------------------------------------------------------------------------------
# collectives (identity / no-op without a process group)


def barrier():
    """
    Wait for all ranks.

    Collective: call from all ranks with the same arguments.
    """
    if is_distributed():
        dist.barrier()


def broadcast_object(obj, src=0):
    """
    Return rank ``src``'s picklable ``obj`` on every rank.

    Collective: call from all ranks with the same arguments.
    """
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def run_on_rank0(fn):
    """
    Run ``fn()`` on rank 0 only; every rank returns its result, or raises its exception (one that
    cannot be pickled travels as a RuntimeError with its message), so a decision or an error made
    on rank 0 is the same on all ranks and none is left waiting.

    Collective: call from all ranks with the same arguments.
    """
    result = _outcome(fn) if get_rank() == 0 else None
    return _raise_or_return(broadcast_object(result))


def _outcome(fn):
    """("ok", fn()) or ("err", its exception, picklable): rank 0's part of run_on_rank0."""
    try:
        return "ok", fn()
    except Exception as e:  # re-raised on every rank by _raise_or_return
        return "err", _picklable(e)


def _raise_or_return(outcome):
    kind, value = outcome
    if kind == "err":
        raise value
    return value


_long_waits = 0  # run_on_rank0_unbounded calls so far (the same count on every rank)


def run_on_rank0_unbounded(fn, what="rank 0's work"):
    """
    ``run_on_rank0(fn)`` for work that may take longer than ``--dist_timeout`` (a synchronous
    save of a big model, a wait for a background write on slow storage): the other ranks first
    wait for rank 0 through the process group's store, for as long as rank 0's heartbeat goes
    on, then take the result by the usual broadcast. The wait stays bounded by the dead-rank
    rule instead of the timeout: a rank 0 that died is named (RankLostError) once it has not
    beaten for the heartbeat's window. Without a heartbeat (a process group whose store is not
    a TCPStore) it is ``run_on_rank0``.

    Collective: call from all ranks with the same arguments.
    """
    global _long_waits
    hb = _heartbeat
    if not is_distributed() or hb is None:
        return run_on_rank0(fn)
    _long_waits += 1
    key = f"done/{_long_waits}"
    result = None
    if get_rank() == 0:
        result = _outcome(fn)
        try:
            hb.call(lambda c: c.set(key, "1"))
        except Exception:
            pass  # the broadcast below reports a store or rank that is gone
    else:
        _wait_for_rank0(hb, key, what)
    return _raise_or_return(broadcast_object(result))


def _wait_for_rank0(hb, key, what):
    """Until rank 0 sets ``key`` in the store (run_on_rank0_unbounded); RankLostError once rank 0
    has not beaten for the heartbeat's window. Not collective."""
    beats, since = None, time.monotonic()
    pause = 0.01
    while True:
        done, count, ended = hb.call(lambda c: (c.check([key]), c.add("beat/0", 0),
                                                c.check(["state/0"])))
        if done:
            return
        now = time.monotonic()
        if ended:  # rank 0 stopped on purpose (an error it reports itself): the job ends
            state = hb.call(lambda c: c.get("state/0")).decode()
            err = RankLostError(f"rank 0 {state} during {what}")
            err.ended = {0: state}
            raise err
        if count != beats:
            beats, since = count, now
        elif now - since > hb.window:
            err = RankLostError(f"lost rank 0 during {what}: no heartbeat for {hb.window:.1f} s "
                                f"(the process or its host died)")
            err.lost = [0]
            raise err
        time.sleep(pause)
        pause = min(0.2, pause * 2)


def _picklable(e):
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(typed_one_line(e))


def all_gather_object(obj):
    """
    Return a list (indexed by rank) of every rank's picklable ``obj``.

    Collective: call from all ranks with the same arguments.
    """
    if not is_distributed():
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_object(obj, dst=0):
    """
    Every rank's picklable ``obj`` as a list indexed by rank, on rank ``dst`` only (None on the
    others): the other ranks send, only ``dst`` receives and holds them.

    Collective: call from all ranks with the same ``dst``.
    """
    if not is_distributed():
        return [obj]
    out = [None] * get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def any_rank(flag):
    """
    True on every rank if ``flag`` is true on any rank.

    Collective: call from all ranks with the same arguments.
    """
    if not is_distributed():
        return bool(flag)
    t = th.tensor([1 if flag else 0], dtype=th.int32, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class _PendingFlags:
    """The result of any_rank_async: wait() -> [bool], each True if set on any rank."""

    def __init__(self, tensor, work):
        self._tensor, self._work = tensor, work

    def wait(self):
        if self._work is not None:
            self._work.wait()  # bounded by the process group's timeout (--dist_timeout)
        return [bool(x) for x in self._tensor.tolist()]


def any_rank_async(flags):
    """
    Start an all-reduce (MAX) of a list of booleans without waiting for it; the returned
    object's wait() gives, for each flag, whether it was set on any rank. The exchange runs
    while the caller works (a step), so no rank blocks on it until wait().

    Collective: call from all ranks with lists of the same length, then wait() on all ranks.
    """
    t = th.tensor([1 if f else 0 for f in flags], dtype=th.int32, device=_comm_device())
    if not is_distributed():
        return _PendingFlags(t, None)
    return _PendingFlags(t, dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))


def all_reduce_mean(tensor):
    """
    Average ``tensor`` over ranks, in place; returns it.

    Collective: call from all ranks with the same arguments.
    """
    if not is_distributed():
        return tensor
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor.div_(get_world_size())
    return tensor


def sync_params(params):
    """
    Copy rank 0's values of ``params`` (iterable of tensors) to every rank, in place.

    Collective: call from all ranks with the same arguments.
    """
    if not is_distributed():
        return
    with th.no_grad():
        for p in params:
            dist.broadcast(p.data if hasattr(p, "data") else p, 0)


def _broadcast_bytes(data, nbytes):
    """Broadcast ``data`` (bytes-like on rank 0, ignored elsewhere) of length ``nbytes`` from rank
    0, in pieces of at most _CHUNK_BYTES; the other ranks receive straight into one preallocated
    bytearray. Returns rank 0's ``data`` itself, the bytearray elsewhere (no other copy). On a
    GPU backend (NCCL) each piece travels through one device buffer: rank 0 copies its piece in,
    the others receive into it as it is (never a host piece copied up first) and copy it out."""
    device = _comm_device()
    rank = get_rank()
    buf = data if rank == 0 else bytearray(nbytes)
    if nbytes == 0:
        return buf
    with warnings.catch_warnings():  # rank 0's bytes are only read (the source of a broadcast)
        warnings.simplefilter("ignore")
        host = th.frombuffer(buf, dtype=th.uint8)
    on_device = None
    for start in range(0, nbytes, _CHUNK_BYTES):
        piece = host[start:start + _CHUNK_BYTES]
        if device.type == "cpu":
            dist.broadcast(piece, 0)
            continue
        if on_device is None:
            on_device = th.empty(min(nbytes, _CHUNK_BYTES), dtype=th.uint8, device=device)
        moved = on_device[:piece.numel()]
        if rank == 0:
            moved.copy_(piece)
        dist.broadcast(moved, 0)
        if rank != 0:
            piece.copy_(moved)
    return buf


_ERROR_TYPES = {
    "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError,
    "PermissionError": PermissionError,
}


def _read_error(path, e):
    """(error type name, one-line message naming ``path``) of a failed open or read."""
    if isinstance(e, FileNotFoundError):
        return "FileNotFoundError", f"{path}: no such file; check the path"
    if isinstance(e, IsADirectoryError):
        return ("IsADirectoryError",
                f"{path}: is a directory, not a checkpoint file; give the path of a file")
    if isinstance(e, PermissionError):
        return "PermissionError", f"{path}: permission denied; check the file's permissions"
    msg = " ".join(str(e).split()) or type(e).__name__
    return "OSError", f"{path}: cannot read ({type(e).__name__}: {msg})"


# What a failed open or read of a checkpoint raises (blobfile has its own types for remote paths).
_READ_FAILURES = (OSError, bf.Error, MemoryError)


def open_local(path):
    """Open ``path`` (local or blobfile URL) for reading in this process (not collective);
    returns (binary file, None) or (None, (error type name, one-line message naming the path)),
    the messages of read_local."""
    try:
        if bf.isdir(path):
            return None, _read_error(path, IsADirectoryError())
        return bf.BlobFile(path, "rb"), None
    except _READ_FAILURES as e:
        return None, _read_error(path, e)


def read_local(path):
    """Read ``path`` via blobfile in this process (not collective); returns (bytes, None) or
    (None, (error type name, one-line message naming the path))."""
    f, err = open_local(path)
    if err is not None:
        return None, err
    try:
        with f:
            return f.read(), None
    except _READ_FAILURES as e:
        return None, _read_error(path, e)


def machine_id():
    """Which machine (running kernel) this process is on: its boot id, else its host name. Two
    processes with the same machine_id see one file where (st_dev, st_ino) agree; host names
    alone cannot tell (two machines may carry the same name, as for _network_stack)."""
    return _boot_id() or socket.gethostname()


def _raise_read_error(err):
    kind, message = err
    raise _ERROR_TYPES.get(kind, OSError)(message)


def load_bytes(path):
    """
    Return the bytes of ``path`` (local or blobfile URL) on every rank; rank 0 reads, then
    broadcasts them in bounded pieces straight into one preallocated buffer on the other ranks
    (a bytes-like object: ``bytes`` on rank 0, a ``bytearray`` elsewhere; memory: the file once).

    All ranks first compare the path they were given: if they differ, every rank raises
    ``DistMismatchError`` naming each rank's path (never a hang, never the wrong bytes). A read
    error on rank 0 is broadcast, so every rank raises the same ``FileNotFoundError`` /
    ``IsADirectoryError`` / ``PermissionError`` / ``OSError`` with the same one-line message.

    Collective: call from all ranks with the same arguments.
    """
    path = os.fspath(path)
    if not is_distributed():
        data, err = read_local(path)
        if err is not None:
            _raise_read_error(err)
        return data
    check_same_path(all_gather_object(path))
    if get_rank() == 0:
        data, err = read_local(path)
        header = (len(data) if err is None else -1, err)
    else:
        data, header = None, None
    header = broadcast_object(header)
    nbytes, err = header
    if err is not None:
        _raise_read_error(err)
    return _broadcast_bytes(data, nbytes)


def check_same_path(paths):
    """Raise DistMismatchError naming each rank's path unless all of ``paths`` (one per rank,
    from all_gather_object) are the same. Not collective."""
    if any(p != paths[0] for p in paths):
        listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise DistMismatchError(
            f"ranks asked to load different files ({listing}); every rank must load the same file"
        )


def load_state_dict(path, **kwargs):
    """
    Upstream's name: load a torch file on every rank (rank 0 reads, broadcasts the bytes).

    Always ``torch.load(weights_only=True)`` (a file can never run code) onto ``map_location``
    (default ``"cpu"``; move tensors to ``dev()`` yourself). Raises what ``load_bytes`` raises, or
    ``DistLoadError`` (one line, naming the file) when the bytes are not a loadable torch file.

    Collective: call from all ranks with the same arguments.
    """
    data = load_bytes(path)
    kwargs.pop("weights_only", None)
    kwargs.setdefault("map_location", "cpu")
    try:
        return th.load(io.BytesIO(data), weights_only=True, **kwargs)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DistLoadError(
            f"{os.fspath(path)}: not a loadable torch checkpoint "
            f"({type(e).__name__}: {first[:200]})"
        ) from None


def all_gather_varlen(tensor):
    """
    Every rank's 1-D ``tensor`` (lengths may differ between ranks), as a list indexed by rank,
    each cut to its own length. Without a process group: ``[tensor]``.

    Collective: call from all ranks with the same arguments.
    """
    if not is_distributed():
        return [tensor]
    world = get_world_size()
    device = _comm_device()
    n = th.tensor([tensor.numel()], dtype=th.int64, device=device)
    sizes = [th.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = th.cat(sizes).tolist()  # one host transfer
    padded = th.zeros(max(sizes), dtype=tensor.dtype, device=device)
    padded[: tensor.numel()] = tensor.reshape(-1).to(device)
    out = [th.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return [t[:k].to(tensor.device) for t, k in zip(out, sizes)]
