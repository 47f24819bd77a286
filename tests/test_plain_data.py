"""TrainLoop with upstream-style data: a plain generator of (batch, cond) (issue 9, item 7).

Upstream's load_data yields batches forever and has no state_dict / load_state_dict / position.
The loop must train, save (recording that the data position is not restorable) and resume from
such data, saying once that the position cannot be restored and reseeding from (seed, step, rank).
"""
import pytest
import torch as th

from improved_diffusion import logger, train_util
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults

FLAGS = dict(model_and_diffusion_defaults(), image_size=8, num_channels=32, num_res_blocks=1,
             attention_resolutions="", diffusion_steps=20, noise_schedule="cosine")
RESEED_NOTE = "cannot be put back at its saved position exactly"


def upstream_style_data(seed, batch_size=2):
    """Like upstream's load_data: an endless generator of (th.float32 [B, 3, 8, 8], {})."""
    g = th.Generator().manual_seed(seed)
    while True:
        yield th.rand(batch_size, 3, 8, 8, generator=g) * 2 - 1, {}


def make_loop(log_dir, data, max_steps):
    train_util.seed_rngs(0, 0, 0)
    model, diffusion = create_model_and_diffusion(**FLAGS)
    return train_util.TrainLoop(
        model=model, diffusion=diffusion, data=data, batch_size=2, microbatch=-1, lr=1e-3,
        ema_rate="0.9", log_interval=1, save_interval=2, resume_checkpoint="",
        log_dir=str(log_dir), model_flags=FLAGS, max_steps=max_steps, seed=7,
    )


def load(path):
    return th.load(path, weights_only=True, map_location="cpu")


@pytest.fixture(autouse=True)
def _record_rng(monkeypatch):
    """Record the torch RNG state at the end of TrainLoop.__init__, so the test can compare it."""
    init = train_util.TrainLoop.__init__

    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.rng_at_build = th.get_rng_state()

    monkeypatch.setattr(train_util.TrainLoop, "__init__", wrapped)


@pytest.mark.timeout(120)
def test_a_plain_generator_trains_saves_and_resumes_with_one_note_and_a_reseed(tmp_path):
    log = tmp_path / "log"
    with logger.scoped_configure(dir=str(log), format_strs=["log"], rank=0):
        assert make_loop(log, upstream_style_data(0), max_steps=3).run_loop() == 0
        trainer = load(log / "opt000003.pt")["trainer"]
        assert trainer["data"] == {"restorable": False, "iterator": "generator"}
        assert all((log / f"manifest{s:06d}.json").exists() for s in (2, 3))

        loop = make_loop(log, upstream_style_data(1), max_steps=5)
        assert loop.step == 3
        train_util.seed_rngs(7, 3, 0)  # what the resume must leave: RNGs of (seed, step, rank)
        assert th.equal(loop.rng_at_build, th.get_rng_state())
        assert loop.run_loop() == 0
    text = (log / "log.txt").read_text()
    assert "resumed at step 3" in text
    assert text.count(RESEED_NOTE) == 1
    assert "(seed=7, step=3, rank)" in text
    assert "no data position in the checkpoint" not in text
    assert (log / "manifest000005.json").exists()
    assert load(log / "opt000005.pt")["trainer"]["step"] == 5
