"""What crosses the boundary of a data-loading worker (ResumableLoader's ``--num_workers N > 0``).

A user's data error raised in a worker (a damaged image: ``DataError`` naming the file) comes
back to the training process as that error, so a script prints its own one line and exit code,
exactly as without workers. Left to torch's DataLoader, the worker's exception is raised again
with the worker's formatted traceback as its message: one ``error:`` line of 1,500 characters.
Any other exception is a bug and keeps torch's traceback.

Workers ignore the preemption signals (``preemption.ignore_in_worker``), so the exit handler of
multiprocessing, which ends daemonic children with SIGTERM and then joins them, would wait
forever on the workers of a loader still alive at the interpreter's exit (one that an error's
traceback holds); ``stop_at_exit`` stops them first. Nothing collective.
"""
import atexit
import pickle
import weakref

from .infra.errors import UserError


class WorkerFailure:
    """A UserError raised while a worker loaded a sample, sent back in place of its batch."""

    def __init__(self, error):
        cls = type(error)
        try:  # the class goes by reference: one that cannot would never reach the trainer
            pickle.loads(pickle.dumps(cls))
        except Exception:
            cls = UserError
        self.cls, self.message, self.exit_code = cls, str(error), error.exit_code

    def error(self):
        """The error as the worker raised it (its class, message and exit code)."""
        try:
            e = self.cls(self.message)
        except Exception:
            e = UserError(self.message)
        e.exit_code = self.exit_code
        return e


class FailuresAsValues:
    """``dataset`` for the workers: a UserError of ``dataset[idx]`` is returned as a
    WorkerFailure instead of raised."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        try:
            return self.dataset[idx]
        except UserError as e:
            return WorkerFailure(e)


class Collate:
    """``collate`` for the workers: a batch holding a WorkerFailure is that failure."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, items):
        for item in items:
            if isinstance(item, WorkerFailure):
                return item
        return self.collate(items)


def raise_failure(batch):
    """Raise the error of a batch that is a WorkerFailure; return any other batch."""
    if isinstance(batch, WorkerFailure):
        raise batch.error() from None
    return batch


def shutdown(iterator):
    """Stop the workers of a DataLoader iterator now, even when something else (an error's
    traceback) still holds the iterator, whose own ``__del__`` would then not run."""
    stop = getattr(iterator, "_shutdown_workers", None)  # torch's own, idempotent
    if stop is not None:
        stop()


_live = weakref.WeakSet()
_registered = []


def stop_at_exit(loader):
    """Call ``loader.close()`` at the interpreter's exit while it is alive. Registered when the
    first workers start, after torch's and multiprocessing's exit handlers (imported with
    DataLoader), so it runs before them: atexit runs the last registered first."""
    if not _registered:
        atexit.register(_close_all)
        _registered.append(True)
    _live.add(loader)


def _close_all():
    for loader in list(_live):
        loader.close()
