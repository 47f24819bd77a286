"""Jobs across two simulated hosts that share no disk and no network stack (tests/multihost.py).

Host 0 (10.77.0.1) and host 1 (10.77.0.2) each have a private disk at ``multihost.DISK``; the
log dir lives there, so checkpoints written by rank 0 exist on host 0 only, and every rank on
host 1 must get them through the read-once-and-broadcast load. Launchers are the real ones:
``torchrun --rdzv_backend c10d`` on each host, and MPICH's ``mpiexec`` reaching host 1 through a
launcher command that enters it (as ``ssh`` would).

torchrun's c10d rendezvous ignores ``--node_rank``: it sorts the nodes' descriptors
("<host name or --local_addr>_<agent pid>_<n>") and numbers them in that order, so node 0 is the
host whose name sorts first. The harness names the hosts ``idh-<pid>-0`` and ``idh-<pid>-1``,
so host 0 always holds ranks 0..nproc-1 (the tests check it from the pids).
"""
import json
import os
import shutil
import subprocess
import textwrap

import numpy as np
import pytest
import torch

import cluster_sim as cs
import multihost as mh
from conftest import deep_diff, hang_s, resumed_step, run_script, write_images
from improved_diffusion import dist_util
from improved_diffusion.infra import heartbeat, rendezvous
from test_train import error_lines

# The simulated hosts have fixed names, addresses and disk paths: one test at a time (make
# test's workers take whole files: --dist loadfile).
PORT = 29400  # the rendezvous port on host 0 (the namespaces are fresh: always free)
TINY = [*cs.TINY, "--seed", "0"]


@pytest.fixture
def hosts():
    """Two simulated hosts, torn down after the test whatever happens (see multihost.Cluster)."""
    reason = mh.unavailable()
    if reason:
        pytest.skip(reason)
    try:
        cluster = mh.Cluster()
    except mh.HostSetupError as e:
        pytest.skip(f"cannot simulate hosts on this machine: {e}")
    with cluster:
        yield cluster.hosts


def torchrun(hosts, nproc, args, work, tag, dist_timeout=20, env=None):
    """Start ``torchrun ... SCRIPT ARGS`` (``args`` = SCRIPT ARGS) on every host, ``nproc``
    ranks each, output to ``work/{tag}-host{i}.out``; returns the launchers' Popens."""
    procs = []
    for h in hosts:
        cmd = [cs.TORCHRUN, "--nnodes", len(hosts), "--nproc_per_node", nproc,
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{hosts[0].addr}:{PORT}",
               "--rdzv_id", tag, "--max_restarts", 0, *args, "--dist_timeout", dist_timeout]
        procs.append(h.start(cmd, work / f"{tag}-host{h.index}.out", env))
    return procs


def finish(procs, work, tag, timeout=240, codes=(0,)):
    """Wait for every launcher (bounded); fail with their output unless each exits in ``codes``.
    Returns host 0's output."""
    outs, hung = [], set()
    for i, p in enumerate(procs):
        try:
            p.wait(hang_s(timeout))
        except subprocess.TimeoutExpired:
            hung.add(i)
            cs.kill9(cs.process_tree(p.pid))
            p.wait(10)
        outs.append((work / f"{tag}-host{i}.out").read_text())
    bad = [(i, f"timed out after {hang_s(timeout)} s" if i in hung else p.returncode)
           for i, p in enumerate(procs) if i in hung or p.returncode not in codes]
    if bad:
        pytest.fail(f"{tag}: exit codes {bad}\n" + "\n".join(
            f"--- host {i}:\n{o[-4000:]}" for i, o in enumerate(outs)))
    return outs[0]


def train_script(data, log_dir, *extra):
    return [cs.DRIVER, *TINY, "--data_dir", data, "--log_dir", log_dir, *map(str, extra)]


def files_on(host):
    """Every file on ``host``'s private disk (relative names)."""
    root = host.disk()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def step_files(log_dir, step):
    return sorted(p.name for p in log_dir.iterdir() if f"{step:06d}" in p.name)


