"""The host copy of an async save on the pause's idle cores, checked as it is made (issue 45 item
4, ckpt/host_copy.py): the bytes copied are the tensors' bytes and the NaN/Inf counts are
count_non_finite's for every layout (runs of small storages summed at once, slices of a large
one, a transposed view, bfloat16 and float64, a tied tensor, a tensor in no buffer) on 1-3
threads; the plan kept from the last save still finds a NaN that appeared since, and a storage
copied ahead unchecked is still counted when it now holds a checked tensor; stale bytes between
buffers cost no exact check; a sum that overflows is checked exactly and not counted; a pack
that fails leaves no helper writing and the switch interval as it was (abandon returns once the
helpers' pieces are copied); a plan that would copy over STALE_BYTES the save does not use is
planned anew; in a training run, a NaN
that appears in an EMA after several saves is refused and a huge finite weight is not.
"""
import doctest
import os
import sys

import pytest
import torch

from improved_diffusion.ckpt import checkpointer, host_copy, writer_process
from improved_diffusion.ckpt.async_save import storage_key


def buffers(arena, tensors):
    """{storage key: (offset, buffer view, source bytes)} of ``tensors``' storages, each given a
    new arena buffer in order (as WriterProcess.pack's locate gives them)."""
    entries = {}
    for t in tensors:
        s = t.untyped_storage()
        if storage_key(s) in entries:
            continue
        off, view = arena.alloc(s.nbytes())
        entries[storage_key(s)] = (off, view, torch.empty(0, dtype=torch.uint8).set_(s))
    return entries


def copied_equal(entries):
    return all(torch.equal(view, src) for _, view, src in entries.values())


