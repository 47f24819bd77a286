"""Process-group setup and the few collectives the trainer needs.

Three ways to start:

* ``torchrun`` (env ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): the ``env://``
  store, behind a prefix of this restart (``TORCHELASTIC_RESTART_COUNT``), so that the ranks of
  a ``--max_restarts`` restart never read the keys of the attempt before.
* ``mpiexec -n N`` (mpi4py): MPI is used ONLY for the rendezvous (rank 0 opens a TCP store on a
  free port, or ``MASTER_PORT`` when set, and MPI-broadcasts host and port); every collective
  afterwards is torch.distributed. Which address: rendezvous.py (127.0.0.1 on one host,
  ``MASTER_ADDR`` or a reachable address of rank 0's host across hosts); any error of rank 0
  while finding the address or opening the store reaches every rank.
* a plain ``python`` process: no process group at all; every helper below degrades to the
  identity / a no-op, so single-process code paths need no special casing.

Every wait is bounded by ``timeout`` (``--dist_timeout``, default 600 s): the rendezvous, each
collective, and so a rank that dies. Each rank of a process group beats a heartbeat in the group's
TCP store (heartbeat.py, started by ``setup_dist``); when a collective fails,
``heartbeat.diagnose_failure`` names the ranks whose heartbeat stopped (``RankLostError``), so a
dead rank or host ends the job with a message naming it.

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
import math
import os
import pickle
import socket
import time
import warnings

import torch as th
import torch.distributed as dist

from .infra import heartbeat, rendezvous
from .infra.errors import UserError, typed_one_line
from .infra.rendezvous import RendezvousError

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


class DeviceError(UserError):
    """This rank has no GPU of its own (more ranks on its host than visible GPUs, or two ranks
    on one GPU); the one-line message says how to start one rank per GPU."""


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


def usable_cores():
    """The cores this process may run on (its CPU affinity; all cores where unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_share(local_world_size, affinity=None, host_cpus=None):
    """The cores one of ``local_world_size`` ranks on this host may use: its own affinity when a
    launcher bound it to fewer cores than the host has (``srun --cpus-per-task=6``: that is its
    share already), else the host's cores divided among the ranks; at least 1."""
    affinity = usable_cores() if affinity is None else affinity
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
    store = rendezvous.mpi_rendezvous(comm, timeout)

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
    heartbeat.start(timeout, _store_prefix())
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
    host = rendezvous.network_stack() or socket.gethostname()
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
    # A script that never called cleanup(): the same, before the interpreter's finalisation.
    try:
        cleanup()
    except Exception:
        pass


GIL_HANDOVER_S = 0.05  # cleanup()'s pause: see there


def cleanup():
    """
    Stop this rank's heartbeat and destroy the process group (if any), then pause
    GIL_HANDOVER_S with the GIL released.

    Why the pause: a gloo worker thread drops its finished collective (the tensors it held, whose
    Python objects it decrefs under the GIL) just after the caller's wait() has returned. When
    the main thread keeps the GIL from there to the interpreter's finalisation (a few ms of
    Python: this function, the script's return), the worker takes the GIL only once Python is
    finalising, which ends the thread inside C++ code: "terminate called without an active
    exception", signal 6, after a run that ended well (seen in about 1 run in 100 of a 2-rank
    job on a loaded machine; core dump: ProcessGroupGloo::runLoop -> ~AsyncBroadcastWork ->
    decref_pyobject -> take_gil -> PyThread_exit_thread). destroy_process_group does not
    always join those threads first: a DDP wrapper built on the group keeps it alive in C++
    after it and its module are gone (torch 2.13). The pause lets such a worker finish.

    Collective: call from all ranks with the same arguments.
    """
    heartbeat.stop("exited")
    if is_distributed():
        dist.destroy_process_group()
        time.sleep(GIL_HANDOVER_S)


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


def launch_world_size():
    """The number of ranks of this job, also before setup_dist: the process group's, else the
    launcher's (torchrun's WORLD_SIZE, an MPI launcher's size), else 1. Not collective."""
    if is_distributed():
        return get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    comm = _mpi_comm()
    return comm.Get_size() if comm is not None else 1


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
    rule instead of the timeout: a rank 0 that died is named (heartbeat.RankLostError) once it has not
    beaten for the heartbeat's window. Without a heartbeat (a process group whose store is not
    a TCPStore) it is ``run_on_rank0``.

    Collective: call from all ranks with the same arguments.
    """
    global _long_waits
    hb = heartbeat.current()
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
        heartbeat.wait_for_rank0(hb, key, what)
    return _raise_or_return(broadcast_object(result))


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


# What a failed open or read of a checkpoint raises (a store's errors are OSErrors: storage.py).
_READ_FAILURES = (OSError, MemoryError)


def open_local(path):
    """Open ``path`` (local or an object-store URL, through ckpt/storage.py) for reading in this
    process (not collective); returns (binary file, None) or (None, (error type name, one-line
    message naming the path)), the messages of read_local."""
    from .infra import storage

    try:
        if storage.isdir(path):
            return None, _read_error(path, IsADirectoryError())
        return storage.open(path, "rb"), None
    except _READ_FAILURES as e:
        return None, _read_error(path, e)


def read_local(path):
    """Read ``path`` (local or an object-store URL) in this process (not collective); returns
    (bytes, None) or (None, (error type name, one-line message naming the path))."""
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
    return rendezvous.boot_id() or socket.gethostname()


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