def load_pt(path):
    return torch.load(path, weights_only=True, map_location="cpu")


def assert_same_step(a_dir, b_dir, step):
    names = step_files(a_dir, step)
    assert names == step_files(b_dir, step) and names, (names, step_files(b_dir, step))
    diffs = []
    for name in names:
        if name.endswith(".pt"):
            diffs += [f"{name}{d}" for d in deep_diff(load_pt(a_dir / name), load_pt(b_dir / name))]
    assert not diffs, "files differ:\n" + "\n".join(diffs[:30])


def copy_step(src, dst, step):
    """What a job stopped after saving ``step`` leaves on host 0's disk (its step files)."""
    dst.mkdir(parents=True)
    for name in step_files(src, step):
        shutil.copy2(src / name, dst / name)


# ------------------------------------------------------------------------ unit: same host


def test_two_hosts_with_the_same_name_never_meet_on_loopback():
    # Two machines (or containers) named alike: their network stacks differ, so rank 0 publishes
    # the address its route towards host 1 leaves from, not 127.0.0.1.
    a = {"host": "node", "addrs": ["10.77.0.1"], "stack": "boot-a/4:1"}
    b = {"host": "node", "addrs": ["10.77.0.2"], "stack": "boot-b/4:1"}
    assert rendezvous._choose_address([a, b], {}, probe={"10.77.0.2": "10.77.0.1"}.get) == \
        "10.77.0.1"
    # ranks in one network stack meet on loopback, whatever their names
    assert rendezvous._choose_address([a, dict(a, host="other")], {}) == "127.0.0.1"
    # without a stack (not Linux) the host name decides, as before
    assert rendezvous._choose_address([dict(a, stack=None), dict(b, stack=None)], {}) == \
        "127.0.0.1"


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/net"), reason="Linux only")
def test_this_process_knows_its_network_stack():
    stack = rendezvous.network_stack()
    assert stack and stack == rendezvous._host_info()["stack"]


# ------------------------------------------------------------------------------ harness


