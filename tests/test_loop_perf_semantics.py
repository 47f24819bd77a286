"""The loop's faster forms keep upstream's semantics (issue 11, loop half).

EMA through foreach kernels, losses and grad norm accumulated on the device and read once per
dumpkvs, fused/foreach AdamW, and the per-step flags (preemption, a failed background save)
exchanged by one async all-reduce: each is checked against the plain form it replaced.
"""
import os
import signal

import numpy as np
import pytest
import torch as th

from improved_diffusion import logger, train_util
from improved_diffusion.infra.errors import UserError
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults

FLAGS = dict(model_and_diffusion_defaults(), image_size=8, num_channels=32, num_res_blocks=1,
             attention_resolutions="4", diffusion_steps=20, noise_schedule="cosine")


def _params(seed, shapes=((3, 4), (7,), (2, 3, 5), (1,))):
    g = th.Generator().manual_seed(seed)
    return [th.randn(s, generator=g) for s in shapes]


@pytest.mark.parametrize("rate", [0.9999, 0.999, 0.9, 0.0, 1.0])
def test_the_foreach_ema_equals_upstreams_per_parameter_formula_bit_for_bit(rate):
    ema, src = _params(0), _params(1)
    reference = [t.clone() for t in ema]
    for _ in range(3):
        for targ, s in zip(reference, src):  # upstream's update_ema
            targ.detach().mul_(rate).add_(s.detach(), alpha=1 - rate)
        train_util.update_ema(ema, src, rate=rate)
    for a, b in zip(ema, reference):
        assert th.equal(a, b)


def _upstream_log_loss_dict(log, num_timesteps, ts, losses):
    """Upstream's log_loss_dict: one host read per value (the reference)."""
    for key, values in losses.items():
        log.logkv_mean(key, values.mean().item())
        for sub_t, sub_loss in zip(ts.cpu().numpy(), values.detach().cpu().numpy()):
            log.logkv_mean(f"{key}_q{int(4 * sub_t / num_timesteps)}", sub_loss)


def test_losses_accumulated_on_the_device_dump_the_same_means_as_upstreams_per_value_logging():
    _, diffusion = create_model_and_diffusion(**FLAGS)
    g = th.Generator().manual_seed(3)
    steps = []
    for size in (4, 4, 3, 1):  # microbatches of different sizes, quartiles left empty at times
        ts = th.randint(0, diffusion.num_timesteps, (size,), generator=g)
        steps.append((ts, {"loss": th.rand(size, generator=g), "mse": th.rand(size, generator=g)}))
    ours, ref = logger.Logger(None, []), logger.Logger(None, [])
    prev, logger.Logger.CURRENT = logger.Logger.CURRENT, ours
    try:
        for ts, losses in steps:
            train_util.log_loss_dict(diffusion, ts, losses)
            _upstream_log_loss_dict(ref, diffusion.num_timesteps, ts, losses)
        ours.logkv_mean("grad_norm", 2.0)  # a host value of the same key merges with the device's
        ref.logkv_mean("grad_norm", 2.0)
        ours.logkv_mean_device("grad_norm", th.tensor(5.0), 1)
        ref.logkv_mean("grad_norm", 5.0)
        got, want = ours.dumpkvs(), ref.dumpkvs()
    finally:
        logger.Logger.CURRENT = prev
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == pytest.approx(float(want[key]), rel=1e-6), key
    assert not ours.dumpkvs()  # read once: the accumulators are empty after a dump


def test_the_grad_norm_is_the_l2_norm_of_all_gradients_and_keeps_nan_and_inf():
    grads = _params(2)
    want = float(np.sqrt(sum(float((g.double() ** 2).sum()) for g in grads)))
    assert float(train_util.grad_norm(grads)) == pytest.approx(want, rel=1e-6)
    grads[1][3] = float("nan")
    assert th.isnan(train_util.grad_norm(grads))
    grads[1][3] = float("inf")
    assert th.isinf(train_util.grad_norm(grads))


def test_the_optimizer_is_adamw_fused_or_foreach_and_steps_like_the_plain_one():
    a, b = [th.nn.Parameter(p) for p in _params(4)], [th.nn.Parameter(p) for p in _params(4)]
    fast = train_util.make_adamw(a, lr=1e-2, weight_decay=0.1)
    plain = th.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fast.defaults.get("fused") or fast.defaults.get("foreach")
    for step in range(3):
        for p, q, g in zip(a, b, _params(10 + step)):
            p.grad, q.grad = g.clone(), g.clone()
        fast.step()
        plain.step()
    for p, q in zip(a, b):
        th.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


class _Data:
    """Endless (batch, cond) of [2, 3, 8, 8]; calls `hook(n)` before yielding batch n (1-based)."""

    def __init__(self, hook=None):
        self.n, self.hook = 0, hook
        self.g = th.Generator().manual_seed(0)

    def __iter__(self):
        return self

    def __next__(self):
        self.n += 1
        if self.hook:
            self.hook(self.n)
        return th.rand(2, 3, 8, 8, generator=self.g) * 2 - 1, {}


def _loop(log_dir, data, cls=train_util.TrainLoop, max_steps=6, ema_rate="0.9"):
    train_util.seed_rngs(0, 0, 0)
    model, diffusion = create_model_and_diffusion(**FLAGS)
    return cls(model=model, diffusion=diffusion, data=data, batch_size=2, microbatch=-1, lr=1e-3,
               ema_rate=ema_rate, log_interval=1, save_interval=1000, resume_checkpoint="",
               log_dir=str(log_dir), model_flags=FLAGS, max_steps=max_steps, seed=0)


