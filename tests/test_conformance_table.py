"""benchmarks/conformance.py's plan and table (the run itself is `make conformance`, not part of
`make test`): the seeded plan covers each interruption on the full chain and leaves the last
segment alone; the printed table reads back as it was written."""
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import conformance  # noqa: E402


def test_the_full_chain_interrupts_every_segment_but_the_last_with_each_kind_at_least_once():
    for seed in range(20):
        segments = conformance.plan(seed, conformance.CHAIN)
        assert [s[0] for s in segments] == list(conformance.CHAIN)
        assert [s[1] for s in segments] == ["mpiexec", "torchrun"] * 2 + ["mpiexec"]
        kinds = [s[2] for s in segments]
        assert kinds[-1] is None and set(kinds[:-1]) == set(conformance.KINDS), (seed, kinds)
        assert all(1 <= s[3] <= 2 and 0 <= s[5] < s[0] for s in segments)
        assert conformance.plan(seed, conformance.CHAIN) == segments  # seeded


def test_the_table_reads_back_row_by_row():
    rows = [dict(zip(conformance.COLUMNS, r)) for r in [
        (1, 2, "mpiexec", "SIGTERM to rank 1 after step 2", 75, "-", 3, "yes", "-"),
        (2, 3, "torchrun", "kill -9 0.41 s after step 5", -9, 3, 5, "no",
         "model000005.pt/state_dict/out.2.weight: tensors differ max|diff|=1e-07"),
        (3, 6, "mpiexec", "none", 0, 5, 14, "yes", "-")]]
    text = "conformance: seed 0\n\n" + conformance.format_table(rows) + "\n\n2/3 segments equal"
    back = conformance.parse_table(text)
    assert back == [{c: str(v) for c, v in r.items()} for r in rows]
