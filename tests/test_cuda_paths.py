"""The CUDA/NCCL paths, checked on a CPU: faked device counts and GPU identities, launcher
environments, recorded calls, in-process stores standing in for the other ranks."""
import datetime
import os
import threading
import time

import pytest
import torch as th
import torch.distributed as dist

from improved_diffusion import dist_util
from improved_diffusion.infra import heartbeat
from improved_diffusion.dist_util import DeviceError

pytestmark = pytest.mark.cuda  # benchmarks/gpu_check.sh runs these with a real GPU present too

TIMEOUT = datetime.timedelta(seconds=20)

# Every variable a launcher may set that says where a rank runs.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE",
                 "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                 "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
                 *dist_util._MPI_LAUNCHER_VARS)


class _InitCalled(Exception):
    """Raised by the faked init_process_group: the test looks at what happened before it."""


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n, **env)``: this process sees n CUDA devices and runs under a launcher that set
    ``env`` (on top of torchrun-style RANK/WORLD_SIZE/MASTER_*); returns the record of
    set_device calls and of the init_process_group call (which raises _InitCalled)."""
    record = {"set_device": [], "init": None}

    def setup(n, **env):
        environ = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        environ.update(RANK="1", WORLD_SIZE="8", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        environ.update({k: str(v) for k, v in env.items()})
        monkeypatch.setattr(os, "environ", environ)
        monkeypatch.setattr(th.cuda, "is_available", lambda: True)
        monkeypatch.setattr(th.cuda, "device_count", lambda: n)
        monkeypatch.setattr(th.cuda, "set_device", record["set_device"].append)
        monkeypatch.setattr(dist_util, "_device_index", None)

        def init(**kwargs):
            record["init"] = dict(kwargs, blocking_wait=os.environ.get("TORCH_NCCL_BLOCKING_WAIT"))
            raise _InitCalled

        monkeypatch.setattr(dist, "init_process_group", init)
        # no real store: rank 1 of 8 would wait for a rank 0 at MASTER_ADDR:MASTER_PORT
        monkeypatch.setattr(dist_util, "_attempt_store", lambda timeout: "the attempt's store")
        return record

    return setup


@pytest.mark.parametrize("env, device", [
    ({"LOCAL_RANK": 3, "LOCAL_WORLD_SIZE": 8}, 3),  # torchrun
    ({"SLURM_LOCALID": 5, "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}, 5),  # srun exporting RANK etc.
    ({"OMPI_COMM_WORLD_LOCAL_RANK": 2, "OMPI_COMM_WORLD_LOCAL_SIZE": 8}, 2),
    ({"MPI_LOCALRANKID": 6, "MPI_LOCALNRANKS": 8}, 6),
    ({"MV2_COMM_WORLD_LOCAL_RANK": 7, "MV2_COMM_WORLD_LOCAL_SIZE": 8}, 7),
], ids=["torchrun", "srun", "openmpi", "mpich", "mvapich"])
def test_each_rank_takes_the_gpu_of_its_launchers_local_rank_before_the_process_group(
        gpus, env, device):
    record = gpus(8, **env)
    with pytest.raises(_InitCalled):
        dist_util.setup_dist()
    assert record["set_device"] == [device]  # not cuda:0 for every rank of the node
    assert record["init"]["backend"] == "nccl"
    assert dist_util.get_local_rank() == device and dist_util.get_local_world_size() == 8


def test_a_rank_that_sees_only_its_own_gpu_takes_cuda_0(gpus):
    record = gpus(1, SLURM_LOCALID=5, SLURM_STEP_TASKS_PER_NODE="8")  # srun --gpus-per-task=1
    with pytest.raises(_InitCalled):
        dist_util.setup_dist()
    assert record["set_device"] == [0]


@pytest.mark.parametrize("env", [
    {"LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 8},  # the node's 8 ranks, 4 GPUs: every rank knows
    {"SLURM_LOCALID": 5},  # the count unknown: the rank without a GPU
])
def test_more_ranks_on_a_host_than_visible_gpus_is_one_line_before_the_process_group(gpus, env):
    record = gpus(4, **env)
    with pytest.raises(DeviceError) as e:
        dist_util.setup_dist()
    message = str(e.value)
    assert "\n" not in message and "4 GPUs visible" in message
    assert "one rank per GPU" in message and "--gpus-per-task=1" in message
    assert record["set_device"] == [] and record["init"] is None


def test_slurm_tasks_per_node_lists_are_read_for_this_node():
    assert dist_util._slurm_tasks_on_this_node({"SLURM_STEP_TASKS_PER_NODE": "8(x4)"}) == 8
    uneven = {"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}
    assert dist_util._slurm_tasks_on_this_node(uneven) == 1
    assert dist_util._slurm_tasks_on_this_node({"SLURM_TASKS_PER_NODE": "garbled"}) is None
    assert dist_util._slurm_tasks_on_this_node({}) is None


def _as_ranks(n, fn):
    """Run fn(rank) in n threads (standing in for n ranks); returns {rank: result or error}."""
    out = {}

    def run(r):
        try:
            out[r] = fn(r)
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_without_any_launcher_variable_the_ranks_of_a_host_count_themselves_in_the_store():
    store = dist.HashStore()
    got = _as_ranks(3, lambda r: dist_util._store_local_split(store, 3, TIMEOUT))
    assert sorted(got.values()) == [(0, 3), (1, 3), (2, 3)]


def test_two_ranks_driving_one_gpu_both_stop_with_one_line_naming_it():
    store = dist.HashStore()
    uuids = ["GPU-a", "GPU-a", "GPU-b"]
    got = _as_ranks(3, lambda r: dist_util._check_distinct_gpus(store, 3, r, uuids[r], TIMEOUT))
    assert got[2] is None
    for r in (0, 1):
        assert isinstance(got[r], DeviceError)
        assert "2 ranks drive the same GPU (GPU-a" in str(got[r]) and "\n" not in str(got[r])


def test_cpu_threads_are_this_ranks_share_on_a_gpu_host_too(monkeypatch):
    set_to = []
    monkeypatch.setattr(th.cuda, "is_available", lambda: True)
    monkeypatch.setattr(th, "set_num_threads", set_to.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(dist_util, "usable_cores", lambda: 48)
    monkeypatch.setattr(os, "cpu_count", lambda: 48)
    dist_util._set_threads(8)  # 8 ranks, no binding: 6 cores each, not all 48 for every rank
    monkeypatch.setattr(dist_util, "usable_cores", lambda: 6)
    dist_util._set_threads(8)  # srun --cpus-per-task=6: the 6 it was given
    assert set_to == [6, 6]


# ------------------------------------------------------------------------------ NCCL and lost ranks


@pytest.fixture
def store_server():
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    yield server
    del server


def _wait_until(predicate, seconds):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_a_watching_heartbeat_names_a_lost_rank_long_before_the_timeout(store_server):
    """On NCCL a collective never raises in the host thread (the watchdog aborts the process at
    --dist_timeout): the heartbeat itself names the rank that stopped beating."""
    found = []
    timeout_s = 6.0
    hb0 = heartbeat._Heartbeat("127.0.0.1", store_server.port, 0, 2, timeout_s,
                               on_lost=found.append)
    hb1 = heartbeat._Heartbeat("127.0.0.1", store_server.port, 1, 2, timeout_s)
    try:
        hb1._stop.set()  # rank 1 dies: its beats stop and it records no state
        hb1._thread.join()
        window = heartbeat.watch_window(timeout_s)
        assert window < timeout_s / 2
        assert _wait_until(lambda: found, 3 * window + 10)
        err = found[0]
        assert isinstance(err, heartbeat.RankLostError) and err.lost == [1]
        assert str(err).startswith("lost rank(s) 1: no heartbeat for")
    finally:
        hb0.stop("exited")


def test_a_rank_that_exits_on_purpose_is_not_reported_lost(store_server):
    found = []
    hb0 = heartbeat._Heartbeat("127.0.0.1", store_server.port, 0, 2, 6.0, on_lost=found.append)
    hb1 = heartbeat._Heartbeat("127.0.0.1", store_server.port, 1, 2, 6.0)
    try:
        hb1.stop("exited")
        assert _wait_until(lambda: hb0._on_lost is None, heartbeat.watch_window(6.0) + 10)
        assert found == []
    finally:
        hb0.stop("exited")


def test_the_heartbeat_watches_for_lost_ranks_on_nccl_only(store_server, monkeypatch):
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store_server)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    watching = {}
    for backend in ("nccl", "gloo"):
        monkeypatch.setattr(dist, "get_backend", lambda: backend)
        heartbeat.start(TIMEOUT, "test/")
        watching[backend] = heartbeat._heartbeat._on_lost
        heartbeat.stop("exited")
    assert watching == {"nccl": heartbeat._end_job_for_lost_ranks, "gloo": None}


def test_a_heartbeat_that_cannot_start_is_one_warning_and_a_bug_in_it_is_raised(
        store_server, monkeypatch, capsys):
    """A store the heartbeat cannot reach leaves the run to the timeout, with one warning line;
    an exception of another kind (a typo in heartbeat.py once disabled it without a word) is
    raised."""
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store_server)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")

    def unreachable(*a, **k):
        raise RuntimeError("connect() timed out. Original timeout was 30000 ms.\nmore")

    monkeypatch.setattr(heartbeat, "_Heartbeat", unreachable)
    heartbeat.start(TIMEOUT, "test/")
    assert heartbeat._heartbeat is None
    assert capsys.readouterr().err.splitlines() == [
        "warning: rank 1: no heartbeat (connect() timed out. Original timeout was 30000 ms.); a "
        "lost rank is noticed only after --dist_timeout"]

    def typo(*a, **k):
        raise NameError("name 'watcH' is not defined")

    monkeypatch.setattr(heartbeat, "_Heartbeat", typo)
    with pytest.raises(NameError):
        heartbeat.start(TIMEOUT, "test/")


# ------------------------------------------------------------------------------ broadcasts


def test_a_receiving_rank_sends_nothing_to_the_gpu_before_a_broadcast(monkeypatch):
    """Receivers broadcast into an empty device buffer: copying their zeroed 64 MiB host piece up
    first was a wasted host-to-device transfer per piece."""
    copies = []
    real_copy = th.Tensor.copy_

    def copy_(dst, src, *args, **kwargs):
        copies.append((src.device.type, dst.device.type))
        return dst if "meta" in (src.device.type, dst.device.type) else real_copy(dst, src)

    monkeypatch.setattr(th.Tensor, "copy_", copy_)
    monkeypatch.setattr(th.Tensor, "to", lambda *a, **k: pytest.fail("a tensor was moved"))
    monkeypatch.setattr(dist_util, "_comm_device", lambda: th.device("meta"))  # "the GPU"
    monkeypatch.setattr(dist_util, "_CHUNK_BYTES", 4)
    sent = []
    monkeypatch.setattr(dist, "broadcast", lambda t, src: sent.append((t.device.type, t.numel())))
    for rank in (1, 0):
        monkeypatch.setattr(dist_util, "get_rank", lambda: rank)
        dist_util._broadcast_bytes(b"0123456789" if rank == 0 else None, 10)
    assert sent == [("meta", 4), ("meta", 4), ("meta", 2)] * 2
    receiver, sender = copies[:3], copies[3:]
    assert receiver == [("meta", "cpu")] * 3  # device -> host only
    assert sender == [("cpu", "meta")] * 3


# ------------------------------------------------------------------------------ async saves


def test_a_host_snapshot_waits_for_the_devices_it_copied_from(monkeypatch):
    """The copies into pinned buffers run on the source tensors' device: each one is
    synchronised, not only the current device (a process on cuda:1 copied while it waited on
    cuda:0)."""
    from improved_diffusion.ckpt import async_save

    synced = []
    monkeypatch.setattr(th.cuda, "synchronize", lambda device=None: synced.append(device))
    async_save.wait_for_copies({th.device("cuda", 1), th.device("cuda", 3)})
    assert synced == [th.device("cuda", 1), th.device("cuda", 3)]
    synced.clear()
    async_save.HostSnapshot().copy({"w": th.ones(3)})  # CPU copies block: nothing to wait for
    assert synced == []


# ------------------------------------------------------------------------------ host syncs


def test_the_loss_aware_sampler_reads_a_microbatchs_losses_in_one_host_transfer(monkeypatch):
    """On a GPU every .item() is a host sync: the sampler took two per sample of the global batch,
    every microbatch."""
    from improved_diffusion.resample import LossSecondMomentResampler

    class _Diffusion:
        num_timesteps = 4

    reads = []
    for name in ("item", "tolist", "numpy", "cpu"):
        real = getattr(th.Tensor, name)
        monkeypatch.setattr(th.Tensor, name, lambda self, *a, _n=name, _r=real, **k:
                            reads.append(_n) or _r(self, *a, **k))
    sampler = LossSecondMomentResampler(_Diffusion(), history_per_term=2)
    sampler.update_with_local_losses(th.tensor([1, 2, 2, 3]), th.tensor([0.5, 1.5, 2.5, 0.25]))
    assert reads == ["tolist"]
    monkeypatch.undo()
    assert sampler._loss_counts.tolist() == [0, 1, 2, 1]
    assert sampler._loss_history[2].tolist() == [1.5, 2.5]
    assert sampler._loss_history[3][0] == 0.25


# ------------------------------------------------------------------------------ sampling


def test_sampling_noise_is_drawn_on_the_models_device_by_per_sample_generators(monkeypatch):
    """On CUDA the noise was drawn on the CPU row by row and copied to the GPU at every step."""
    from improved_diffusion import sampling

    made, drawn = [], []

    class Generator:
        def __init__(self, device):
            self.device = th.device(device)
            made.append(self.device)

        def manual_seed(self, seed):
            self.seed = seed
            return self

    def randn(shape, generator, device, dtype):
        drawn.append((generator.device, th.device(device)))
        return th.full(shape, float(generator.seed), dtype=dtype)

    monkeypatch.setattr(th, "Generator", Generator)
    monkeypatch.setattr(th, "randn", randn)
    noise = sampling.PerSampleRandn([3, 5], device="cuda:1")(th.empty(2, 1, 2))
    cuda1 = th.device("cuda", 1)
    assert made == [cuda1, cuda1] and drawn == [(cuda1, cuda1)] * 2
    assert noise[:, 0, 0].tolist() == [3.0, 5.0]  # row j from generator j


# ------------------------------------------------------------------------------ --deterministic


@pytest.fixture
def torch_determinism():
    """Restores torch's global determinism settings after the test."""
    saved = (th.are_deterministic_algorithms_enabled(),
             th.is_deterministic_algorithms_warn_only_enabled(),
             th.backends.cudnn.deterministic, th.backends.cudnn.benchmark)
    yield
    th.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    th.backends.cudnn.deterministic, th.backends.cudnn.benchmark = saved[2:]


def test_deterministic_is_off_by_default_and_set_before_cuda_and_the_process_group(
        monkeypatch, torch_determinism):
    from improved_diffusion import script_util, train_job

    assert script_util.train_defaults()["deterministic"] is False
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    th.backends.cudnn.benchmark = True  # as a user's import might leave it
    seen = {}

    def setup_dist(timeout):
        seen.update(algorithms=th.are_deterministic_algorithms_enabled(),
                    cudnn=(th.backends.cudnn.deterministic, th.backends.cudnn.benchmark),
                    cublas=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        raise _InitCalled

    monkeypatch.setattr(dist_util, "setup_dist", setup_dist)
    args = type("Args", (), dict(script_util.train_defaults(), deterministic=True))()
    with pytest.raises(_InitCalled):
        train_job.start_job(args)
    assert seen == {"algorithms": True, "cudnn": (True, False), "cublas": ":4096:8"}


def test_without_deterministic_torchs_settings_are_left_alone(monkeypatch, torch_determinism):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = th.are_deterministic_algorithms_enabled()
    dist_util.set_deterministic(False)
    assert th.are_deterministic_algorithms_enabled() == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