def _saved_steps(log_dir):
    return sorted(int(p.name[8:14]) for p in log_dir.glob("manifest*.json"))


@pytest.mark.timeout(120)
def test_the_loops_emas_are_upstreams_formula_at_their_own_rates_applied_after_every_step(
        tmp_path):
    """Each EMA after 4 steps, in memory and in its file, equals upstream's update
    (ema = rate * ema + (1 - rate) * param) applied by this test to the parameters recorded
    after each step, from the initial weights: bit for bit, so the loop's rate (not 1 - rate,
    not another EMA's) and its place in the step are pinned."""
    log = tmp_path / "log"

    class Recording(train_util.TrainLoop):
        after = []

        def log_step(self):  # upstream's hook, called once per step after the optimizer step
            self.after.append([p.detach().clone() for p in self.model.parameters()])
            super().log_step()

    with logger.scoped_configure(dir=str(log), format_strs=["csv"], rank=0):
        loop = _loop(log, _Data(), cls=Recording, max_steps=4, ema_rate="0.9,0.5")
        start = [p.detach().clone() for p in loop.model.parameters()]
        assert loop.run_loop() == 0
    assert len(Recording.after) == 4
    names = [n for n, _ in loop.model.named_parameters()]
    for i, (rate_str, rate) in enumerate((("0.9", 0.9), ("0.5", 0.5))):
        want = [t.clone() for t in start]
        for params in Recording.after:
            for targ, src in zip(want, params):  # upstream's update_ema, one tensor at a time
                targ.mul_(rate).add_(src, alpha=1 - rate)
        assert any(not th.equal(w, s) for w, s in zip(want, start))
        assert all(th.equal(a, b) for a, b in zip(loop.ema_params[i], want)), rate_str
        saved = th.load(log / f"ema_{rate_str}_000004.pt", weights_only=True)["state_dict"]
        assert all(th.equal(saved[n], w) for n, w in zip(names, want)), rate_str


@pytest.mark.timeout(120)
def test_a_signal_during_step_2_is_seen_by_the_async_flag_exchange_and_step_3_is_saved(tmp_path):
    log = tmp_path / "log"

    def signal_at(n):
        if n == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    with logger.scoped_configure(dir=str(log), format_strs=["csv"], rank=0):
        code = _loop(log, _Data(signal_at)).run_loop()
    assert code == train_util.PREEMPTED_EXIT_CODE
    assert _saved_steps(log) == [3]  # the flag of step 2 was sent at step 3's start
    assert th.load(log / "opt000003.pt", weights_only=True)["trainer"]["step"] == 3


@pytest.mark.timeout(120)
def test_a_failed_background_save_on_a_rank_stops_the_loop_at_that_step_with_nothing_saved(
        tmp_path):
    log = tmp_path / "log"

    with logger.scoped_configure(dir=str(log), format_strs=["csv"], rank=0):
        loop = _loop(log, _Data())
        ckpt = loop.checkpointer

        def failed_at_step_2():  # what the async save reports once its thread failed
            if loop.step == 2 and ckpt._save_failure is None:
                ckpt._save_failure = UserError("step 2: disk on fire")
            return ckpt._save_failure is not None

        ckpt._local_save_failed = failed_at_step_2
        with pytest.raises(UserError, match="step 2: disk on fire"):
            loop.run_loop()
    assert loop.step == 3
    assert _saved_steps(log) == []
    rows = (log / "progress.csv").read_text().splitlines()
    assert len(rows) == 1 + 3  # the header and steps 1-3, each logged with its device values
    header = rows[0].split(",")
    last = dict(zip(header, rows[-1].split(",")))
    assert float(last["loss"]) > 0 and float(last["grad_norm"]) > 0 and last["step"] == "3"


def test_auto_num_workers_loads_in_process_on_the_cpu_and_uses_spare_cores_beside_a_gpu():
    from improved_diffusion.image_datasets import auto_num_workers

    assert auto_num_workers("cpu") == 0
    assert auto_num_workers("cuda", affinity=16, host_cpus=16, local_ranks=8) == 1
    assert auto_num_workers("cuda", affinity=32, host_cpus=32, local_ranks=4) == 7
    assert auto_num_workers("cuda", affinity=128, host_cpus=128, local_ranks=2) == 8
    assert auto_num_workers("cuda", affinity=2, host_cpus=2, local_ranks=4) == 1


def test_auto_num_workers_uses_the_cores_a_launcher_bound_the_rank_to(monkeypatch):
    """srun --cpus-per-task=6 on a 48-core node with 8 GPUs: the rank's affinity (6 cores) is
    its share already; dividing it by the GPUs again left 1 worker."""
    from improved_diffusion.image_datasets import auto_num_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    monkeypatch.setattr(os, "cpu_count", lambda: 48)
    monkeypatch.setattr(th.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert auto_num_workers("cuda") == 5


def test_num_workers_below_minus_one_is_a_usage_error_naming_the_flag(tmp_path):
    import argparse

    from improved_diffusion import train_job
    from improved_diffusion.infra.errors import UsageError
    from improved_diffusion.script_util import train_defaults

    args = argparse.Namespace(**dict(model_and_diffusion_defaults(), **train_defaults()))
    args.log_dir, args.data_dir = str(tmp_path), str(tmp_path)
    train_job.check_train_args(args)  # the default, -1 (auto), is accepted
    args.num_workers = -2
    with pytest.raises(UsageError, match=r"--num_workers must be -1 \(auto\) or >= 0"):
        train_job.check_train_args(args)