def layouts():
    """(check, every tensor with a buffer): the layouts a save meets, NaN/Inf in some."""
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(257 + 13 * i, generator=g) for i in range(40)]  # one piece: runs
    small[3][5] = float("nan")
    small[31][0] = float("inf")
    big = torch.randn(3 * host_copy.PIECE // 4 + 7, generator=g)  # three slices and a bit
    big[-1] = float("nan")  # in its last slice
    wide = torch.randn(1200, 1100, generator=g)  # 5 MiB: a slice piece; checked through .t()
    wide[1000, 17] = float("-inf")
    half = [torch.randn(300, generator=g).to(torch.bfloat16) for _ in range(3)]
    half[1][7] = float("inf")
    double = torch.randn(50, generator=g, dtype=torch.float64)
    ints = torch.arange(-5, 500)  # a payload's integers: copied, never checked
    nowhere = torch.tensor([1.0, float("nan")])  # checked, in no buffer
    tied = small[10]
    check = [("model", small[:20] + [big, wide.t(), nowhere]),
             ("EMA 0.9999", small[20:] + half + [double, tied, torch.empty(0)])]
    return check, small + [big, wide] + half + [double, ints]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_copy_holds_the_bytes_and_the_counts_are_count_non_finites(threads):
    check, tensors = layouts()
    arena = writer_process.Arena()
    entries = buffers(arena, tensors)
    copy = host_copy.HostCopy(host_copy.Helpers(threads - 1), span=arena.span)
    copy.start(entries, check)
    counts = copy.finish(entries)
    assert counts == [(label, checkpointer.count_non_finite(g)) for label, g in check]
    assert counts == [("model", 4), ("EMA 0.9999", 2)]
    assert copied_equal(entries)
    arena.close_fd()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_plan_kept_from_the_last_save_still_finds_a_nan_that_appeared_since(monkeypatch,
                                                                              threads):
    """The second save copies ahead (with a helper) and starts with the first save's pieces (no
    planning: HostCopy._plan is not called); a NaN written into a small and a large tensor
    between the saves is counted, and the copy holds the new bytes."""
    g = torch.Generator().manual_seed(1)
    model = [torch.randn(1000 + i, generator=g) for i in range(30)]
    big = torch.randn(host_copy.PIECE, generator=g)
    moments = [torch.randn(1000 + i, generator=g) for i in range(30)]  # nothing to check
    check = [("model", model + [big])]
    arena = writer_process.Arena()
    entries = buffers(arena, model + [big] + moments)
    plans, helpers = {}, host_copy.Helpers(threads - 1)
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.ahead(entries)
    copy.start(entries, check)
    assert copy.finish(entries) == [("model", 0)]
    model[7][3] = float("nan")
    big[-2] = float("inf")
    moments[4][0] = 123.0
    planned = []
    real_plan = host_copy.HostCopy._plan
    monkeypatch.setattr(host_copy.HostCopy, "_plan",
                        lambda self, e: planned.append(1) or real_plan(self, e))
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.ahead(entries)
    copy.start(entries, [("model", [t.detach() for t in model + [big]])])  # new tensor objects
    assert copy.finish(entries) == [("model", 2)] and not planned
    assert copied_equal(entries)
    arena.close_fd()


def test_a_storage_copied_ahead_unchecked_is_counted_when_it_now_holds_a_checked_tensor():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(5000, generator=g), torch.randn(5000, generator=g)
    arena = writer_process.Arena()
    entries = buffers(arena, [a, b])
    plans, helpers = {}, host_copy.Helpers(1)
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.start(entries, [("model", [a])])  # b: nothing to check, copied ahead next time
    assert copy.finish(entries) == [("model", 0)]
    b[9] = float("nan")
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.ahead(entries)
    copy.start(entries, [("model", [a, b])])
    assert copy.finish(entries) == [("model", 1)]
    assert copied_equal(entries)
    a[0] = float("inf")  # the next save plans anew (the plan above lacks what ahead copied)
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.ahead(entries)
    copy.start(entries, [("model", [a, b])])
    assert copy.finish(entries) == [("model", 2)] and copy.exact == 2
    assert copied_equal(entries)
    arena.close_fd()


def test_a_plan_holds_while_each_save_adds_a_small_storage_of_its_own(monkeypatch):
    """As a save's RNG states: each save has one small new storage, which the next save does
    not use. From the third save on, ahead and start use the kept pieces (only finish plans,
    the new storage), and every copy holds its bytes."""
    g = torch.Generator().manual_seed(4)
    model = [torch.randn(3000 + i, generator=g) for i in range(20)]
    moments = [torch.randn(3000 + i, generator=g) for i in range(20)]
    arena = writer_process.Arena()
    plans, helpers, kept, before, planned = {}, host_copy.Helpers(1), {}, {}, []
    real_plan = host_copy.HostCopy._plan
    monkeypatch.setattr(host_copy.HostCopy, "_plan",
                        lambda self, e: planned.append(len(e)) or real_plan(self, e))
    for save in range(1, 6):
        rng_state = torch.randint(0, 255, (5056,), dtype=torch.uint8, generator=g)
        ahead = dict(kept)
        entries = {k: e for k, e in kept.items() if e[2].numel() != 5056}  # (the old RNG)
        entries.update(buffers(arena, [t for t in model + moments if storage_key(
            t.untyped_storage()) not in kept] + [rng_state]))
        planned.clear()
        copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
        copy.ahead(ahead)
        copy.start(ahead, [("model", model)])
        assert copy.finish(entries) == [("model", 0)] and copied_equal(entries)
        if save >= 3:
            assert planned == [1], (save, planned)  # the RNG state alone
        # the next save's ahead, as WriterProcess.pack keeps it: what this save used that the
        # one before used too (all of it after the first save: its RNG state is copied for
        # nothing while the plan holds)
        kept = {k: e for k, e in entries.items() if not before or k in before}
        before = entries
    arena.close_fd()


def test_stale_bytes_between_buffers_cost_no_exact_check():
    """Buffers given after a reset leave gaps over the old buffers' bytes (here NaN patterns):
    the arena zeroes them, so a run's one sum stays finite and no tensor needs min and max."""
    arena = writer_process.Arena()
    for n in (4096, 8192, 100):
        arena.alloc(n)[1].fill_(0xFF)  # 0xFFFFFFFF: a NaN as float32
    arena.reset()
    tensors = [torch.ones(n) for n in (3, 1001, 17, 555)]  # gaps of 52, 60, 60 bytes
    entries = buffers(arena, tensors)
    copy = host_copy.HostCopy(host_copy.Helpers(0), span=arena.span)
    copy.start(entries, [("model", tensors)])
    assert copy.finish(entries) == [("model", 0)] and copy.exact == 0
    arena.close_fd()


def test_a_sum_that_overflows_is_checked_exactly_and_not_counted():
    huge = [torch.full((1000,), 3e38) for _ in range(3)]
    arena = writer_process.Arena()
    entries = buffers(arena, huge)
    copy = host_copy.HostCopy(host_copy.Helpers(1), span=arena.span)
    copy.start(entries, [("model", huge)])
    assert copy.finish(entries) == [("model", 0)] and copy.exact == 3
    arena.close_fd()


def test_a_pack_that_fails_leaves_no_helper_writing_and_the_switch_interval_as_it_was(tmp_path):
    """A save whose payloads cannot be built (here: a payload function that raises after the
    copy ahead began) raises its own error; the interpreter's switch interval is as before; the
    next pack copies and writes the right bytes."""
    g = torch.Generator().manual_seed(3)
    files = {"model000001.pt": {f"w{i}": torch.randn(20000, generator=g) for i in range(40)}}
    before = sys.getswitchinterval()
    w = writer_process.WriterProcess(copy_threads=2)
    try:
        w.write(tmp_path, 1, w.pack(files))

        def broken():
            raise RuntimeError("no payloads")

        with pytest.raises(RuntimeError, match="no payloads"):
            w.pack(broken)
        assert sys.getswitchinterval() == before
        files["model000002.pt"] = files.pop("model000001.pt")
        files["model000002.pt"]["w3"][0] = 7.0
        w.write(tmp_path, 2, w.pack(lambda: (files, [("model", [])])))
        assert sys.getswitchinterval() == before
        with open(tmp_path / "model000002.pt", "rb") as f:
            back = torch.load(f, weights_only=True)
        assert all(torch.equal(back[k], v) for k, v in files["model000002.pt"].items())
    finally:
        w.close()


def test_in_training_a_nan_that_appears_in_an_ema_after_several_saves_is_refused(tmp_path):
    """Through TrainLoop with the writer process on two copy threads: saves at steps 2, 4, 6
    (the third with the plan kept from the second) of an EMA that holds two weights of 3e38
    (their sum overflows float32) are written; then a NaN in the other EMA is refused at step
    8 with the usual line and nothing of step 8 is written."""
    from test_async_save import tiny_loop

    from improved_diffusion import logger

    logger.configure(dir=str(tmp_path), format_strs=["log"])
    loop = tiny_loop(tmp_path, async_save=True, max_steps=6, save_writer="process",
                     phema_stds="")
    try:
        loop.checkpointer._process = writer_process.WriterProcess(copy_threads=2)
        with torch.no_grad():
            loop.checkpointer.emas["0.9999"][0].view(-1)[:2] = 3e38
        assert loop.run_loop() == 0
        assert (tmp_path / "manifest000006.json").exists()
        saved = torch.load(tmp_path / "ema_0.9999_000006.pt", weights_only=True)
        assert max(float(v.max()) for v in saved["state_dict"].values()) > 1e38
        ema = loop.checkpointer.emas["0.99"]
        with torch.no_grad():
            ema[-1].view(-1)[0] = float("nan")
        loop.step = 8
        with pytest.raises(checkpointer.NonFiniteError, match=r"\(EMA 0.99: 1 tensor\(s\)\)"):
            loop.save(wait=True)
        assert not [n for n in os.listdir(tmp_path) if "000008" in n]
    finally:
        loop.close()


def test_the_module_examples_hold():
    assert doctest.testmod(host_copy).failed == 0


def test_abandon_returns_only_once_no_helper_copies():
    """A save that fails after its copy ahead began: abandon() returns only when the helper has
    copied every piece it took (the caller may then reuse the buffers): 256 MiB copied ahead
    hold the sources' bytes the moment it returns."""
    g = torch.Generator().manual_seed(5)
    model = [torch.randn(1000, generator=g)]
    moments = [torch.zeros(8 << 20) for _ in range(8)]  # 8 x 32 MiB, nothing to check
    arena = writer_process.Arena()
    entries = buffers(arena, model + moments)
    plans, helpers = {}, host_copy.Helpers(1)
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.start(entries, [("model", model)])
    copy.finish(entries)
    for m in moments:
        m.fill_(1.5)
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.ahead(entries)
    copy.abandon()
    assert copied_equal({k: e for k, e in entries.items() if e[2].numel() == 32 << 20})
    arena.close_fd()


def test_a_plan_that_would_copy_more_than_a_mebibyte_the_save_does_not_use_is_not_kept(
        monkeypatch):
    g = torch.Generator().manual_seed(6)
    model = [torch.randn(1000, generator=g)]
    gone = torch.randn(host_copy.STALE_BYTES // 4 + 1, generator=g)  # just over the bound
    arena = writer_process.Arena()
    entries = buffers(arena, model + [gone])
    plans, helpers, planned = {}, host_copy.Helpers(1), []
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.start(entries, [("model", model)])
    copy.finish(entries)
    real_plan = host_copy.HostCopy._plan
    monkeypatch.setattr(host_copy.HostCopy, "_plan",
                        lambda self, e: planned.append(len(e)) or real_plan(self, e))
    kept = {k: e for k, e in entries.items() if e[2].numel() != gone.numel() * 4}
    copy = host_copy.HostCopy(helpers, span=arena.span, plans=plans)
    copy.ahead(kept)
    copy.start(kept, [("model", model)])
    assert copy.finish(kept) == [("model", 0)] and planned == [1]  # planned anew
    arena.close_fd()
