"""Promises of the storage layer and of a sharded step in a bucket that no test caught when broken
(issue 56 item 12), each against a real server (tests/stores.py) behind the counting proxy:

- a store's 4xx answer other than 403 (400, 404, 409, 412) is final: never retried by us;
- a streamed write that fails while the store is up publishes nothing under its final name;
- a sharded step's upload never overwrites an object already at one of its final names;
- a failed sharded save removes the objects its ranks uploaded, every rank's (docs/checkpoints.md:
  "A failed save removes the objects it uploaded, and only those");
- the flags of a checkpoint in a bucket are read with ranged requests, not the whole object.
"""
import gc
import os

import pytest
import torch

import stores
from conftest import MPIEXEC, PY, REPO, _run
from test_object_store import any_store, new_bucket, s3  # noqa: F401 (fixtures)



@pytest.fixture
def proxied(monkeypatch):
    """``proxied(store)``: a Proxy in front of ``store``, this process's clients pointed at it
    (botocore's own attempts: 1); undone after the test."""
    from improved_diffusion.infra import storage

    def make(store):
        proxy = stores.Proxy(store.port)
        for k, v in store.env_with(proxy.port).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        storage.forget_clients()
        return proxy

    yield make
    monkeypatch.undo()
    storage.forget_clients()


# ------------------------------------------------------------------------ a) 4xx: not retried


