"""Bounded distributed failures: --dist_timeout, the multi-host rendezvous address, a rank that
dies (kill -9) and a KeyboardInterrupt/SystemExit on one rank, all with real launchers."""
import datetime
import inspect
import json
import re
import signal
import socket
import textwrap
import time

import pytest

import cluster_sim as cs
from conftest import REPO, hang_s, run_module_mpi, run_script, run_script_here
from improved_diffusion import dist_util
from improved_diffusion.infra import heartbeat, rendezvous
from test_train import error_lines, random_images

# ------------------------------------------------------------------------------- timeouts


def test_setup_dist_takes_seconds_or_a_timedelta_and_refuses_anything_not_positive():
    assert dist_util.as_timedelta(20) == datetime.timedelta(seconds=20)
    assert dist_util.as_timedelta(0.5) == datetime.timedelta(seconds=0.5)
    assert dist_util.as_timedelta(datetime.timedelta(minutes=2)) == datetime.timedelta(seconds=120)
    for bad in (0, -1, float("nan"), float("inf"), "10", True, datetime.timedelta(0)):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            dist_util.as_timedelta(bad)


def test_no_library_wait_defaults_to_thirty_minutes():
    assert dist_util.DEFAULT_TIMEOUT_S == 600
    assert inspect.signature(dist_util.setup_dist).parameters["timeout"].default == 600
    for path in (REPO / "improved_diffusion").glob("*.py"):
        text = path.read_text()
        assert "minutes=30" not in text and "seconds=1800" not in text, path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", ["train.py", "sample.py", "nll.py"])  # in this process: cheap
def test_a_dist_timeout_that_is_not_positive_is_a_one_line_usage_error(tmp_path, capsys,
                                                                       script):
    flags = {"train.py": ["--data_dir", tmp_path, "--log_dir", tmp_path / "log"],
             "sample.py": ["--model_path", tmp_path / "m.pt"],
             "nll.py": ["--model_path", tmp_path / "m.pt", "--data_dir", tmp_path]}[script]
    code, out = run_script_here(script, *flags, "--dist_timeout", "0", capsys=capsys)
    assert code == 2, out
    assert error_lines(out) == ["error: --dist_timeout must be a number of seconds > 0 "
                                "(got 0.0)"], out


# ------------------------------------------------------------------- rendezvous address


def _info(host, addrs):
    return {"host": host, "addrs": addrs}


def test_a_host_whose_name_maps_to_loopback_publishes_the_address_other_hosts_reach(monkeypatch):
    # /etc/hosts style: "127.0.1.1 node-a"; the interface list is not available either.
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda *a, **k: [(socket.AF_INET, 0, 0, "", ("127.0.1.1", 0))])
    monkeypatch.setattr(rendezvous, "_interface_addresses", lambda: [])
    home = rendezvous._host_info()
    # the loopback name address is never a candidate
    assert (home["host"], home["addrs"]) == ("node-a", [])
    # node-b (as node-a sees it) is 10.1.0.7; node-a's route towards it leaves from 10.1.0.6.
    routes = {"10.1.0.7": "10.1.0.6"}
    infos = [home, _info("node-b", ["10.1.0.7"])]
    assert rendezvous._choose_address(infos, {}, probe=routes.get) == "10.1.0.6"


def test_rank0_falls_back_to_an_interface_address_when_no_route_is_found():
    infos = [_info("node-a", ["192.168.5.1"]), _info("node-b", ["10.1.0.7"])]
    assert rendezvous._choose_address(infos, {}, probe=lambda a: "127.0.0.1") == "192.168.5.1"
    assert rendezvous._choose_address(infos, {}, probe=lambda a: None) == "192.168.5.1"


def test_master_addr_overrides_the_discovery_but_never_as_a_loopback_address():
    infos = [_info("node-a", ["192.168.5.1"]), _info("node-b", ["10.1.0.7"])]
    assert rendezvous._choose_address(infos, {"MASTER_ADDR": "10.9.9.9"}) == "10.9.9.9"
    with pytest.raises(dist_util.RendezvousError, match="MASTER_ADDR=localhost is 127.0.0.1, a "
                       "loopback address") as e:
        rendezvous._choose_address(infos, {"MASTER_ADDR": "localhost"})
    assert "\n" not in str(e.value)


def test_no_reachable_address_on_rank0_says_to_set_master_addr():
    infos = [_info("node-a", []), _info("node-b", ["10.1.0.7"])]
    with pytest.raises(dist_util.RendezvousError, match="rank 0's host 'node-a' has no address "
                       ".*set MASTER_ADDR") as e:
        rendezvous._choose_address(infos, {}, probe=lambda a: None)
    assert "\n" not in str(e.value)


def test_ranks_on_one_host_meet_on_loopback_whatever_master_addr_says():
    infos = [_info("node-a", ["10.0.0.1"]), _info("node-a", ["10.0.0.1"])]
    assert rendezvous._choose_address(infos, {"MASTER_ADDR": "localhost"}) == "127.0.0.1"


