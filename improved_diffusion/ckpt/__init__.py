"""
The checkpoint and resume system: the reason this project exists, in one package.

Upstream's modules (train_util, dist_util, script_util, ...) sit one level up; this package knows
nothing of diffusion and builds on the ground floor, improved_diffusion/infra/ (errors, storage:
every read and write of a run dir, local or in a bucket; preemption: the signals). The doctor
that reads its files is an application above it (improved_diffusion/apps/ckpt_tool.py). It
imports nothing at package import time.

The modules, from the file up:

    checkpoint    one file: names and patterns (name_info, parse_step), schema tags, payloads,
                  kinds and layouts (classify, describe, opt_layout), the validated reader
                  (load_file, load_file_collective); docs/checkpoints.md is its reference
    safe_read     bytes to objects: torch.load (weights_only) with each record's CRC-32 checked
                  as it is read, the zip's records, stand-ins for refused pickled objects
    file_writer   writing one file: the atomic writer (write_file, atomic_write), the checksums
                  a manifest lists (file_digest)
    torch_zip     torch.save's file byte for byte, the records' CRC-32s computed in parallel
                  with the write (else torch.save itself)
    optim_state   optimizer state keyed by parameter name; upstream's layouts in and out
    run_dir       a log dir of steps: write_step (files, then the manifest), listing, manifests,
                  verification of the candidate step, the resume plan (plan_resume),
                  refuse_overwrite, quarantine to incomplete/, pruning
    sharded       --save_layout sharded: a step as one torch.distributed.checkpoint folder of
                  every rank's shards, our manifest over its files written last (start_save /
                  collect, read_step resharded, verify, consolidate)
    step_files    the weights file a path names in either layout (a sharded step's folder, a
                  file it holds, a manifest's step): verified, one payload read in one process
    run_lock      one job per log dir (flock locally; a conditionally created heartbeat object
                  on s3:// / gs:// / az://)
    async_save    host copies of the payloads (to_host, HostSnapshot) and the background thread
                  that waits for a write
    writer_process  the background write out of the training process: the writer process,
                  the shared-memory arena the host copy lands in (pack), its write_step there
    host_copy     the host copy of pack's CPU tensors on the pause's idle cores, each piece
                  checked for NaN/Inf as it is copied
    first_save    the first save readied while the first steps train: the writer started,
                  its arena grown, laid out and faulted in, the copy planned
    state_fit     "does this state dict fit this model, and which flag is likely wrong"
    model_change  resume into a changed model (--allow_model_change): kept and fresh tensors
    rng           one process's seeding and RNG state
    checkpointer  the one owner of a run's checkpoint state for any loop and any model

What a loop uses (examples/own_loop.py; train_util.TrainLoop and classifier_train the same):

    from improved_diffusion.infra import preemption           # preemption.install(), first line
    from improved_diffusion.ckpt.checkpointer import (Checkpointer, CheckpointConfig,
                                                      PREEMPTED_EXIT_CODE)
    from improved_diffusion.ckpt.rng import seed_rngs
    run_lock.acquire_for_job(log_dir, ...)                   # train_job does this for train.py

    with Checkpointer(CheckpointConfig.from_flags(args), model=..., optimizer=..., emas=...,
                      data=..., batch_size=..., seed=..., states=...) as ckpt:
        step = ckpt.resume()                                 # or begin_resume(), in steps
        with ckpt.watch_signals():
            ... ckpt.step_begins(); one step; if ckpt.step_ends(step): return 75 ...
        ckpt.save(step, wait=True)

Errors a caller may see (all errors.UserError): checkpoint.CheckpointError and its
CheckpointReadError, run_dir.NoUsableStepError, checkpointer.ResumeError and NonFiniteError,
optim_state.OptimizerStateError, run_lock.LockError and its subclasses, ckpt_tool.ToolError,
preemption.Preempted (a BaseException: a signal before training).

What calls what on a resume (every step collective unless it says rank 0):

    Checkpointer.resume / begin_resume
      -> dist_util.run_on_rank0(run_dir.plan_resume)      rank 0: list the log dir, read the
           -> checkpoint (names, manifests, checksums)      manifests, verify the candidate step
      -> Resume.load_model -> checkpoint.load_file_collective -> dist_util (same file? bytes)
                           -> safe_read.checked_load (each rank checks its share of CRCs)
                           -> state_fit.fit_state_dict (-> model_change with allow_model_change)
                           -> run_dir.refuse_overwrite
      -> Resume.load_ema (per rate) -> checkpoint.load_file_collective (-> state_fit)
      -> Resume.load_optimizer -> checkpoint.load_file_collective -> optim_state
           .load_optimizer_state (-> model_change.optimizer_by_name); the fall-back decision
           all-gathered
      -> Resume.finish -> the trainer state: data position, rng.set_rng_state, each state's
           load_state_dict; rank 0: run_dir.tidy_for_resume (newer steps to incomplete/)

What calls what on a save:

    Checkpointer.step_ends / save / save_for_preemption
      -> the non-finite check (one all-gather); rng.get_rng_state gathered to rank 0
      -> dist_util.run_on_rank0: wait for the previous background save; step_files (the payloads
           of checkpoint and optim_state.named_optimizer_state)
           -> writer_process.WriterProcess.pack (the host copy, into shared memory) +
              async_save.BackgroundWriter, whose thread waits for the writer process (async,
              --save_writer process or a large step with a core free), or
              async_save.HostSnapshot.copy + the same thread writing (async, a small step or
              no core free: writer_process.use_process), or now,
              in this process:
              run_dir.write_step -> file_writer.write_file per file (-> torch_zip.save), then
              the manifest
              -> run_dir.prune_lines (--keep_checkpoints)
      -> step_begins / stop_requested: one all-reduce of [preempted, save failed]; the flags
           preemption.training() sets
"""
