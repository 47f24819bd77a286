"""
The host copy of a save's CPU tensors, checked for NaN/Inf as it is made, on the cores the pause
leaves idle.

An async save's pause is the copy of the step's tensors into the writer's memory
(writer_process.WriterProcess.pack), with the weights check (a NaN/Inf model or EMA is never
written). While it runs, training waits: the cores of the training's threads are idle, and so
are the other ranks' (they wait for rank 0). ``HostCopy`` splits the copy into pieces and hands
them to ``copy_threads`` threads (the caller's included): one thread does not fill a host's
memory bandwidth (two copied the 30M step in 0.8 of one's time here: docs/performance.md, "The
pause on the idle cores").

The copy begins before the caller knows what the step holds: ``ahead(entries)``, with the
buffers of the last saves (the same storages from save to save: a model's parameters, EMAs and
Adam moments keep theirs), starts those that held nothing to check (the optimizer's moments,
about half the bytes) on the helper threads, in pieces of CHUNK bytes, each one torch call
without the GIL, while the caller builds and pickles the payloads (Python, on the GIL);
``start(entries, check)`` adds the storages of the checked tensors, in pieces of PIECE bytes;
``finish(entries)`` adds what the pickling found new (the RNG states a save makes anew), takes
its share of every piece left, and returns the counts. The pieces of the last save are kept
(``plans``) and used again when the buffers and the checked tensors' places are the same.

The check is a sum: each piece of checked tensors is checked right after it is copied, while
it is in the cache, by the sum of their bytes. A sum is finite only when every value is (a NaN
or Inf makes it NaN or Inf); since a piece's small storages lie one after the other in the
buffer memory (``span``: the gaps between them zeroed, Arena.alloc), one sum covers a run of
them, where a sum of each small tensor cost 16 times as much (a torch call each, about 3 us, on
16 KB). Only a tensor, or run, whose sum is not finite (a NaN or Inf, or a sum that overflowed)
gets the exact check: its min and max, both finite exactly when every value is. A storage
copied ahead that the step no longer uses was copied for nothing; nothing else changes
(training waits during the pause, so the bytes copied early are the step's bytes).

Worked example (two float32 tensors, the second with a NaN, copied into a buffer; one thread,
no spans)::

    >>> import torch as th
    >>> a, b = th.ones(3), th.tensor([1.0, float("nan"), 2.0])
    >>> buf = th.zeros(24, dtype=th.uint8)
    >>> src = lambda t: th.empty(0, dtype=th.uint8).set_(t.untyped_storage())
    >>> entries = {k: (12 * k, buf[12 * k:12 * (k + 1)], src(t)) for k, t in enumerate((a, b))}
    >>> copy = HostCopy(Helpers(0))
    >>> copy.start(entries, [("model", [a, b])])
    >>> copy.finish(entries)
    [('model', 1)]
    >>> buf.view(th.float32).tolist()[:4]
    [1.0, 1.0, 1.0, 1.0]

Not collective and knows nothing of ranks or files.
"""

import itertools
import threading

# The copy is made, and checked, in pieces of about this many bytes (small storages together, one
# foreach copy each): a piece is checked right after it is copied, while it is in the cache.
PIECE = 4 << 20
# Buffers lie at multiples of this many bytes (writer_process.ALIGN: a span's gaps).
ALIGN = 64
# Storages with nothing to check are copied in pieces of about this many bytes: a thread takes
# the GIL between pieces, which the pickling thread holds up to sys.getswitchinterval() each time.
CHUNK = 32 << 20
# A kept plan is used again while it copies at most this many bytes that the save does not use.
STALE_BYTES = 1 << 20
# At most this many threads copy (the caller's included): more add no bandwidth.
MAX_THREADS = 4