@pytest.mark.timeout(60)
def test_hosts_of_a_test_process_killed_by_sigkill_leave_nothing_behind(tmp_path):
    reason = mh.unavailable()
    if reason:
        pytest.skip(reason)
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(cs.REPO / "tests")!r})
        import multihost as mh
        c = mh.Cluster()
        c.hosts[1].start(["sleep", "300"], {str(tmp_path / "sleep.out")!r})
        print(" ".join(h.name for h in c.hosts), flush=True)
        time.sleep(300)
    """)
    child = subprocess.Popen([cs.PY, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=cs.child_env(), stdin=subprocess.DEVNULL)
    try:
        names = child.stdout.readline().split()
        assert len(names) == 2, "the child did not create its hosts"
        inside = mh._netns_pids(names[0]) + mh._netns_pids(names[1])
        assert len(inside) == 3  # two holders and the sleep on host 1
    finally:
        child.kill()  # no finally, no atexit in the child: only what outlives it is left
        child.wait()
        child.stdout.close()
    assert cs.all_gone(inside, within_s=20)  # holders and host processes die with it
    mh.clean_stale()  # what the next Cluster() does first: the namespaces of dead owners go
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not set(names) & {line.split(" ")[0] for line in listed.splitlines()}, listed
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


# ----------------------------------------------------------------------------- torchrun


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_a_two_host_torchrun_job_saves_on_host0_only_and_resumes_bitwise_on_both(
        hosts, tmp_path):
    h0, h1 = hosts
    data = write_images(tmp_path / "data", n=8)
    straight, resumed = f"{mh.DISK}/straight", f"{mh.DISK}/resumed"
    args = ["--save_interval", 2, "--max_steps", 4]
    out = finish(torchrun(hosts, 1, train_script(data, straight, *args), tmp_path, "straight"),
                 tmp_path, "straight")
    assert "training on 2 rank(s)" in out, out[-3000:]
    assert out.count("saved step") == 2, out[-3000:]  # rank 0, the writer, ran on host 0
    assert cs.complete_steps(h0.disk("straight")) == [2, 4]
    assert files_on(h1) == [], "host 1 got files on its disk"

    # The job stopped after saving step 2: only those files (host 0) and a resume on both hosts.
    copy_step(h0.disk("straight"), h0.disk("resumed"), 2)
    out = finish(torchrun(hosts, 1, train_script(data, resumed, *args), tmp_path, "resume"),
                 tmp_path, "resume")
    assert resumed_step(out) == 2, out[-3000:]  # auto-resume found the step on host 0's disk
    assert cs.step_problems(h0.disk("resumed"), 4) == []
    assert_same_step(h0.disk("straight"), h0.disk("resumed"), 4)
    assert files_on(h1) == [], "host 1 got files on its disk"


@pytest.mark.timeout(280)
@pytest.mark.parametrize("fault", ["killed", pytest.param("unplugged", marks=pytest.mark.slow)])
def test_a_lost_host_ends_the_other_within_dist_timeout_and_both_resume_bitwise(
        hosts, tmp_path, fault):
    # killed: every process of host 1 SIGKILLed (its sockets close, host 0 hears it at once);
    # unplugged: host 1's link goes down (nothing closes, nothing answers: host 0 waits out
    # --dist_timeout), as when a host loses power or its switch port.
    # One job, stopped with its host, gives both runs to compare: up to then it is a straight
    # run. Its last complete step N is moved aside (host 0's disk) as the reference; auto-resume
    # on both hosts must then find step N-1 (whatever the fault left half-written beside it), and
    # train to step N bit for bit as the straight run did.
    # (A clean stop and resume: test_a_two_host_torchrun_job_saves..., in `make soak`.)
    h0, h1 = hosts
    data = write_images(tmp_path / "data", n=8)
    log, ref = h0.disk("log"), h0.disk("reference")
    env = {"FAULT_PID_DIR": str(tmp_path / "pids")}
    procs = torchrun(hosts, 1, train_script(data, f"{mh.DISK}/log", "--save_interval", 1,
                                            "--max_steps", 100000),
                     tmp_path, "run", dist_timeout=15, env=env)
    cs.wait_until(lambda: len(cs.complete_steps(log)) >= 3, hang_s(200), procs, "three saves")
    pids = cs.rank_pids(tmp_path / "pids", 2)
    assert pids[0] in h0.pids() and pids[1] in h1.pids()  # rank 0 (the writer) on host 0
    if fault == "killed":
        assert pids[1] in h1.kill_all()  # the host dies: its agent and its rank at once
    else:
        h1.set_link(False)
    cs.wait_exit(procs[0], 90)  # raises unless host 0 ends within the bound (not 600 s)
    out = finish(procs[:1], tmp_path, "run", codes=range(1, 256))
    errors = error_lines(out)
    assert len(errors) == 1 and "lost rank(s) 1: no heartbeat" in errors[0], out[-3000:]
    assert cs.all_gone([pids[0]], within_s=30) and h0.pids() == []
    if fault == "unplugged":
        # Host 1's rank, cut off from the store on host 0, ends within the bound too.
        assert cs.all_gone([pids[1]], within_s=90)
        out1 = (tmp_path / "run-host1.out").read_text()
        assert any("store at" in e and "is unreachable" in e for e in error_lines(out1)), \
            out1[-3000:]
        h1.kill_all()  # its torchrun agent may still retry the rendezvous store
        h1.set_link(True)
    assert h1.pids() == []
    assert files_on(h1) == [], "host 1 got files on its disk"

    steps = cs.complete_steps(log)
    last = steps[-1]
    assert cs.step_problems(log, last) == [] and cs.step_problems(log, last - 1) == []
    ref.mkdir()
    for name in step_files(log, last):
        shutil.move(log / name, ref / name)
    out = finish(torchrun(hosts, 1, train_script(data, f"{mh.DISK}/log", "--max_steps", last),
                          tmp_path, "resume"), tmp_path, "resume")
    assert resumed_step(out) == last - 1, out[-3000:]  # auto-resume found it on host 0's disk
    assert cs.step_problems(log, last) == []
    assert_same_step(ref, log, last)
    assert files_on(h1) == [], "host 1 got files on its disk"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_four_ranks_on_two_hosts_resume_bitwise_and_elastically_on_two(hosts, tmp_path):
    h0, h1 = hosts
    data = write_images(tmp_path / "data", n=12)
    straight = f"{mh.DISK}/straight"
    args = ["--save_interval", 2, "--max_steps", 4]
    out = finish(torchrun(hosts, 2, train_script(data, straight, *args), tmp_path, "straight"),
                 tmp_path, "straight")
    assert "training on 4 rank(s)" in out and out.count("saved step") == 2, out[-3000:]
    assert cs.complete_steps(h0.disk("straight")) == [2, 4]
    assert files_on(h1) == []

    copy_step(h0.disk("straight"), h0.disk("resumed"), 2)
    out = finish(torchrun(hosts, 2, train_script(data, f"{mh.DISK}/resumed", *args), tmp_path,
                          "resume"), tmp_path, "resume")
    assert resumed_step(out) == 2, out[-3000:]
    assert_same_step(h0.disk("straight"), h0.disk("resumed"), 4)

    # Elastic: the 4-rank step 2 resumed on 2 ranks (one per host), global batch 8 -> 4.
    copy_step(h0.disk("straight"), h0.disk("elastic"), 2)
    out = finish(torchrun(hosts, 1, train_script(data, f"{mh.DISK}/elastic", *args), tmp_path,
                          "elastic"), tmp_path, "elastic")
    assert resumed_step(out) == 2, out[-3000:]
    assert cs.step_problems(h0.disk("elastic"), 4) == []
    trainer = load_pt(h0.disk("elastic", "opt000004.pt"))["trainer"]
    assert trainer["world_size"] == 2 and trainer["global_batch"] == 4
    assert files_on(h1) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_static_torchrun_rendezvous_puts_rank_0_on_the_node_rank_0_host(hosts, tmp_path):
    # What docs/CLUSTERS.md advises for a log dir on one node's local disk: the static
    # rendezvous honours --node_rank, here node 0 = host 1 (the name that sorts last).
    h0, h1 = hosts
    data = write_images(tmp_path / "data", n=8)
    procs = []
    for h in hosts:
        cmd = [cs.TORCHRUN, "--nnodes", 2, "--nproc_per_node", 1, "--rdzv_backend", "static",
               "--master_addr", h1.addr, "--master_port", PORT, "--node_rank", 1 - h.index,
               "--max_restarts", 0, *train_script(data, f"{mh.DISK}/log", "--max_steps", 2),
               "--dist_timeout", 20]
        procs.append(h.start(cmd, tmp_path / f"static-host{h.index}.out"))
    finish(procs, tmp_path, "static")
    assert cs.complete_steps(h1.disk("log")) == [2]
    assert files_on(h0) == [], "host 0 (node rank 1) got files on its disk"


# ------------------------------------------------------------------------------ mpiexec


def mpiexec(hosts, n, cmd, tmp_path, tag, env=None):
    """``mpiexec -n n`` started on host 0 across both hosts (``-ppn n/2``), host 1 reached
    through the harness's launcher command."""
    launcher = mh.write_launcher(hosts, tmp_path / "launch.sh")
    full = [cs.MPIEXEC, "-launcher", "ssh", "-launcher-exec", launcher,
            "-hosts", ",".join(h.name for h in hosts), "-n", n, "-ppn", n // len(hosts), *cmd]
    return [hosts[0].start(full, tmp_path / f"{tag}-host0.out", env)]


RENDEZVOUS_CHILD = """
import json, socket, sys
NAME
from improved_diffusion.infra import cli, heartbeat, rendezvous
from improved_diffusion import dist_util
def main(argv):
    dist_util.setup_dist(timeout=20)
    hb = heartbeat._heartbeat
    sys.stdout.write("RESULT " + json.dumps(dict(rank=dist_util.get_rank(), store=hb.host,
                     hosts=dist_util.all_gather_object(socket.gethostname()))) + "\\n")
    dist_util.cleanup()
    return 0
sys.exit(cli.run_main(main, []))
"""


@pytest.mark.timeout(150)
# own names: make soak; make test keeps the meeting on host 0's address across two hosts in the
# harder both-named-node case (the same rendezvous, the host names no help)
@pytest.mark.parametrize("names", [pytest.param("own", marks=pytest.mark.slow), "same"],
                         ids=["own-names", "both-named-node"])
def test_an_mpiexec_job_across_two_hosts_meets_on_host0s_routable_address(
        hosts, tmp_path, names):
    # "same": both hosts call themselves "node" (cloned machines, containers): the host name
    # cannot tell the hosts apart, their network stacks do.
    name = 'socket.gethostname = lambda: "node"' if names == "same" else ""
    code = textwrap.dedent(RENDEZVOUS_CHILD).replace("NAME", name)
    out = finish(mpiexec(hosts, 2, [cs.PY, "-c", code], tmp_path, "rdzv"), tmp_path, "rdzv",
                 timeout=120)
    results = {r["rank"]: r for r in (json.loads(x[len("RESULT "):]) for x in
                                       out.splitlines() if x.startswith("RESULT "))}
    assert sorted(results) == [0, 1], out[-3000:]
    assert results[1]["store"] == hosts[0].addr  # host 1 reached rank 0 at host 0's address
    want = ["node", "node"] if names == "same" else [h.name for h in hosts]
    assert results[0]["hosts"] == want


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_mpiexec_training_job_across_two_hosts_saves_on_host0_and_resumes(hosts, tmp_path):
    h0, h1 = hosts
    data = write_images(tmp_path / "data", n=8)
    log = f"{mh.DISK}/log"
    finish(mpiexec(hosts, 2, [cs.PY, *train_script(data, log, "--save_interval", 2,
                                                   "--max_steps", 2)], tmp_path, "train"),
           tmp_path, "train")
    assert cs.complete_steps(h0.disk("log")) == [2] and files_on(h1) == []
    out = finish(mpiexec(hosts, 2, [cs.PY, *train_script(data, log, "--max_steps", 3)],
                         tmp_path, "resume"), tmp_path, "resume")
    assert resumed_step(out) == 2, out[-3000:]
    assert cs.step_problems(h0.disk("log"), 3) == []
    assert files_on(h1) == []


# ------------------------------------------------------------------------------ sampling


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sampling_on_two_hosts_writes_host0_the_npz_of_one_process(hosts, tmp_path):
    h0, h1 = hosts
    data = write_images(tmp_path / "data", n=8)
    run = tmp_path / "run"
    run_script("train.py", *TINY, "--data_dir", data, "--log_dir", run, "--max_steps", 2,
               "--ema_rate", "0.9", timeout=150)
    (h0.disk("model")).mkdir()
    shutil.copy2(run / "ema_0.9_000002.pt", h0.disk("model", "ema.pt"))  # host 0 only
    common = ["--num_samples", 5, "--batch_size", 2, "--timestep_respacing", 5,
              "--use_ddim", "False", "--seed", 7, "--progress", "False"]
    run_script("sample.py", "--model_path", run / "ema_0.9_000002.pt", *common, "--log_dir",
               tmp_path / "one", timeout=150)
    out = finish(torchrun(hosts, 1, ["scripts/sample.py", "--model_path",
                                     f"{mh.DISK}/model/ema.pt", *common, "--log_dir",
                                     f"{mh.DISK}/samples"], tmp_path, "sample"),
                 tmp_path, "sample")
    npz = "samples_5x8x8x3.npz"
    assert files_on(h1) == [], out[-2000:]
    assert (h0.disk("samples") / npz).is_file(), files_on(h0)
    with np.load(tmp_path / "one" / npz) as one, np.load(h0.disk("samples") / npz) as two:
        assert one.files == two.files
        assert two["arr_0"].shape == (5, 8, 8, 3) and two["arr_0"].std() > 0
        for key in one.files:
            np.testing.assert_array_equal(one[key], two[key])
