"""torch_zip: torch.save's file, byte for byte, with the records' CRC-32s computed by us (in
parallel, during the write); any layout it does not follow is written by torch.save instead."""
import gc
import io
import zipfile
import zlib

import pytest
import torch as th

from improved_diffusion.ckpt import checkpoint as C
from improved_diffusion.ckpt import file_writer as W
from improved_diffusion.ckpt import torch_zip


class Buffer(io.BytesIO):
    def restart(self):
        self.seek(0)
        self.truncate()


@pytest.fixture(autouse=True)
def fresh_state():
    """Each test starts where a fresh process starts (the fast path not yet tried)."""
    saved = torch_zip.learned["fast"]
    torch_zip.learned["fast"] = None
    yield
    torch_zip.learned["fast"] = saved


def torch_save_bytes(obj):
    buf = io.BytesIO()
    th.save(obj, buf)
    return buf.getvalue()


def ours(obj, threads=None):
    buf = Buffer()
    torch_zip.save(obj, buf, W.crc32_combine, threads)
    return buf.getvalue()


def payload():
    shared = th.randn(4, 6)
    sd = {f"w{i}": th.randn(1000 + 37 * i) for i in range(40)}
    sd.update(big=th.randn(600_000),  # 2.4 MB: a CRC in pieces on the pool's threads
              empty=th.empty(0), bf=th.randn(33).bfloat16(), half=th.randn(5).half(),
              ints=th.arange(7), flag=th.tensor(True), column=shared[:, 1], same=shared)
    return C.model_payload(3, sd, {"image_size": 8})


@pytest.mark.parametrize("obj", [
    payload(),
    {"x": 1, "s": "no tensors at all"},
    [th.zeros(4, dtype=th.int32)],
    {"only_empty": th.empty(0), "and": th.empty(0, 3)},
], ids=["payload", "no-tensors", "one-tensor", "empty-storages"])
@pytest.mark.parametrize("threads", [None, 1], ids=["pool", "one-thread"])
def test_the_file_is_torch_saves_byte_for_byte(obj, threads, monkeypatch):
    monkeypatch.setattr(torch_zip, "PIECE_MIN", 64 << 10)  # the 2.4 MB record in many pieces
    monkeypatch.setattr(torch_zip, "PARALLEL_MIN", 128 << 10)
    monkeypatch.setattr(torch_zip, "workers", lambda: 4)  # pieces on 4 threads, any machine
    data = ours(obj, threads)
    assert torch_zip.learned["fast"] is True  # the fast path was taken, and fits this torch
    assert data == torch_save_bytes(obj)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None  # every record's CRC-32 is right


def test_with_one_thread_a_large_records_crc_runs_beside_its_write_not_before_it(monkeypatch):
    """threads=1 (the writer process's, beside the steps): a large record's CRC is computed
    whole on one CRC thread while the writing thread writes the same bytes, and is complete
    before the write returns (torch may free the bytes after); a small one at once."""
    import threading

    monkeypatch.setattr(torch_zip, "PARALLEL_MIN", 128 << 10)
    monkeypatch.setattr(torch_zip, "workers", lambda: 4)
    crcs = []  # (bytes, thread name, whether it ran while its record's write was under way)
    writing, real = {}, zlib.crc32

    def crc32(view, *a):
        crcs.append((memoryview(view).nbytes, threading.current_thread().name,
                     writing.get("n") == memoryview(view).nbytes))
        return real(view, *a)

    class Watched(Buffer):
        def write(self, data):
            n = memoryview(data).nbytes
            writing["n"] = n
            while n >= 128 << 10 and not any(c[0] == n for c in crcs):
                pass  # the record's CRC runs meanwhile (on another thread: else a hang)
            try:
                return super().write(data)
            finally:
                writing["n"] = None

    monkeypatch.setattr(torch_zip.zlib, "crc32", crc32)
    buf = Watched()
    obj = payload()
    torch_zip.save(obj, buf, W.crc32_combine, threads=1)
    assert buf.getvalue() == torch_save_bytes(obj)
    big = [c for c in crcs if c[0] >= 128 << 10]
    assert len(big) == 1 and big[0][1].startswith("checkpoint-crc") and big[0][2], crcs
    assert all(name == threading.current_thread().name for n, name, _ in crcs if n < 128 << 10)


def test_a_checkpoint_written_this_way_reads_back_through_the_crc_checking_reader(tmp_path):
    obj = payload()
    path = str(tmp_path / "model000003.pt")
    info = W.write_file(path, obj)
    assert torch_zip.learned["fast"] is True
    raw = open(path, "rb").read()
    assert info == {"size": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}
    back = C.load_file(path)  # each record's CRC-32 checked as it is read
    assert back.kind == "model" and back.step == 3
    for k, v in obj["state_dict"].items():
        assert back.state_dict[k].dtype == v.dtype and th.equal(back.state_dict[k], v), k


def test_a_layout_it_does_not_follow_is_written_again_by_torch_save(tmp_path):
    """Torch's serialization id, with its CRCs off, depends on the content of a record whose
    bytes begin like a data descriptor (``PK\\x07\\x08``): not derived the way torch_zip
    recomputes it. That is found before the file is complete; the file is written again from
    its start by torch.save (the same bytes as torch.save), and so are the later ones."""
    odd = {"m": th.tensor([0x08074B50, 0, 0, 0], dtype=th.int32)}
    buf = Buffer()
    torch_zip.save(odd, buf, W.crc32_combine)
    gc.collect()  # torch's abandoned writer finishes its zip as it is destroyed: not into buf
    assert torch_zip.learned["fast"] is False and buf.getvalue() == torch_save_bytes(odd)
    torch_zip.learned["fast"] = None
    path = str(tmp_path / "model000001.pt")
    info = W.write_file(path, odd)
    raw = open(path, "rb").read()
    assert torch_zip.learned["fast"] is False
    assert raw == torch_save_bytes(odd)
    assert info == {"size": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}
    obj = payload()
    assert ours(obj) == torch_save_bytes(obj) and torch_zip.learned["fast"] is False


def test_a_torch_without_the_internals_it_uses_gets_torch_save(monkeypatch):
    def no_such_signature(*args):
        raise TypeError("PyTorchFileWriter(): incompatible constructor arguments")

    monkeypatch.setattr(torch_zip, "_torch_writer", no_such_signature)
    obj = payload()
    assert ours(obj) == torch_save_bytes(obj) and torch_zip.learned["fast"] is False


def test_an_object_pickle_refuses_is_torch_saves_error_and_the_fast_path_stays():
    with pytest.raises(Exception) as ours_error:
        ours({"f": lambda: 0})
    with pytest.raises(Exception) as torch_error:
        torch_save_bytes({"f": lambda: 0})
    assert type(ours_error.value) is type(torch_error.value)
    assert torch_zip.learned["fast"] is not False


def test_the_serialization_id_is_torchs_rule_on_the_records_crcs():
    """c10::hash_combine over the CRCs (the last 20 digits), checked on a file of torch.save."""
    data = torch_save_bytes(payload())
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = z.infolist()
        given = z.read(infos[-1].filename)
        crcs = [i.CRC for i in infos[:-1] if i.file_size]
    assert infos[-1].filename.endswith(".data/serialization_id")
    zeros = given[:20] + b"%020d" % _chain([0] * len(crcs))
    assert torch_zip.serialization_id(zeros, crcs) == given
    with pytest.raises(torch_zip.LayoutUnknown):
        torch_zip.serialization_id(given[:20] + b"1" * 20, crcs)


def _chain(values):
    h = 0
    for v in values:
        h = torch_zip.hash_combine(h, v)
    return h