FINAL_4XX = [(400, "InvalidArgument", "Invalid argument."),
             (404, "NoSuchKey", "The specified key does not exist."),
             (409, "Conflict", "The request conflicts with the state of the resource."),
             (412, "PreconditionFailed", "At least one of the preconditions did not hold.")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("any_store", ["s3", "gs", pytest.param("az", marks=pytest.mark.slow)],
                         indirect=True)
def test_a_4xx_answer_other_than_403_is_never_retried(any_store, proxied, monkeypatch):
    """400, 404, 409 and 412 to a put, a read and a listing: each call makes the requests the
    client makes with our retries off (ID_STORE_RETRY_S=0), not one more: a 4xx is the store's
    final word. (403: test_object_store's test_a_4xx_answer_is_not_retried_and_a_503_is.)"""
    storage = any_store.client()
    bucket = new_bucket(any_store)
    storage.put(f"{bucket}/run/x.txt", b"x")
    proxy = proxied(any_store)
    monkeypatch.setattr(storage, "RETRY_PAUSES", (0.05,) * 6)  # a retry costs little here
    calls = {"put": lambda: storage.put(f"{bucket}/run/a.txt", b"a"),
             "read": lambda: storage.read_bytes(f"{bucket}/run/x.txt"),
             "list": lambda: storage.listdir(f"{bucket}/run")}

    def requests_of(name, status, code, message):
        before = len(proxy.requests)
        proxy.answer(status, code, message)
        try:
            with pytest.raises(OSError):
                calls[name]()
        finally:
            proxy.heal()
        return len(proxy.requests) - before

    for status, code, message in FINAL_4XX:
        for name in calls:
            monkeypatch.setenv(storage.RETRY_ENV, "0")
            client = requests_of(name, status, code, message)
            monkeypatch.delenv(storage.RETRY_ENV)
            ours = requests_of(name, status, code, message)
            assert client >= 1 and ours == client, (status, name, client, ours,
                                                    proxy.requests[-ours:])
    assert storage.read_bytes(f"{bucket}/run/x.txt") == b"x"  # the store was up throughout


# ---------------------------------------------------- b) a failed streamed write: not published


# The request that uploads the first part of model000002.pt (S3's UploadPart, GCS' first chunk
# of a resumable upload, Azure's first Put Block).
FIRST_PART = {"s3": r"model000002\.pt\?partNumber=1&",
              "gs": r"name=run/model000002\.pt&.*upload_id=",
              "az": r"model000002\.pt\?.*comp=block"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("any_store", [  # gs: gcsfs retries its discard's DELETE for ~30 s
    "s3", pytest.param("gs", marks=pytest.mark.slow), pytest.param("az", marks=pytest.mark.slow)],
                         indirect=True)
def test_a_streamed_write_that_fails_while_the_store_is_up_is_not_published(
        any_store, proxied, monkeypatch):
    """A step's model file streamed in parts: the store refuses its first part (400, final)
    while everything else goes through; then a streamed write whose own writer fails after two
    parts are up. Neither object appears under its final name (nor after the garbage
    collector closed what was left open), and step 1 stays the step a resume takes."""
    from improved_diffusion.ckpt import run_dir
    from improved_diffusion.ckpt.checkpoint import CheckpointError
    storage = any_store.client()
    monkeypatch.setattr(storage, "BLOCK_BYTES", 5 << 20)  # S3's smallest part: fewer bytes
    url = f"{new_bucket(any_store)}/run"
    proxy = proxied(any_store)
    run_dir.write_step(url, 1, {"model000001.pt": {"w": torch.ones(10)}, "opt000001.pt": b"o"})
    before = storage.listdir(url)

    proxy.answer(400, "InvalidArgument", "Invalid part.", after=FIRST_PART[any_store.scheme],
                 times=1)
    big = {"w": torch.randn(3 << 20), "v": torch.randn(3 << 20)}  # 24 MiB: parts, in writes
    with pytest.raises(CheckpointError, match="step 2 was not saved"):
        run_dir.write_step(url, 2, {"model000002.pt": big, "opt000002.pt": b"o"})
    assert proxy.failed == 1, proxy.requests
    gc.collect()  # fsspec's files commit what they hold when collected open
    assert storage.listdir(url) == before

    with pytest.raises(RuntimeError, match="the writer's own failure"):
        with storage.open_write(f"{url}/streamed.bin") as f:
            for _ in range(2):
                f.write(os.urandom(storage.BLOCK_BYTES))  # whole parts, uploaded as they fill
            raise RuntimeError("the writer's own failure")
    gc.collect()
    assert storage.listdir(url) == before
    assert run_dir.plan_resume(url, "").step == 1


# -------------------------------------------------------------- c), d) a sharded step's objects


def files(step):
    return {f"model{step:06d}.pt": {"step": step, "state_dict": {"w": torch.full((64,), step)}}}


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's, in one process
def test_a_sharded_upload_never_overwrites_an_object_at_its_final_name(s3):
    """An object appears at one of step 2's final names after the save's start checked that
    the folder is free (another writer, in the race the conditional create settles): the
    upload refuses it in one line, no manifest is written, and the other writer's object is
    still there, byte for byte (neither overwritten nor removed with the failed save)."""
    from improved_diffusion.ckpt import run_dir, sharded
    from improved_diffusion.ckpt.checkpoint import CheckpointError
    storage = s3.client()
    url = f"{new_bucket(s3)}/run"
    sharded.write_step(url, 1, files(1))
    pending = sharded.start_save(url, 2, files(2), mode="sync")
    theirs = f"{url}/step000002.dcp/__0_0.distcp"
    storage.put(theirs, b"another writer's object")
    with pytest.raises(CheckpointError, match=f"{theirs}: already exists; refusing to "
                                              f"overwrite"):
        pending.collect()
    assert storage.read_bytes(theirs) == b"another writer's object"
    assert storage.listdir(f"{url}/step000002.dcp") == ["__0_0.distcp"]  # ours went
    assert "manifest000002.json" not in storage.listdir(url)
    assert run_dir.plan_resume(url, "").step == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("any_store", ["s3", pytest.param("az", marks=pytest.mark.slow)],
                         indirect=True)  # gs: its small uploads name the object in the body only
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_failed_sharded_save_to_a_bucket_removes_the_objects_it_uploaded(any_store, proxied):
    """Step 2's index (.metadata) goes up, then the store refuses the shard object (403): the
    save is one line, and the step's folder is gone from the bucket (the objects already up
    removed), step 1 untouched and the one a resume takes."""
    from improved_diffusion.ckpt import run_dir, sharded
    from improved_diffusion.ckpt.checkpoint import CheckpointError
    storage = any_store.client()
    url = f"{new_bucket(any_store)}/run"
    sharded.write_step(url, 1, files(1))
    before = {n: storage.listdir(f"{url}/{n}") if n.endswith(".dcp") else None
              for n in storage.listdir(url)}
    proxy = proxied(any_store)
    proxy.answer(403, "AccessDenied", "Access Denied.", after=r"__0_0\.distcp", times=1)
    with pytest.raises(CheckpointError, match="permission denied") as got:
        sharded.write_step(url, 2, files(2))
    assert "\n" not in str(got.value)
    assert proxy.failed == 1, proxy.requests
    assert any(".metadata" in r for r in proxy.requests), proxy.requests  # it was up
    after = {n: storage.listdir(f"{url}/{n}") if n.endswith(".dcp") else None
             for n in storage.listdir(url)}
    assert after == before
    assert run_dir.plan_resume(url, "").step == 1


@pytest.mark.timeout(240)
def test_a_sharded_save_that_fails_on_rank_0_removes_rank_1s_objects_too(s3, proxied, tmp_path):
    """mpiexec -n 2 (tests/sharded_driver.py, FSDP shards): step 2's rank 1 shard goes up, rank
    0's is refused (403) after its index: rank 0 removes every rank's objects of the step, its
    own and rank 1's (which every rank reports), and both ranks say the one line."""
    from improved_diffusion.ckpt import run_dir
    storage = s3.client()
    url = f"{new_bucket(s3)}/run"
    proxy = proxied(s3)
    proxy.answer(403, "AccessDenied", "Access Denied.", after=r"step000002\.dcp/__0_0\.distcp",
                 times=1)
    env = {k: os.environ[k] for k in s3.env}
    out = _run([MPIEXEC, "-n", "2", PY, REPO / "tests" / "sharded_driver.py", "save",
                "--log_dir", url, "--steps", "1,2"], timeout=180, env=dict(
                    env, AWS_MAX_ATTEMPTS="1"), check=False, cwd=tmp_path).stdout
    assert proxy.failed == 1, (proxy.requests, out[-3000:])
    assert any("step000002.dcp/__1_0.distcp" in r and r.startswith("PUT") for r in
               proxy.requests), proxy.requests  # rank 1's object was up
    for rank in (0, 1):
        assert f"SAVE FAILED rank {rank}: " in out and "permission denied" in out, out[-3000:]
    proxy.heal()
    names = storage.listdir(url)
    assert names == ["manifest000001.json", "step000001.dcp"], names
    assert run_dir.plan_resume(url, "").step == 1


# ----------------------------------------------------------------- e) flags: ranged requests


@pytest.mark.timeout(120)
def test_the_flags_of_a_checkpoint_in_a_bucket_are_read_without_its_tensors(s3, proxied):
    """checkpoint.read_flags (what a flagless resume and the sampler read first) of a 24 MiB
    model file in a bucket: the server sends well under a tenth of the object (ranged requests
    of storage.PEEK_BYTES, its pickle and zip directory only), and the flags are the file's."""
    import io

    from improved_diffusion.ckpt import checkpoint
    storage = s3.client()
    url = f"{new_bucket(s3)}/run/model000001.pt"
    flags = {"image_size": 8, "num_channels": 32, "learn_sigma": True}
    buf = io.BytesIO()
    torch.save(checkpoint.model_payload(1, {"w": torch.randn(6 << 20)}, flags), buf)
    size = len(buf.getvalue())
    storage.put(url, buf.getvalue())
    proxy = proxied(s3)
    assert checkpoint.read_flags(url) == flags
    assert 0 < proxy.relayed < size / 10, (proxy.relayed, size, proxy.requests)
