"""What a step under --global_batch_size computes, against the plain float computation of the same
step (issue 56 item 12): the other tests compare runs with G against runs with G, which a
reduction wrong in the same way on every rank count passes (a gradient rescaled by the wrong
exponent moves nothing that Adam sees but its epsilon). tests/virtual_shards_job.py runs the
steps and their reference (each shard's float32 gradient in its own stream, the float64 mean).

- the step's gradient is the float mean of the K shard gradients, to the fixed-point sum's
  precision, on 1 rank and on 2 (mpiexec);
- a step whose gradient outgrew its fixed-point range runs its shards again, and its gradient
  is still that mean; a step within range runs them once;
- BatchNorm buffers: every rank ends the step with the buffers shard 0 left (rank 0's, sent);
- a validation batch's shards draw from a stream of their own, not the training's.
"""
import pytest
import torch as th

from conftest import MPIEXEC, PY, REPO, _run
from improved_diffusion.virtual_shards import ShardPlan, VirtualShards
from virtual_shards_job import G, M, SEED, global_batch, make_model, run, shard_backward

K = G // M
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_float_mean(record, step):
    """Each gradient within two float32 roundings (and the fixed-point resolution, far below
    them) of the float64 mean of the shard gradients."""
    for i, (got, want) in enumerate(zip(record["grads"], record["reference"])):
        bound = want.abs() * 2.0 ** -23 + float(want.abs().max()) * 2.0 ** -40
        off = (got.double() - want).abs()
        assert bool((off <= bound).all()), (step, i, float((off / want.abs()).max()),
                                           got.flatten()[:4], want.flatten()[:4])


def test_the_gradient_of_a_step_is_the_float_mean_of_its_shard_gradients_on_one_rank():
    records = run(1, 0)
    for step, rec in enumerate(records, start=1):
        assert_float_mean(rec, step)
    # the first step has no range yet (its shards run twice); the second fits: once
    assert [rec["calls"] for rec in records] == [2 * K, K]


@pytest.mark.timeout(180)
def test_on_two_ranks_the_gradient_is_the_float_mean_and_every_rank_holds_shard_0s_buffers(
        tmp_path):
    """mpiexec -n 2: rank 1 runs shards 2 and 3 only, so its own buffers are those its last
    shard left; after the step both ranks hold the ones shard 0 left (sent from rank 0), and
    the gradient is the float mean of all 4 shards' (the sum over both ranks, divided by K),
    bitwise the 1-rank run's."""
    out = tmp_path / "records.pt"
    _run([MPIEXEC, "-n", "2", PY, REPO / "tests" / "virtual_shards_job.py", out], timeout=120)
    records = th.load(out, weights_only=True)
    alone = run(1, 0)
    for step, (rec, one) in enumerate(zip(records, alone), start=1):
        assert_float_mean(rec, step)
        assert all(th.equal(a, b) for a, b in zip(rec["grads"], one["grads"])), step
        assert len(rec["buffers"]) == 2
        for rank, buffers in enumerate(rec["buffers"]):
            assert all(th.equal(a, b) for a, b in zip(buffers, rec["shard0_buffers"])), \
                (step, rank)
    assert not th.equal(records[0]["shard0_buffers"][0], make_model()[1].running_mean)


def test_a_step_whose_gradient_outgrew_its_range_runs_its_shards_again_and_is_still_the_mean():
    """Step 2's loss is 2**20 times step 1's: its gradients pass the range step 1 set
    (HEADROOM_BITS above its largest), so its shards run again at this step's range (a second
    pass, counted), and its gradient is the float mean; without the second pass the quantized
    values would be clamped far off it."""
    records = run(1, 0, scales=(1.0, 2.0 ** 20))
    assert [rec["calls"] for rec in records] == [2 * K, 2 * K]
    assert records[-1]["redos"] == 2
    for step, rec in enumerate(records, start=1):
        assert_float_mean(rec, step)


def test_the_validation_shards_draw_a_stream_of_their_own_not_the_trainings():
    """VirtualShards.records (a loop's validation batch in shards) at the step that trained
    on the same samples: each shard's draws differ from that shard's training draws, and are
    the same again when asked again."""
    model = make_model()
    shards = VirtualShards(ShardPlan(G, M, 1, 0), model, SEED)
    batch = global_batch(1)
    trained = shards.step(1, batch, {}, shard_backward(model, 1.0, []))["draw"]

    def evaluate(micro, cond):  # the same draw as the training shard's, without a backward
        return {"draw": th.randn(micro.shape[0], 2)[:, 0]}

    val = shards.records(1, batch, {}, evaluate)["draw"]
    assert val.shape == trained.shape == (G,)
    assert bool((val != trained).all()), (val, trained)
    assert th.equal(shards.records(1, batch, {}, evaluate)["draw"], val)