# Each rank pretends to be on its own host ("host0", "host1"): setup_dist takes the multi-host
# path on this machine. INJECT (python) runs after the pretence, before setup_dist.
RENDEZVOUS_CHILD = """
import os, socket, sys, json
rank = int(os.environ["PMI_RANK"])
socket.gethostname = lambda: f"host{rank}"
from improved_diffusion.infra import cli, heartbeat, rendezvous
from improved_diffusion import dist_util
rendezvous.network_stack = lambda: f"stack{rank}"
INJECT
def main(argv):
    dist_util.setup_dist(timeout=20)
    hb = heartbeat._heartbeat
    sys.stdout.write("RESULT " + json.dumps(dict(rank=rank, host=hb.host,
                     gathered=dist_util.all_gather_object(rank))) + "\\n")
    dist_util.cleanup()
    return 0
sys.exit(cli.run_main(main, []))
"""


def _rendezvous_run(inject="", env=None):
    code = RENDEZVOUS_CHILD.replace("INJECT", textwrap.dedent(inject))
    t0 = time.monotonic()
    proc = run_module_mpi(2, code, timeout=90, env=env, check=False)
    return proc, time.monotonic() - t0


@pytest.mark.timeout(120)
def test_a_multi_host_mpiexec_job_meets_on_a_non_loopback_address():
    if not rendezvous._interface_addresses() or \
            not [a for a in rendezvous._interface_addresses() if rendezvous._reachable_kind(a)]:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    proc, _ = _rendezvous_run()
    assert proc.returncode == 0, proc.stdout
    results = [json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines()
               if x.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["gathered"] == [0, 1] for r in results)
    published = next(r["host"] for r in results if r["rank"] == 1)
    assert rendezvous._reachable_kind(published), published  # never 127.x


@pytest.mark.timeout(120)
def test_no_address_for_rank0_fails_every_rank_at_once_with_the_same_line():
    # Every rank's name maps to loopback and no interface has another address.
    proc, took = _rendezvous_run("""
        rendezvous._interface_addresses = lambda: []
        socket.getaddrinfo = lambda *a, **k: [(socket.AF_INET, 0, 0, "", ("127.0.1.1", 0))]
    """)
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert len(errors) == 2 and errors[0] == errors[1], proc.stdout
    assert "rank 0's host 'host0' has no address" in errors[0] and "MASTER_ADDR" in errors[0]
    assert took < 60  # at once, not after a timeout


@pytest.mark.timeout(120)
def test_an_error_on_rank0_opening_the_store_reaches_every_rank():
    proc, took = _rendezvous_run("""
        if rank == 0:
            def refuse(*a, **k):
                raise OSError("injected: cannot bind")
            dist_util.dist.TCPStore = refuse
    """)
    assert proc.returncode == 1, proc.stdout
    errors = error_lines(proc.stdout)
    assert errors == ["error: rank 0 could not open the rendezvous store: OSError: injected: "
                      "cannot bind"] * 2, proc.stdout
    assert took < 60


@pytest.mark.timeout(120)
def test_a_loopback_master_addr_on_a_multi_host_job_fails_every_rank_saying_so():
    proc, _ = _rendezvous_run(env={"MASTER_ADDR": "127.0.0.1"})
    errors = error_lines(proc.stdout)
    assert proc.returncode == 1 and len(errors) == 2 and errors[0] == errors[1], proc.stdout
    assert "MASTER_ADDR=127.0.0.1 is 127.0.0.1, a loopback address" in errors[0]


# ----------------------------------------------------------------- dead ranks, interrupts


def _train_args(tmp_path, save_interval=2, max_steps=100000):
    data = random_images(tmp_path / "data", 8, 8)
    return [*cs.TINY, "--data_dir", data, "--log_dir", tmp_path / "log",
            "--save_interval", str(save_interval), "--max_steps", str(max_steps)]


def _assert_resumes_from_the_last_complete_step(tmp_path):
    log = tmp_path / "log"
    steps = cs.complete_steps(log)
    assert steps, "no complete step on disk"
    last = steps[-1]
    assert cs.step_problems(log, last) == []
    proc = run_script("../tests/fault_train.py", *_train_args(tmp_path, max_steps=last + 1),
                      "--resume_checkpoint", "auto", timeout=120)
    assert f"resumed at step {last}" in proc.stdout, proc.stdout
    assert cs.step_problems(log, last + 1) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_dead_node_ends_the_other_node_naming_the_lost_rank_and_the_step_resumes(tmp_path, sig):
    # killed: its sockets close (gloo fails at once); frozen (SIGSTOP): nothing closes, as when a
    # host loses power or its network, and the collective fails after --dist_timeout.
    args = _train_args(tmp_path)
    n0, n1 = cs.two_node_torchrun(args, tmp_path, dist_timeout=20,
                                  env={"FAULT_PID_DIR": str(tmp_path / "pids")})
    try:
        cs.wait_until(lambda: len(cs.complete_steps(tmp_path / "log")) >= 2, hang_s(150), (n0, n1),
                      "two saves")
        pids = cs.rank_pids(tmp_path / "pids", 2)
        node1 = cs.process_tree(n1.pid)
        (lost,) = [r for r, p in pids.items() if p in node1]
        cs.signal_all(node1, sig)
        took = cs.wait_exit(n0, 120)  # not 600 s (the default) nor 30 minutes (before)
    finally:
        cs.kill9(cs.process_tree(n0.pid) + cs.process_tree(n1.pid))
    out = (tmp_path / "node0.out").read_text()
    assert n0.returncode != 0
    errors = error_lines(out)
    assert len(errors) == 1 and f"lost rank(s) {lost}: no heartbeat" in errors[0], out[-3000:]
    assert cs.all_gone(pids.values(), within_s=30)  # within the bound (--dist_timeout 20)
    assert took < 120
    _assert_resumes_from_the_last_complete_step(tmp_path)


