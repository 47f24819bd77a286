"""Process-group setup and the few collectives the trainer needs.

Three ways to start:

* ``torchrun`` (env ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): ``env://``.
* ``mpiexec -n N`` (mpi4py): MPI is used ONLY for the rendezvous (rank 0 opens a TCP store on a
  free port and MPI-broadcasts host and port); every collective afterwards is torch.distributed.
* a plain ``python`` process: no process group at all; every helper below degrades to the
  identity / a no-op, so single-process code paths need no special casing.

Backend: ``nccl`` when CUDA is available, else ``gloo``. The device comes from the local rank
(``LOCAL_RANK``, else the MPI shared-memory split, else 0), never from a hard-coded GPU count.

No hidden global settings beyond the process-group state itself. Rules (docs/ARCHITECTURE.md): every
collective is called by every rank in the same order; each function that synchronises ranks says
"Collective: call from all ranks with the same arguments." in its docstring.
"""

import atexit
import datetime
import io
import os
import pickle
import socket
import sys
import time

import blobfile as bf
import torch as th
import torch.distributed as dist

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

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class DistMismatchError(RuntimeError):
    """Ranks called a collective with different arguments (e.g. asked to load different files)."""


class DistLoadError(RuntimeError):
    """The bytes of a file could be read, but torch.load refused them."""


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
    if local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ and not th.cuda.is_available():
        th.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def setup_dist(backend=None, *, timeout=DEFAULT_TIMEOUT):
    """
    Set up the process group if this process is one of several; idempotent.

    torchrun env vars -> ``init_process_group("env://")``; else mpi4py under an MPI launcher with
    size > 1 -> TCP store rendezvous (host/port broadcast over MPI); else nothing (single process,
    no process group). ``timeout`` bounds every later collective, so a rank that never arrives
    fails the job instead of hanging it forever.

    Collective: call from all ranks with the same arguments.
    """
    if dist.is_available() and dist.is_initialized():
        return
    backend = backend or _default_backend()
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        world = int(env["WORLD_SIZE"])
        if world > 1:
            local_rank = int(env.get("LOCAL_RANK", 0))
            _select_device(backend, local_rank)
            _set_threads(int(env.get("LOCAL_WORLD_SIZE", world)))
            dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
            atexit.register(_cleanup_at_exit)
        return

    comm = _mpi_comm()
    if comm is None:
        return  # single process: no process group

    from mpi4py import MPI

    rank, world = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_world = local.Get_rank(), local.Get_size()
    local.Free()
    hosts = comm.allgather(socket.gethostname())
    single_host = len(set(hosts)) == 1

    if rank == 0:
        host = "127.0.0.1" if single_host else _routable_address()
        try:
            store = dist.TCPStore(host if single_host else "0.0.0.0", 0, world, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
            info = (host, store.port, None)
        except Exception as e:  # broadcast so the other ranks do not wait forever
            store, info = None, (None, None, f"{type(e).__name__}: {e}")
    else:
        info = None
    host, port, err = comm.bcast(info, root=0)
    if err is not None:
        raise RuntimeError(f"rank 0 could not open the rendezvous store: {err}")
    if rank != 0:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)

    if "LOCAL_RANK" in env:
        local_rank = int(env["LOCAL_RANK"])
    _select_device(backend, local_rank)
    _set_threads(local_world)
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                            timeout=timeout)
    # Registered after mpi4py's MPI_Finalize hook, so it runs first (atexit is LIFO).
    atexit.register(_cleanup_at_exit)


def _routable_address():
    """An address of this host that other hosts can reach (best effort: its name's address)."""
    for name in (socket.getfqdn(), socket.gethostname()):
        try:
            return socket.gethostbyname(name)
        except OSError:
            continue
    raise RuntimeError(
        "cannot find this host's address for the multi-host rendezvous; launch with torchrun "
        "(MASTER_ADDR/MASTER_PORT) instead"
    )


def _select_device(backend, local_rank):
    if th.cuda.is_available():
        th.cuda.set_device(local_rank % th.cuda.device_count())


def _cleanup_at_exit():
    # Without this, gloo's teardown at interpreter exit sometimes aborts the process
    # ("terminate called without an active exception", exit signal 6) after a clean run.
    try:
        cleanup()
    except Exception:
        pass


def cleanup():
    """
    Destroy the process group (if any).

    Collective: call from all ranks with the same arguments.
    """
    if is_distributed():
        dist.destroy_process_group()


