"""
Do all ranks run the same job? One all_gather of every rank's flags and dataset fingerprint,
before the model's weights are broadcast, so that ranks started differently stop with one line
naming each differing flag and the ranks that had each value, instead of in a broadcast of
mismatched tensors or, worse, training on quietly.

    digest = check_config_on_all_ranks(flags, data_fingerprint(data))   # collective

``by_rank`` and ``ranks_text`` word per-rank values for any message ("(32 on ranks 0-2,5; 64 on
rank 3)").
"""
import hashlib
import json

from .. import dist_util


def check_config_on_all_ranks(flags, fingerprint=None):
    """Fail on every rank, with the same one-line message, if ranks were started differently.

    ``flags`` ({name: value}: model, diffusion and training flags) and ``fingerprint`` (the
    dataset's {"num_files", "sha256"}, or None for data that has none) are gathered from every
    rank in one all_gather_object; the message names each differing flag with the ranks that had
    each value, and the dataset's size and hash per rank. Returns the sha256 of the flags (the
    same on every rank). Raises dist_util.DistMismatchError.

    Collective: call from all ranks.
    """
    digest = _config_digest(flags)
    gathered = dist_util.all_gather_object((digest, flags, fingerprint))
    problems = []
    if any(g[0] != digest for g in gathered):
        for key in sorted({k for g in gathered for k in g[1]}):
            seen = [g[1].get(key, "(not set)") for g in gathered]
            if any(v != seen[0] for v in seen):
                problems.append(f"--{key} differs between ranks {by_rank(seen)}")
    if problems:
        problems.append("start every rank with the same flags")
    fps = [g[2] for g in gathered]
    if any(fp != fps[0] for fp in fps):
        problems.append("the dataset differs between ranks " + by_rank(
            fps, show=show_fingerprint) + "; give every rank the same image files in --data_dir "
            "(their relative paths and sizes are compared)")
    if problems:
        raise dist_util.DistMismatchError("; ".join(problems))
    return digest


def _config_digest(flags):
    text = json.dumps({k: repr(v) for k, v in flags.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def by_rank(values, show=repr):
    """"(32 on ranks 0-2,5; 64 on ranks 3-4)": each distinct value with the ranks that had it."""
    groups = {}
    for rank, v in enumerate(values):
        groups.setdefault(show(v), []).append(rank)
    return "(" + "; ".join(f"{k} on {ranks_text(r)}" for k, r in groups.items()) + ")"


def ranks_text(ranks):
    """[0, 1, 2, 5] -> "ranks 0-2,5"; [3] -> "rank 3"."""
    runs = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def show_fingerprint(fp):
    if not fp:
        return "no fingerprint"
    return f"{fp.get('num_files')} files, sha256 {str(fp.get('sha256'))[:12]}"


def data_fingerprint(data):
    """The data's fingerprint() ({"num_files", "sha256"}), or None if it has none."""
    fn = getattr(data, "fingerprint", None)
    return fn() if callable(fn) else None
