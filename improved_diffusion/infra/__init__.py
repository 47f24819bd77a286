"""The ground floor: our own infrastructure, beside upstream's dist_util and logger (which keep
upstream's import paths). It knows nothing of diffusion or checkpoints and imports nothing of
the floors above (tests/test_layout.py):

    errors        the error model: UserError (exit 1) and UsageError (exit 2), one-line messages
    storage       every read and write of a run dir, local or in a bucket (fsspec: s3://, gs://,
                  az://), and the one-line wording of a failed write (disk faults, a store's answer)
    preemption    the one owner of SIGTERM/SIGUSR1, from a script's first line (no torch import)
    rendezvous    the meeting of the ranks under mpiexec (rank 0's reachable address)
    heartbeat     each rank's beats: naming a lost rank, ending a job whose rank died
    fsdp          --fsdp True (FSDP2): sharding, gathering to rank 0, cutting files to slices
    flags         every script's command line: each flag's group and meaning, the parser
    cli           every script's error path: one line, an exit code, no rank left hanging
    process_exit  the end of a script's process: Python's exit less its module teardown
    config_check  the start-up check that every rank runs the same flags and data

It imports nothing at package import time.
"""
