"""Run scripts/train.py with a record of the run's first async save through the writer process,
for tests/test_first_save.py: what the first save found ready when it came.

Usage: FIRST_SAVE_RECORD=path.json python tests/first_save_train.py [train.py flags...]

At the first WriterProcess.pack, once the arena's warm-up (first_save.py) is done, as pack
itself waits for it: the arena's size and the bytes laid out in it, the part of the arena's pages
resident in the trainer's mapping (its Rss in /proc/self/smaps), whether the warm-up had already
ended when the save came (not asserted: it depends on the machine's load), the writer process's
pid then and at the end of the Checkpointer's construction (``pid_at_construction``); then, over
the pack itself, the trainer's minor page faults and how many times the arena grew. Written as
JSON to FIRST_SAVE_RECORD. Nothing else about train.py changes.
"""
import json
import os
import resource

from train_driver import run_train_py  # tests/ (this script's folder)

from improved_diffusion.ckpt import checkpointer, writer_process

_INIT = checkpointer.Checkpointer.__init__
_PACK = writer_process.WriterProcess.pack
_GROW = writer_process.Arena._grow
RECORD = {"path": os.environ.get("FIRST_SAVE_RECORD"), "grows": 0}


def arena_rss():
    """(Rss, size) in bytes of this process's largest mapping of the arena's memfd."""
    best, rss, size, ours = (0, 0), 0, 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                if ours:
                    best = max(best, (size, rss))
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                ours, size, rss = "memfd:checkpoint-host-copy" in line, hi - lo, 0
            elif head[0] == "Rss:":
                rss = int(head[1]) * 1024
    if ours:
        best = max(best, (size, rss))
    return best[1], best[0]


def _grow(self, size):
    RECORD["grows"] += 1
    return _GROW(self, size)


def _init(self, *args, **kwargs):
    _INIT(self, *args, **kwargs)
    if "pid_at_construction" not in RECORD:
        warm = self._warm_writer if self._process is None else self._process
        RECORD["pid_at_construction"] = getattr(warm, "pid", None)


def _pack(self, files, check=(), gathered=False):
    if RECORD["path"] is None or "arena_size" in RECORD:
        return _PACK(self, files, check, gathered)
    RECORD["warm_up_ended_before"] = self._warming is None or not self._warming.is_alive()
    RECORD["pid_at_first_pack"] = self.pid
    self._warmed()
    rss, mapped = arena_rss()
    RECORD.update(arena_size=self.arena.size, laid_out=self.arena.high, rss=rss, mapped=mapped,
                  grows=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = _PACK(self, files, check, gathered)
    RECORD.update(minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  copied=self.nbytes)
    with open(RECORD["path"], "w") as f:
        json.dump(RECORD, f)
    return out


checkpointer.Checkpointer.__init__ = _init
writer_process.WriterProcess.pack = _pack
writer_process.Arena._grow = _grow

if __name__ == "__main__":
    run_train_py()