def copy_threads(torch_threads, cores):
    """How many threads make the host copy during a pause: one for each ``torch_threads`` of
    the ``cores`` this process may use (each copy already runs on torch's threads), at least
    one, at most MAX_THREADS.

    >>> copy_threads(1, 2), copy_threads(2, 2), copy_threads(1, 64), copy_threads(8, 4)
    (2, 1, 4, 1)
    """
    return max(1, min(MAX_THREADS, int(cores) // max(1, int(torch_threads))))


class Helpers:
    """``n`` daemon threads (0: none; started at the first ``run``) that each call the function
    given to ``run`` once. One per writer: a process forked from the trainer never uses it (its
    threads do not survive a fork)."""

    def __init__(self, n):
        self.n = max(0, int(n))
        self._work = []
        self._cond = threading.Condition()
        self._threads = []

    def run(self, work):
        """Have each helper call ``work()`` once, from now on; returns at once."""
        if not self.n:
            return
        with self._cond:
            while len(self._threads) < self.n:
                t = threading.Thread(target=self._loop, daemon=True,
                                     name=f"checkpoint-host-copy-{len(self._threads)}")
                t.start()
                self._threads.append(t)
            self._work.extend([work] * self.n)
            self._cond.notify_all()

    def _loop(self):
        while True:
            with self._cond:
                while not self._work:
                    self._cond.wait()
                work = self._work.pop(0)
            work()


class _Run:
    """Pieces run by any number of threads: each ``work()`` takes the next piece until none is
    left; ``wait()`` returns once every piece has run (raising the first error of one), their
    checks' results in ``sums``: [(indices of the checked tensors, 0-d sum)]."""

    def __init__(self, items):
        self.items = items
        self.sums = []
        self.error = None
        self._next = itertools.count()  # next() of a count is atomic under the GIL
        self._lock = threading.Lock()
        self._ran = 0
        self._all_ran = threading.Event()
        if not items:
            self._all_ran.set()

    def work(self):
        for k in self._next:
            if k >= len(self.items):
                return
            out = []
            try:
                out = _run_piece(*self.items[k])
            except BaseException as e:  # noqa: B902  (raised by wait, once every piece ran)
                self.error = self.error or e
            with self._lock:
                self.sums.extend(out)
                self._ran += 1
                if self._ran == len(self.items):
                    self._all_ran.set()

    def wait(self):
        self._all_ran.wait()
        if self.error is not None:
            raise self.error


def _run_piece(kind, *args):
    """Copy one piece, then sum its checks: ("batch", views, sources, spans, singles): one
    foreach copy, a sum of each span ((indices, a tensor over buffer bytes)) and of each single
    ((index, tensor)); ("slice", view, source, a, b, ranges): bytes a..b of one large storage,
    a sum of the part of each range ((index, start, size, dtype) in its bytes) within them."""
    import torch as th

    with th.no_grad():  # (a helper thread's grad mode is its own: on)
        if kind == "batch":
            views, srcs, spans, singles = args
            if views:
                th._foreach_copy_(views, srcs)
            return ([(ix, span.sum()) for ix, span in spans]
                    + [((i,), t.sum()) for i, t in singles])
        view, src, a, b, ranges = args
        view[a:b].copy_(src[a:b])
        out = []
        for i, start, size, dtype in ranges:
            lo, hi = max(a, start), min(b, start + size)
            if lo < hi:
                out.append(((i,), view[lo:hi].view(dtype).sum()))
        return out


class HostCopy:
    """
    One save's copy of CPU storages into their buffers, counting the checked tensors that hold
    a NaN or Inf. ``helpers``: the Helpers whose threads copy beside the caller's;
    ``span(offset, nbytes, dtype)``: a tensor of ``dtype`` over the buffer memory at that
    offset (None: no spans, one sum a tensor); ``plans``: a dict kept from save to save, where
    the pieces of the previous save are kept for this one (planning is Python, a step per
    storage and tensor: about 10 ms of the pause for 2,000 storages here, the same from save to
    save).

    The calls, in order: ``ahead(entries)`` (optional), ``start(entries, check)``,
    ``finish(entries)``, each with {storage key: (buffer offset, buffer view, source bytes
    view)} (async_save.storage_key; the views flat uint8 tensors of the storage's bytes); an
    entry given twice is copied once. ``check``: [(label, tensors)]. ``finish`` returns
    [(label, how many of its tensors hold a NaN or Inf)]: what checkpointer.count_non_finite
    of each label's tensors gives (the tensors in no entry, on CUDA or not in the payloads,
    are counted by it; so is a tensor whose storage ``ahead`` copied unchecked).
    """

    def __init__(self, helpers, span=None, plans=None):
        self.check = []
        self.helpers = helpers
        self._span = span
        self._plans = plans
        self._last = None  # the previous save's plan, when ``ahead`` found it still holds
        self._tensors, self._labels = [], []  # the checked tensors planned, their label's index
        self._planned = set()  # (label index, position) of those tensors
        self._copied = set()  # storage keys copied or being copied
        self._runs = []
        self.exact = 0  # after finish: how many tensors got the exact check

    def ahead(self, entries):
        """Start copying, on the helper threads, the storages of ``entries`` that held nothing
        to check when the pieces kept in ``plans`` were planned, if those pieces hold: they
        copy every entry of ``entries`` (the same objects) and at most STALE_BYTES more (the
        storages of a save that the next did not use: its RNG states), before the caller knows
        what to check. Returns at once."""
        last = self._plans.get("last") if self._plans is not None else None
        if last is None or not entries:
            return
        sizes = last["sizes"]
        if not all(id(e) in sizes for e in entries.values()):
            return
        if last["nbytes"] - sum(sizes[id(e)] for e in entries.values()) > STALE_BYTES:
            return
        self._last = last
        if self.helpers.n:  # (without helpers, start copies them: this thread builds the files)
            self._copied |= last["plain_keys"]
            self._launch(last["plain"])

    def start(self, entries, check, launch=True):
        """Start copying the ``entries`` not copied yet on the helper threads, the tensors of
        ``check`` among them checked, and return at once (with no helpers: copy them now).
        ``launch`` False: only plan the pieces and keep them in ``plans`` (copy nothing): what
        the first save's ahead and start then use (writer_process.WriterProcess.prepare)."""
        self.check, where = [], []
        for label, group in check:
            group = [t for t in group if t.is_floating_point() and t.numel()]
            self.check.append((label, group))
            where.append([(t.data_ptr(), t.dtype, t.shape, t.stride()) for t in group])
        last = self._last
        if last is not None and last["where"] == where:  # the previous save's plan holds
            self._tensors, self._labels = last["tensors"], last["labels"]
            plain = [] if self._copied else last["plain"]  # (ahead started them)
            self._planned, self._copied = set(last["planned"]), set(last["copied"])
            self._launch(plain + last["checked"])
            return
        ahead = bool(self._copied)  # ahead started pieces of a plan that no longer holds
        plain_keys, plain, checked = self._plan(entries)
        if self._plans is not None and ahead:  # this plan lacks those: none is kept
            self._plans.pop("last", None)
        elif self._plans is not None:  # kept for the next saves' ahead and start (the entries
            sizes = {id(e): e[1].numel() for e in entries.values()}  # held: ids stay theirs)
            self._plans["last"] = dict(
                values=list(entries.values()), sizes=sizes, nbytes=sum(sizes.values()),
                where=where, plain=plain, checked=checked,
                plain_keys=plain_keys, tensors=list(self._tensors), labels=list(self._labels),
                planned=set(self._planned), copied=set(self._copied))
        if launch:
            self._launch(plain + checked)

    def _launch(self, items):
        run = _Run(items)
        self._runs.append(run)
        if self.helpers.n:
            self.helpers.run(run.work)
        else:
            run.work()

    def finish(self, entries):
        """Copy the ``entries`` not started yet, this thread taking whatever pieces the helpers
        have not taken yet, wait for every piece, and return the counts (see the class)."""
        new = {k: e for k, e in entries.items() if k not in self._copied}
        if new:
            _, plain, checked = self._plan(new)
            self._launch(plain + checked)
        for run in self._runs:
            run.work()
        for run in self._runs:
            run.wait()
        return self._counts([x for run in self._runs for x in run.sums])

    def abandon(self):
        """Wait until no thread copies any more, without the counts (the caller failed before
        ``finish`` and may reuse the buffers)."""
        for run in self._runs:
            run.work()
        for run in self._runs:
            run._all_ran.wait()

    def _plan(self, entries):
        """The pieces that copy the ``entries`` not copied yet (see _run_piece): (the keys of
        those with nothing to check, their pieces of about CHUNK bytes: a helper copies them
        while the caller pickles, each piece one call without the GIL; the pieces of those with
        checked tensors, of about PIECE bytes, each checked right after it is copied)."""
        entries = {k: e for k, e in entries.items() if k not in self._copied}
        on_storage = self._place_checks(entries)
        plain, checked = [], []
        for key, entry in entries.items():
            self._copied.add(key)
            checks = on_storage.get(key)
            if checks:
                checked.append((entry, checks))
            else:
                plain.append((entry, ()))
        return ({k for k in entries if k not in on_storage}, self._pieces(plain, CHUNK),
                self._pieces(checked, PIECE))

    def _pieces(self, entries, size):
        """Pieces of about ``size`` bytes that copy ``entries`` ([(entry, checks)])."""
        items, batch, filled = [], _Batch(self._span), 0
        for (off, view, src), checks in entries:
            n = view.numel()
            if n < size:
                batch.add(off, view, src, checks)
                filled += n
                if filled >= size:
                    items.append(batch.item())
                    batch, filled = _Batch(self._span), 0
                continue
            ranges = [(i, t.storage_offset() * t.element_size(), t.numel() * t.element_size(),
                       t.dtype) for i, t in checks if t.is_contiguous()]
            items += [("slice", view, src, a, min(n, a + size), ranges)
                      for a in range(0, n, size)]
            late = [(i, t) for i, t in checks if not t.is_contiguous()]
            if late:  # summed on the tensor itself: a piece of their own, nothing to copy
                items.append(("batch", [], [], [], late))
        if batch.views:
            items.append(batch.item())
        return items

    def _place_checks(self, entries):
        """{storage key: [(index, tensor)]}: the checked tensors not planned yet whose storage
        is in ``entries``, now planned (indices into self._tensors)."""
        from .async_save import storage_key

        on_storage = {}
        planned, tensors = self._planned, self._tensors
        if len(planned) == sum(len(group) for _, group in self.check):
            return on_storage  # (the RNG states a save makes anew: nothing to check)
        for g, (_, group) in enumerate(self.check):
            for pos, t in enumerate(group):
                if (g, pos) in planned:
                    continue
                key = storage_key(t.untyped_storage())
                if key not in entries:
                    continue
                planned.add((g, pos))
                on_storage.setdefault(key, []).append((len(tensors), t))
                tensors.append(t)
                self._labels.append(g)
        return on_storage

    def _counts(self, sums):
        import torch as th

        from .checkpointer import count_non_finite

        suspect = set()
        if sums:
            finite = th.stack([v.float() for _, v in sums]).isfinite().tolist()
            suspect = {i for (ix, _), ok in zip(sums, finite) if not ok for i in ix}
        counts = [0] * len(self.check)
        self.exact = len(suspect)
        if suspect:
            order = sorted(suspect)
            for i, n in zip(order, _non_finite_flags([self._tensors[i] for i in order])):
                counts[self._labels[i]] += n
        for g, (_, group) in enumerate(self.check):
            rest = [t for pos, t in enumerate(group) if (g, pos) not in self._planned]
            if rest:
                counts[g] += count_non_finite(rest)
        return [(label, n) for (label, _), n in zip(self.check, counts)]


class _Batch:
    """The small storages of one piece: copied with one foreach copy, checked by spans (a run
    of storages one after the other in the buffer memory, each wholly one checked tensor of
    the same dtype: one sum over the run, the zeroed gaps between them included) and singles
    (every other checked tensor: one sum each)."""

    def __init__(self, span):
        self._span = span
        self.views, self.srcs, self.spans, self.singles = [], [], [], []
        self._run = None  # [first offset, end, dtype, indices] of the run being extended

    def add(self, off, view, src, checks):
        self.views.append(view)
        self.srcs.append(src)
        if not checks:
            self._close()
            return
        n = view.numel()
        whole = [(i, t) for i, t in checks
                 if t.storage_offset() == 0 and t.numel() * t.element_size() == n
                 and t.is_contiguous()]
        dtype = whole[0][1].dtype if whole and self._span is not None else None
        self.singles += [(i, t) for i, t in checks if t.dtype != dtype]
        if dtype is None:
            self._close()
            return
        covered = [i for i, t in checks if t.dtype == dtype]
        run = self._run
        if run is not None and run[2] == dtype and off == -(-run[1] // ALIGN) * ALIGN:
            run[1] = off + n
            run[3] += covered
            return
        self._close()
        self._run = [off, off + n, dtype, covered]

    def _close(self):
        if self._run is not None:
            first, end, dtype, indices = self._run
            self.spans.append((tuple(indices), self._span(first, end - first, dtype)))
            self._run = None

    def item(self):
        self._close()
        return ("batch", self.views, self.srcs, self.spans, self.singles)


def _non_finite_flags(tensors):
    """For each tensor, 1 if it holds a NaN or Inf, else 0 (its min and max: both finite
    exactly when all its values are)."""
    import torch as th

    with th.no_grad():
        ends = th.stack([th.stack(th.aminmax(t)).double() for t in tensors])
    return (~ends.isfinite().all(dim=1)).int().tolist()