def end_job_after_error(code, wait_s=10.0):
    """
    After an error on this rank: if every rank failed (errors of the resume are raised on all
    ranks alike, since its decisions are broadcast), return so each exits normally; if the other
    ranks did not fail within ``wait_s`` (say, an unreadable image in one rank's batch), they
    would stay blocked in a collective, so abort the whole job with exit ``code`` (MPI_Abort under
    mpiexec; under torchrun this rank's exit makes the launcher stop the rest).

    Failing ranks count themselves in the process group's store; no collective is entered, so
    this is safe to call from any rank at any point. No-op without a process group.
    """
    if not is_distributed():
        return
    world = get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("end_job_after_error/failed", 1)
        deadline = time.time() + wait_s
        while store.add("end_job_after_error/failed", 0) < world:
            if time.time() > deadline:
                raise TimeoutError
            time.sleep(0.1)
        store.add("end_job_after_error/left", 1)
        while get_rank() == 0 and store.add("end_job_after_error/left", 0) < world:
            if time.time() > deadline + wait_s:  # rank 0 holds the store: let the others read
                break
            time.sleep(0.05)
        return
    except Exception:
        pass
    sys.stderr.write(f"note: the other ranks did not fail; aborting all {world} ranks\n")
    sys.stderr.flush()
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


def get_rank():
    return dist.get_rank() if is_distributed() else 0


def get_world_size():
    return dist.get_world_size() if is_distributed() else 1


def get_local_rank():
    """LOCAL_RANK (set by torchrun, or by setup_dist under mpiexec), else 0."""
    return int(os.environ.get("LOCAL_RANK", 0))


def dev():
    """This rank's device: cuda:(local_rank % device_count) when CUDA is available, else cpu."""
    if th.cuda.is_available():
        return th.device(f"cuda:{get_local_rank() % th.cuda.device_count()}")
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
    result = None
    if get_rank() == 0:
        try:
            result = ("ok", fn())
        except Exception as e:  # re-raised on every rank below
            result = ("err", _picklable(e))
    kind, value = broadcast_object(result)
    if kind == "err":
        raise value
    return value


def _picklable(e):
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {' '.join(str(e).split())}")


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
    """Broadcast ``data`` (bytes on rank 0, ignored elsewhere) of length ``nbytes`` from rank 0."""
    device = _comm_device()
    buf = bytearray(data) if get_rank() == 0 else bytearray(nbytes)
    if nbytes == 0:
        return bytes(buf)
    host = th.frombuffer(buf, dtype=th.uint8)
    for start in range(0, nbytes, _CHUNK_BYTES):
        piece = host[start:start + _CHUNK_BYTES]
        if device.type == "cpu":
            dist.broadcast(piece, 0)
        else:
            moved = piece.to(device)
            dist.broadcast(moved, 0)
            if get_rank() != 0:
                piece.copy_(moved.cpu())
    return bytes(buf)


_ERROR_TYPES = {
    "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError,
    "PermissionError": PermissionError,
}


def read_local(path):
    """Read ``path`` via blobfile in this process (not collective); returns (bytes, None) or
    (None, (error type name, one-line message naming the path))."""
    try:
        if bf.isdir(path):
            return None, ("IsADirectoryError",
                          f"{path}: is a directory, not a checkpoint file; give the path of a file")
        with bf.BlobFile(path, "rb") as f:
            return f.read(), None
    except FileNotFoundError:
        return None, ("FileNotFoundError", f"{path}: no such file; check the path")
    except IsADirectoryError:
        return None, ("IsADirectoryError",
                      f"{path}: is a directory, not a checkpoint file; give the path of a file")
    except PermissionError:
        return None, ("PermissionError", f"{path}: permission denied; check the file's permissions")
    except Exception as e:  # blobfile raises its own types for remote paths
        msg = " ".join(str(e).split()) or type(e).__name__
        return None, ("OSError", f"{path}: cannot read ({type(e).__name__}: {msg})")


def _raise_read_error(err):
    kind, message = err
    raise _ERROR_TYPES.get(kind, OSError)(message)


def load_bytes(path):
    """
    Return the bytes of ``path`` (local or blobfile URL) on every rank; rank 0 reads, then
    broadcasts.

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
    paths = all_gather_object(path)
    if any(p != paths[0] for p in paths):
        listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise DistMismatchError(
            f"ranks asked to load different files ({listing}); every rank must load the same file"
        )
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
    sizes = [int(x.item()) for x in sizes]
    padded = th.zeros(max(sizes), dtype=tensor.dtype, device=device)
    padded[: tensor.numel()] = tensor.reshape(-1).to(device)
    out = [th.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return [t[:k].to(tensor.device) for t, k in zip(out, sizes)]
