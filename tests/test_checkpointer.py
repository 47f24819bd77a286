"""The checkpointer on its own, in one process, with a loop's objects of any kind: a plain
module with a buffer and a frozen parameter, an optimizer, an EMA, and states of the loop's own
(tests/test_examples.py drives whole loops through mpiexec)."""
import pytest
import torch as th
from torch import nn

from test_rng_amp import FakeCuda
from improved_diffusion import logger
from improved_diffusion.ckpt import rng
from improved_diffusion.ckpt.checkpointer import CheckpointConfig, Checkpointer


class Counter:
    """A state of the loop's own: anything with state_dict()/load_state_dict()."""

    def __init__(self, name="counter", n=0):
        self.name, self.n = name, n

    def state_dict(self):
        return {"name": self.name, "n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def parts(seed=0):
    th.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_parameter("frozen", nn.Parameter(th.randn(3), requires_grad=False))
    opt = th.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ema = [p.detach().clone() for p in model.parameters()]
    return model, opt, ema


def train_a_step(model, opt, ema):
    loss = model(th.randn(8, 4)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with th.no_grad():
        for e, p in zip(ema, model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)


def config(log_dir, **kw):
    return CheckpointConfig.from_flags({"log_dir": str(log_dir)}, async_save=False, **kw)


def make(log_dir, model, opt, ema, states=None, run_flags=None, **kw):
    return Checkpointer(config(log_dir, **kw), model=model, optimizer=opt, emas={"0.9": ema},
                        batch_size=8, seed=1, states=states or {}, run_flags=run_flags or {})


@pytest.fixture
def log(tmp_path):
    with logger.scoped_configure(dir=str(tmp_path), format_strs=["log"], rank=0):
        yield tmp_path


def test_a_save_and_a_resume_give_back_every_tensor_buffer_state_and_the_rng(log):
    model, opt, ema = parts()
    counter = Counter(n=7)
    ckpt = make(log, model, opt, ema, {"counter": counter})
    assert ckpt.resume() == 0
    for _ in range(3):
        train_a_step(model, opt, ema)
    ckpt.save(3)
    rng_after_save = th.get_rng_state()
    want = ({k: v.clone() for k, v in model.state_dict().items()}, [e.clone() for e in ema],
            opt.state_dict())

    model2, opt2, ema2 = parts(seed=5)
    counter2 = Counter()
    ema_ref = ema2  # the loop's reference must stay valid: the EMA is loaded in place
    th.manual_seed(99)
    assert make(log, model2, opt2, ema2, {"counter": counter2}).resume() == 3
    assert counter2.n == 7 and ema_ref is ema2
    assert all(th.equal(v, model2.state_dict()[k]) for k, v in want[0].items())
    assert int(model2.state_dict()["1.num_batches_tracked"]) == 3
    assert all(th.equal(a, b) for a, b in zip(want[1], ema2))
    assert th.equal(opt2.state_dict()["state"][0]["exp_avg"], want[2]["state"][0]["exp_avg"])
    assert th.equal(th.get_rng_state(), rng_after_save)
    assert "resumed at step 3" in (log / "log.txt").read_text()


def test_a_resume_says_which_settings_and_states_changed(log):
    model, opt, ema = parts()
    ckpt = make(log, model, opt, ema, {"sampler": Counter("uniform", 2), "scaler": Counter()},
                run_flags={"lr": 1e-4, "weight_decay": 0.0})
    ckpt.resume()
    ckpt.save(1)
    model, opt, ema = parts()
    sampler = Counter("loss-second-moment")
    make(log, model, opt, ema, {"sampler": sampler, "scaler": None, "extra": Counter()},
         run_flags={"lr": 2e-4, "weight_decay": 0.0}).resume()
    text = (log / "log.txt").read_text()
    assert "resume: --lr 0.0001 -> 0.0002" in text and "--weight_decay" not in text
    assert "resume: sampler changed (uniform -> loss-second-moment)" in text and sampler.n == 0
    assert "the checkpoint holds scaler state, which this run does not use" in text
    assert "no extra state in the checkpoint; it starts fresh" in text


def test_a_cuda_generator_that_cannot_be_put_back_is_logged_with_its_rank(log, monkeypatch):
    model, opt, ema = parts()
    FakeCuda(monkeypatch, device=0)
    ckpt = make(log, model, opt, ema)
    ckpt.resume()
    ckpt.save(1)
    FakeCuda(monkeypatch, device=None)
    model, opt, ema = parts()
    make(log, model, opt, ema).resume()
    assert "resume: rank 0: the CUDA RNG state was not restored" in (log / "log.txt").read_text()


class Tracked(Counter):
    """A state with the optional parts: its own file at even steps, tensors that must be
    finite, and no fresh start on a resume without its state."""

    def __init__(self):
        super().__init__("tracked")
        self.weights = [th.zeros(3)]

    def save_files(self, step):
        from improved_diffusion.ckpt import checkpoint as C

        return {} if step % 2 else {C.phema_filename(0.1, step): C.phema_payload(
            step, 0.1, step, {"w": self.weights[0]}, None, ["w"])}

    def finite_tensors(self):
        return {"tracked weights": self.weights}

    def resume_without_state(self, step):
        from improved_diffusion.infra.errors import UserError

        raise UserError(f"step {step} has no tracked state")


def test_a_states_own_files_join_the_step_its_tensors_are_checked_and_it_may_refuse(log):
    import json

    from improved_diffusion.ckpt.checkpointer import NonFiniteError
    from improved_diffusion.infra.errors import UserError

    model, opt, ema = parts()
    ckpt = make(log, model, opt, ema, {"tracked": Tracked(), "counter": Counter()})
    ckpt.resume()
    ckpt.save(1)
    ckpt.save(2)
    assert "phema_0.100_000002.pt" in json.loads((log / "manifest000002.json").read_text())[
        "files"] and not (log / "phema_0.100_000001.pt").exists()
    ckpt.states["tracked"].weights[0][1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"\(tracked weights: 1 tensor\(s\)\)"):
        ckpt.save(3)
    assert not (log / "model000003.pt").exists()
    model, opt, ema = parts()
    with pytest.raises(UserError, match="step 2 has no tracked state"):
        make(log, model, opt, ema, {"counter": Counter(), "later": Tracked()}).resume()


def test_states_may_not_take_the_trainer_states_own_names(log):
    model, opt, ema = parts()
    with pytest.raises(ValueError, match="rng"):
        make(log, model, opt, ema, {"rng": Counter()})


def test_the_config_checks_its_values_and_names_the_flag(tmp_path):
    from improved_diffusion.infra.errors import UsageError

    with pytest.raises(UsageError, match="--keep_checkpoints must be >= 0"):
        config(tmp_path, keep_checkpoints=-1)
    with pytest.raises(UsageError, match="--log_dir"):
        CheckpointConfig.from_flags({"log_dir": ""})
    assert config(tmp_path).save_interval == 10000  # script_util.train_defaults()'s
    assert rng is not None


# ---------------------------------------------------------------------- preemption signals


def test_without_preemption_install_watch_signals_owns_the_signals_for_its_block_alone(log):
    import os
    import signal

    got = []
    before = {s: signal.signal(s, lambda n, f: got.append(n)) for s in (signal.SIGTERM,
                                                                         signal.SIGUSR1)}
    try:
        model, opt, ema = parts()
        ckpt = make(log, model, opt, ema)
        ckpt.resume()
        with ckpt.watch_signals():
            ckpt.step_begins()
            assert not ckpt.stop_requested()
            os.kill(os.getpid(), signal.SIGUSR1)
            ckpt.step_begins()
            assert ckpt.stop_requested() and got == []  # the block's handler, not the old one
            ckpt.save_for_preemption(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [signal.SIGTERM]  # the previous handler is back after the block
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert "preempted (SIGUSR1 on some rank): saved step 1; exiting with code 75" in (
        log / "log.txt").read_text()
    assert (log / "manifest000001.json").exists()


# A script that installed preemption.py first (as train.py does) gets SIGTERM while it resumes,
# before the loop watches for signals: the checkpointer's loop must see it, through the one
# process-wide handler.
SIGNAL_DURING_RESUME = r"""
import os, signal, sys
from improved_diffusion.infra import preemption
preemption.install()
import test_checkpointer as T
from improved_diffusion import logger
logger.configure(dir=sys.argv[1], format_strs=["stdout", "log"])
model, opt, ema = T.parts()
ckpt = T.make(sys.argv[1], model, opt, ema)
ckpt.resume()
os.kill(os.getpid(), signal.SIGTERM)  # arrives during the resume
with ckpt.watch_signals():
    assert signal.getsignal(signal.SIGTERM) is preemption._handler, "a second owner of SIGTERM"
    ckpt.step_begins()
    if ckpt.stop_requested():
        sys.exit(ckpt.save_for_preemption(1))
print("the signal was lost")
"""


def test_a_signal_before_the_loop_after_preemption_install_is_saved_at_the_first_boundary(
        tmp_path):
    import subprocess

    from conftest import PY, REPO, child_env, hang_s

    proc = subprocess.run([PY, "-c", SIGNAL_DURING_RESUME, str(tmp_path)], cwd=REPO / "tests",
                          env=child_env(), capture_output=True, text=True, timeout=hang_s(60))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75, out[-3000:]
    assert "preempted (SIGTERM on some rank): saved step 1; exiting with code 75" in out
    assert (tmp_path / "manifest000001.json").exists()
