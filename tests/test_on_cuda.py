"""The CUDA paths on a real GPU (marker ``cuda``; skipped where torch sees no GPU, as on CI's
CPUs, whose twins of these paths are tested elsewhere). benchmarks/gpu_check.sh runs
``pytest -m cuda`` on the GPU machine: these, and tests/test_cuda_paths.py's faked devices
with a real one present.
"""
import pytest
import torch as th

from improved_diffusion import logger, train_util
from improved_diffusion.script_util import create_model_and_diffusion, model_and_diffusion_defaults

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not th.cuda.is_available(), reason="no CUDA device here")]

TINY = dict(image_size=8, num_channels=32, num_res_blocks=1, attention_resolutions="4",
            diffusion_steps=20, noise_schedule="cosine")


def cuda_loop(log_dir, **kw):
    """A TrainLoop of a tiny UNet (one attention level) on the GPU, fixed random batches."""
    flags = dict(model_and_diffusion_defaults(), **TINY)
    train_util.seed_rngs(0)
    model, diffusion = create_model_and_diffusion(**flags)
    gen = th.Generator().manual_seed(1)
    batches = iter(lambda: (th.randn(4, 3, 8, 8, generator=gen), {}), None)
    loop = train_util.TrainLoop(
        model=model, diffusion=diffusion, data=batches, batch_size=4, microbatch=-1, lr=1e-3,
        ema_rate="0.99", log_interval=100, save_interval=0, resume_checkpoint="",
        log_dir=str(log_dir), model_flags=flags, **kw)
    assert loop.device.type == "cuda"
    return loop, batches


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_an_async_save_on_cuda_writes_the_state_of_its_pause_while_later_steps_change_it(
        tmp_path, writer):
    """The save copies CUDA tensors into page-locked memory without blocking, then synchronises:
    the files must hold the weights, EMA and Adam moments as they were at the pause, although
    two steps ran on the GPU while they were written."""
    logger.configure(dir=str(tmp_path), format_strs=["log"])
    loop, batches = cuda_loop(tmp_path, async_save=True, save_writer=writer, max_steps=10)
    try:
        for _ in range(2):
            loop.run_step(*next(batches))
        loop.save()
        at_pause = {
            "model": {n: p.detach().cpu().clone() for n, p in loop.model.named_parameters()},
            "ema": [p.detach().cpu().clone() for p in loop.ema_params[0]],
            "opt": [v.detach().cpu().clone() for st in loop.opt.state.values()
                    for v in st.values() if isinstance(v, th.Tensor) and v.dim()]}
        for _ in range(2):
            loop.run_step(*next(batches))
        loop.checkpointer.wait_for_save()
        assert loop.checkpointer.save_writer_chosen == writer
        model = th.load(tmp_path / "model000002.pt", map_location="cpu", weights_only=True)
        weights = model.get("state_dict", model)
        for name, value in at_pause["model"].items():
            assert th.equal(weights[name], value), name
        assert not th.equal(next(loop.model.parameters()).cpu(),
                            next(iter(at_pause["model"].values())))  # the steps did change it
        ema = th.load(tmp_path / "ema_0.99_000002.pt", map_location="cpu", weights_only=True)
        ema = ema.get("state_dict", ema)
        for (name, _), value in zip(loop.model.named_parameters(), at_pause["ema"]):
            assert th.equal(ema[name], value), name
        opt = th.load(tmp_path / "opt000002.pt", map_location="cpu", weights_only=True)
        saved = [t for t in _tensors(opt["optimizer"]) if t.dim()]
        for value in at_pause["opt"]:
            assert any(t.shape == value.shape and th.equal(t, value) for t in saved)
    finally:
        loop.close()


def _tensors(obj):
    if isinstance(obj, th.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_use_fp16_on_cuda_trains_under_float16_autocast_with_a_grad_scaler_and_fp32_weights(
        tmp_path):
    logger.configure(dir=str(tmp_path), format_strs=["log"])
    loop, batches = cuda_loop(tmp_path, use_fp16=True, max_steps=10)
    try:
        assert loop.amp_dtype is th.float16 and loop.grad_scaler is not None
        before = [p.detach().clone() for p in loop.model.parameters()]
        for _ in range(3):
            loop.run_step(*next(batches))
        assert all(p.dtype is th.float32 for p in loop.model.parameters())
        assert all(th.isfinite(p).all() for p in loop.model.parameters())
        assert any(not th.equal(a, p) for a, p in zip(before, loop.model.parameters()))
        assert loop.grad_scaler.get_scale() > 0
    finally:
        loop.close()


@pytest.mark.parametrize("dtype", [th.float16, th.bfloat16])
def test_the_unet_and_dit_attention_run_on_sdpa_flash_kernel_under_autocast(dtype):
    """Forward and backward with SDPA limited to its flash backend: an error here means the
    attention falls back to a slower kernel on this GPU (benchmarks/train.py's sdpa_kernels
    says which ran)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from improved_diffusion.dit import Attention
    from improved_diffusion.unet import AttentionBlock

    dev = th.device("cuda")
    for block, x in ((AttentionBlock(128, num_heads=4), th.randn(2, 128, 16, 16)),
                     (Attention(256, num_heads=4), th.randn(2, 64, 256))):
        block.to(dev)
        x = x.to(dev).requires_grad_()
        with th.autocast("cuda", dtype=dtype), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = block(x)
        out.float().sum().backward()
        assert x.grad is not None and th.isfinite(x.grad).all(), type(block).__name__


def test_the_process_device_is_the_gpu_and_the_process_group_backend_nccl(tmp_path):
    from improved_diffusion import dist_util
    from improved_diffusion.infra import fsdp

    assert dist_util.dev().type == "cuda"
    fsdp.ensure_process_group(dist_util.dev())
    import torch.distributed as dist

    try:
        assert dist.get_backend() == "nccl"
        t = th.ones(3, device="cuda")
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
