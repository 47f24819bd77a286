"""dist_util: helpers without a process group, and real multi-rank collectives under mpiexec."""
import hashlib
import json
import os
import subprocess
import textwrap

import pytest
import torch as th

from conftest import PY, REPO, child_env, hang_s, run_module_mpi
from improved_diffusion import dist_util


def _results(proc):
    """Parse the `RESULT {json}` lines printed by each rank, keyed by rank."""
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[r["rank"]] = r
    return out


CHILD_PRELUDE = """
import json, sys
import torch as th
from improved_diffusion import dist_util
dist_util.setup_dist()
rank = dist_util.get_rank()
def report(**kw):
    # one write per line: ranks share mpiexec's stdout, and unbuffered print() writes the text
    # and its newline separately, so lines of different ranks could run together
    sys.stdout.write("RESULT " + json.dumps(dict(rank=rank, **kw)) + "\\n")
    sys.stdout.flush()
"""


def test_helpers_work_in_a_single_process_without_a_process_group(tmp_path):
    dist_util.setup_dist()  # no launcher variables here: must not create a group
    assert not dist_util.is_distributed()
    assert (dist_util.get_rank(), dist_util.get_world_size()) == (0, 1)
    assert dist_util.dev() == (th.device("cuda:0") if th.cuda.is_available() else th.device("cpu"))
    dist_util.barrier()
    assert dist_util.broadcast_object({"a": 1}) == {"a": 1}
    assert dist_util.all_gather_object(7) == [7]
    assert dist_util.any_rank(True) and not dist_util.any_rank(False)
    t = th.tensor([2.0, 4.0])
    assert th.equal(dist_util.all_reduce_mean(t), th.tensor([2.0, 4.0]))
    p = th.nn.Parameter(th.ones(3))
    dist_util.sync_params([p])
    assert th.equal(p.data, th.ones(3))
    f = tmp_path / "blob.bin"
    f.write_bytes(b"hello")
    assert dist_util.load_bytes(f) == b"hello"
    th.save({"w": th.arange(3)}, tmp_path / "sd.pt")
    assert th.equal(dist_util.load_state_dict(tmp_path / "sd.pt")["w"], th.arange(3))
    dist_util.cleanup()


def test_single_process_read_errors_are_one_line_and_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt: no such file"):
        dist_util.load_bytes(tmp_path / "nope.pt")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        dist_util.load_bytes(tmp_path)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file at all")
    with pytest.raises(dist_util.DistLoadError, match="junk.pt: not a loadable") as e:
        dist_util.load_state_dict(tmp_path / "junk.pt")
    assert "\n" not in str(e.value)


def _collective_run(tmp_path_factory, n):
    """One mpiexec run of n ranks exercising load_bytes, the helpers, and both error paths."""
    d = tmp_path_factory.mktemp(f"ranks{n}")
    payload = d / "payload.bin"
    payload.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    for i in range(n):
        (d / f"f{i}.pt").write_bytes(b"x" * (i + 1))
    code = CHILD_PRELUDE + textwrap.dedent(f"""
        import hashlib
        d = {str(d)!r}
        dist_util._CHUNK_BYTES = 1024 * 1024  # exercise the chunked broadcast
        data = dist_util.load_bytes(d + "/payload.bin")
        t = th.tensor([float(rank)])
        dist_util.all_reduce_mean(t)
        p = th.full((4,), float(rank))
        dist_util.sync_params([p])
        try:
            dist_util.load_bytes(d + f"/f{{rank}}.pt")
            mismatch = None
        except dist_util.DistMismatchError as e:
            mismatch = str(e)
        try:
            dist_util.load_state_dict(d + "/model000100.pt")
            missing = None
        except FileNotFoundError as e:
            missing = str(e)
        dist_util.barrier()  # every rank is still in step after the errors
        pending = dist_util.any_rank_async([rank == {n - 1}, False])  # waited below
        report(world=dist_util.get_world_size(), dist=dist_util.is_distributed(),
               sha=hashlib.sha256(data).hexdigest(), n=len(data),
               obj=dist_util.broadcast_object({{"from": rank}}),
               gathered=dist_util.all_gather_object(rank * 10),
               any1=dist_util.any_rank(rank == {n - 1}), any0=dist_util.any_rank(False),
               async_flags=pending.wait(), to_rank0=dist_util.gather_object(rank * 10),
               mean=t.item(), synced=p.tolist(), mismatch=mismatch, missing=missing)
    """)
    res = _results(run_module_mpi(n, code, timeout=50))
    assert sorted(res) == list(range(n))
    return d, res


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _collective_run(tmp_path_factory, 2)


# make soak: the 3-rank run of the collectives (the 2-rank run keeps every check below)
THREE_RANKS = pytest.param("three_ranks", marks=pytest.mark.slow)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return _collective_run(tmp_path_factory, 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("run", ["two_ranks", THREE_RANKS])
def test_load_bytes_gives_every_rank_the_same_bytes_and_collectives_agree(request, run):
    d, res = request.getfixturevalue(run)
    n = len(res)
    payload = d / "payload.bin"
    want = hashlib.sha256(payload.read_bytes()).hexdigest()
    for r in res.values():
        assert r["world"] == n and r["dist"]
        assert r["sha"] == want and r["n"] == payload.stat().st_size
        assert r["obj"] == {"from": 0}
        assert r["gathered"] == [10 * i for i in range(n)]
        assert r["any1"] is True and r["any0"] is False
        assert r["async_flags"] == [True, False]  # async: launched before other collectives
    assert res[0]["to_rank0"] == [10 * i for i in range(n)]
    assert all(res[i]["to_rank0"] is None for i in range(1, n))  # only rank 0 receives
    for r in res.values():
        assert r["mean"] == pytest.approx((n - 1) / 2)
        assert r["synced"] == [0.0] * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("run", ["two_ranks", THREE_RANKS])
def test_ranks_asking_for_different_files_all_fail_with_a_clear_error(request, run):
    d, res = request.getfixturevalue(run)
    messages = {r["mismatch"] for r in res.values()}
    assert len(messages) == 1
    msg = messages.pop()
    assert msg and "\n" not in msg and "different files" in msg
    for i in range(len(res)):
        assert f"rank {i}: {d}/f{i}.pt" in msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("run", ["two_ranks", THREE_RANKS])
def test_a_missing_file_raises_the_same_error_on_every_rank(request, run):
    d, res = request.getfixturevalue(run)
    for r in res.values():
        assert r["missing"] == f"{d}/model000100.pt: no such file; check the path"


@pytest.mark.timeout(60)
def test_torchrun_launch_builds_the_same_process_group(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD_PRELUDE + textwrap.dedent("""
        import os
        report(world=dist_util.get_world_size(), local=dist_util.get_local_rank(),
               gathered=dist_util.all_gather_object(rank))
        dist_util.cleanup()
    """))
    torchrun = os.path.join(os.path.dirname(PY), "torchrun")
    try:
        proc = subprocess.run(
            [torchrun, "--standalone", "--nproc_per_node", "2", str(script)],
            env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=hang_s(50), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail("torchrun run timed out (a hang?)")
    assert proc.returncode == 0, proc.stdout[-3000:]
    res = _results(proc)
    assert sorted(res) == [0, 1]
    assert all(r["world"] == 2 and r["gathered"] == [0, 1] for r in res.values())
    assert {r["local"] for r in res.values()} == {0, 1}
