"""
A run's first save as cheap as its later ones: what the first async save used to build (the
writer process, its arena and the arena's pages, the copy's plan) readied while the first steps
train, on rank 0.

A save's pause is its host copy into the writer's shared memory
(writer_process.WriterProcess.pack) and its write runs in the writer process. At a run's first
save, that used to include, in the pause, the arena's growth and a page fault for every page the
copy touched (most of the first pause: 164,000 page faults, 0.48-0.53 s against 0.06 s at the
third save of a 655 MB step, docs/performance.md, "The first save"), the copy's plan, and no
copy ahead (the second save neither: no plan kept yet); and, in the write, the writer's start (a
fresh interpreter importing torch, its first torch.save, ~2 s of CPU): the first write took 2-4x
a later one, and the second save waited for it.

Two moments, both on rank 0's main thread, neither collective, for an async save of an unsharded
model in the full layout:

- ``start_writer`` (the Checkpointer's construction, after the job took its log dir's lock: the
  writer holds a copy of it): when the writer process will surely be the one the first save
  chooses (writer_process.use_process on the step's likely bytes: the model, the EMAs and the
  optimizer's state, or two moments a parameter for an Adam whose state comes with the first
  step), start it now; it imports what a write uses and rehearses one small write
  (writer_process._rehearse) while the run resumes and trains.
- ``ready`` (each step_begins until it has run): once the optimizer has its state (after the
  first step of a fresh run; at once on a resume), build the step's files as a save would,
  choose the writer as the first save would (``_choose_writer``, on their bytes; a writer started
  early that is not chosen is ended), and WriterProcess.prepare them: the arena grown once and its
  pages faulted in on a thread of its own, every storage's buffer laid out, the copy's pieces
  planned. The first save then finds what a third one finds.

Nothing here copies a tensor or changes training state (the model, optimizer and RNG states
are read, never written: runs are bitwise those without it); memory is the arena the first save
would fill (writer_process.PREPARE_SLACK more), never a second one. A failure here is not the
run's: one line, and the first save readies itself as before.
"""
from . import async_save, host_copy, rng, writer_process
from .writer_process import WriterProcess


def _eligible(ckpt):
    """Whether this rank's saves are async saves through WriterProcess.pack: rank 0, async, an
    unsharded model in the full layout."""
    cfg = ckpt.config
    return (ckpt.rank == 0 and cfg.async_save and cfg.save_layout != "sharded"
            and not ckpt.sharded and writer_process.available())


def _copy_threads():
    import torch as th

    from .. import dist_util

    return host_copy.copy_threads(th.get_num_threads(), dist_util.usable_cores())


def likely_bytes(ckpt):
    """The tensor bytes of ckpt's step files as the first save will find them: the model, the
    EMAs, the optimizer's state (before an Adam's first step: its two moments, a parameter's
    bytes each)."""
    params = list(ckpt.model.parameters())
    total = async_save.tensor_bytes(ckpt.model.state_dict())
    total += sum(async_save.tensor_bytes(list(p)) for p in ckpt.emas.values())
    opt = async_save.tensor_bytes(list(ckpt.optimizer.state.values()))
    if not opt and any("betas" in g for g in ckpt.optimizer.param_groups):
        opt = 2 * async_save.tensor_bytes(params)
    return total + opt


def start_writer(ckpt):
    """At the Checkpointer's construction: start the writer process when the first save will
    choose it (see the module docstring)."""
    ckpt._first_save = {"done": False, "calls": 0}
    if not _eligible(ckpt):
        ckpt._first_save["done"] = True
        return
    try:
        if writer_process.use_process(ckpt.config.save_writer, likely_bytes(ckpt),
                                      ckpt._core_free()):
            ckpt._warm_writer = WriterProcess(_copy_threads())
            ckpt._warm_writer.start()
    except Exception as e:  # not the run's failure: the first save starts it as before
        _note(e)


def ready(ckpt):
    """At each step_begins until it has run: once the optimizer holds its state (or a step has
    run), choose the writer and prepare the first save (see the module docstring)."""
    state = ckpt._first_save
    if state["done"]:
        return
    state["calls"] += 1
    if ckpt._process is not None:  # a save came first
        state["done"] = True
        return
    if not ckpt.optimizer.state and state["calls"] < 2:
        return  # (an Adam's moments come with the first step)
    state["done"] = True
    try:
        sd = ckpt.model.state_dict()
        rngs = [rng.get_rng_state()] * ckpt.world_size  # (the shapes of every rank's)
        files = ckpt.step_files(ckpt.resume_step, rngs, state_files=False, model_sd=sd)
        ckpt._choose_writer(files)
        if isinstance(ckpt._process, WriterProcess):
            ckpt._process.prepare(files, ckpt._weights_to_check(sd))
    except Exception as e:  # not the run's failure: the first save readies itself as before
        _note(e)


def writer(ckpt, use):
    """The writer _choose_writer sets at its one choice: the process started early when
    ``use`` (else it ends), a new WriterProcess when ``use`` and none was, else the thread's
    HostSnapshot."""
    warm, ckpt._warm_writer = getattr(ckpt, "_warm_writer", None), None
    if use and warm is not None:
        warm.copy_threads = _copy_threads()
        return warm
    if warm is not None:
        warm.close()
    return WriterProcess(_copy_threads()) if use else async_save.HostSnapshot()


def drop(ckpt):
    """At close: end a writer started early that no save chose."""
    warm, ckpt._warm_writer = getattr(ckpt, "_warm_writer", None), None
    if warm is not None:
        warm.close()


def _note(e):
    from .. import logger

    logger.log(f"note: the first save was not readied ahead ({type(e).__name__}: {e}); it "
               f"readies itself when it comes")