@pytest.mark.timeout(200)
def test_kill_9_of_one_mpiexec_rank_ends_the_job_and_the_last_step_resumes(tmp_path):
    job = cs.mpiexec(2, _train_args(tmp_path), tmp_path, dist_timeout=20,
                     env={"FAULT_PID_DIR": str(tmp_path / "pids")})
    try:
        cs.wait_until(lambda: len(cs.complete_steps(tmp_path / "log")) >= 2, hang_s(150), (job,),
                      "two saves")
        pids = cs.rank_pids(tmp_path / "pids", 2)
        cs.kill9([pids[1]])
        cs.wait_exit(job, hang_s(60))
    finally:
        cs.kill9(cs.process_tree(job.pid))
    assert job.returncode != 0
    assert cs.all_gone(pids.values(), within_s=30)  # within the bound (--dist_timeout 20)
    _assert_resumes_from_the_last_complete_step(tmp_path)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault,code,cause", [
    ("KeyboardInterrupt", 130, "interrupted (KeyboardInterrupt) on rank 1"),
    pytest.param("SystemExit:3", 3, "exit requested (SystemExit 3) on rank 1",
                 marks=pytest.mark.slow),
])
def test_an_interrupt_on_one_rank_ends_every_rank_with_its_cause_printed_once(
        tmp_path, fault, code, cause):
    env = {"FAULT_PID_DIR": str(tmp_path / "pids"), "FAULT_RANK": "1", "FAULT_STEP": "3",
           "FAULT_RAISE": fault}
    job = cs.mpiexec(2, _train_args(tmp_path), tmp_path, dist_timeout=20, env=env)
    try:
        took = cs.wait_exit(job, 120)
    finally:
        cs.kill9(cs.process_tree(job.pid))
    out = (tmp_path / "mpiexec.out").read_text()
    assert job.returncode == code, out[-3000:]
    assert error_lines(out) == [f"error: {cause}; ending the job on all 2 ranks"], out[-3000:]
    pids = cs.rank_pids(tmp_path / "pids", 2)
    assert cs.all_gone(pids.values(), within_s=30)  # within the bound (--dist_timeout 20)
    assert took < 120
    assert cs.complete_steps(tmp_path / "log") == [2]
    assert cs.step_problems(tmp_path / "log", 2) == []


# ---------------------------------------------------------------- a save longer than the timeout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("async_save", ["False", pytest.param("True", marks=pytest.mark.slow)])
def test_a_save_longer_than_dist_timeout_ends_the_job_normally(tmp_path, async_save):
    """Issue 29, item 6: --dist_timeout 3 (fast dead-rank detection) and saves of about 5 s
    (tests/slow_save_train.py: each file written in two halves 0.6 s apart): the other rank
    waits for rank 0's save (a synchronous one, or the background one the run's end waits for)
    as long as rank 0's heartbeat goes on, so the job ends with exit 0 and the step complete (before: both ranks ended with gloo's "Timed out waiting
    3000ms" tracebacks, though no rank was lost)."""
    from conftest import MPIEXEC, PY, _run

    data = random_images(tmp_path / "data", n=8, size=8)
    log_dir = tmp_path / "run"
    proc = _run([MPIEXEC, "-n", "2", PY, REPO / "tests" / "slow_save_train.py", *cs.TINY,
                 "--data_dir", data, "--log_dir", log_dir, "--max_steps", 2, "--save_interval",
                 2, "--dist_timeout", 3, "--async_save", async_save],
                timeout=150, env={"SLOW_SAVE_S": "0.6"}, check=False)
    out = proc.stdout
    assert proc.returncode == 0 and "Timed out" not in out and "error:" not in out, out[-3000:]
    assert cs.complete_steps(log_dir) == [2] and cs.step_problems(log_dir, 2) == []
    took = [float(t) for t in re.findall(r"saved step \d+ to \S+ in ([\d.]+) s", out)]
    assert took and max(took) > 3, out[-2000:]  # the saves did outlast the timeout
