"""A run's claim on its run.dir: checked, locked and cleared of an earlier run's outputs at the start,
forgotten again by a new run that trained nothing, released at the end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from dtrain import distributed, objstore, rundir
from dtrain.checkpoint.store import CheckpointStore
from dtrain.config import CheckpointConfig, RunConfig
from dtrain.errors import DtrainError, RunDirLost
from dtrain.models import described
from dtrain.placement import torchrun_run_id
from dtrain.rundir.lease import RunDirLease
from dtrain.rundir.lock import RunDirLock
from dtrain.rundir.mirror import Mirror


class RunDirClaim:
    """Rank 0's hold on run.dir for the life of the run (the other ranks hold nothing, but take part in
    the agreement that rank 0 may go on)."""

    def __init__(self, run_dir: Path, run: RunConfig, is_main: bool, checkpoint: CheckpointConfig | None = None):
        checkpoint = checkpoint or CheckpointConfig()  # export: what to check now; keep: how many on a store
        self.run_dir, self.run, self.is_main, self.export = run_dir, run, is_main, checkpoint.export
        self.lock = RunDirLock(run_dir)  # for a URL: on its staging folder (one run per folder here too)
        # run.dir on an object store: `run_dir` is its local staging folder, kept equal to the store by
        # the mirror, and the lock there is a lease object (see rundir/mirror.py, rundir/lease.py).
        self.mirror = Mirror(run.dir, run_dir, checkpoint.keep) if objstore.is_url(run.dir) else None
        self.lease = (
            RunDirLease(run.dir, torchrun_run_id() or "", every_renewal=self._send_outputs) if self.mirror else None
        )
        # Checkpoints on the store are sealed by the Checkpointer, rank 0's only while it holds the lease.
        self.checkpoints = self.mirror.checkpoints if self.mirror else None
        if self.checkpoints is not None:
            self.checkpoints.allowed = lambda: self.lease is not None and self.lease.held
        self.replaced: list[str] = []  # names of the earlier outputs take() removed
        self.replaced_whose = ""  # whose they were, for the line saying so
        self.fresh = False  # what run.dir holds is this run's own: set once it knows it resumes nothing

    def take(self, module: nn.Module, on_lost: Callable[[str], None] | None = None) -> None:
        """Rank 0 checks run.dir (usable; no other program's files), locks it for the life of the run
        (two live runs must never share it), checks that an earlier run's outputs may go (when told to
        replace them, or the run that is over now did no lasting work) and that the final weights will
        fit, and only then deletes those outputs (see rundir); a refusal is raised on every rank. `on_lost`:
        told the line if the run loses the lease on a store later (the run must then stop: train.stopping)."""
        if self.lease is not None:
            self.lease.on_lost = on_lost

        def decide() -> tuple[str, list[str]]:
            again = distributed.later_attempt()
            if self.lease is not None and self.mirror is not None:  # the store's run.dir, taken and fetched
                self.lease.acquire()
                self.mirror.checkpoints.remove_partials()  # writes cut short: no other run writes there now
                self.mirror.pull()
            rundir.check_usable(self.run_dir)
            rundir.check_config_file_is_ours(self.run_dir)
            rundir.check_contents(self.run_dir, self.run.allow_other_files)
            fresh = self.run.overwrite and not again  # a restart of this run resumes instead
            resuming = not fresh and CheckpointStore(self.run_dir).newest() is not None
            self.lock.acquire()  # first: outputs of a run that did no lasting work go only once it is over
            earlier = rundir.earlier_outputs(self.run_dir, resuming=resuming, overwrite=fresh, again=again)
            rundir.check_room(self.run_dir, weights_bytes(module), "the final model.safetensors")
            whose = _whose(again, fresh)
            model = described.describe(module)
            if self.export == "hf" and described.not_exportable(model):  # said now, not after training
                raise DtrainError(f"checkpoint.export = hf: {described.not_exportable(model)}")
            rundir.remove(earlier)
            # What trained, for `dtrain export` later: a Hugging Face model's config, the gpt's options.
            described.write(self.run_dir, module)
            if self.mirror is not None:
                self.mirror.push()  # the earlier outputs removed from the store too
            return whose, [p.name for p in earlier]

        self.replaced_whose, self.replaced = distributed.rank0_decides(decide, is_main=self.is_main) or ("", [])

    def said(self) -> list[str]:
        """The console line naming the earlier outputs take() replaced, if any."""
        lines = [self.lease.took_over] if self.lease is not None and self.lease.took_over else []
        if not self.replaced:
            return lines
        return [*lines, f"replaced the outputs of {self.replaced_whose}: {', '.join(self.replaced)}"]

    def _send_outputs(self) -> None:
        if self.mirror is not None:
            self.mirror.push(checkpoints=False)  # from the lease's thread: checkpoints only from the loop

    def sending(self, report: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """`report` for each sealed checkpoint, and then on a store rank 0 sends the outputs that changed
        (the checkpoint itself is there already): the Checkpointer's report, sync or background."""

        def reported(record: dict[str, Any]) -> None:
            report(record)
            if self.mirror is not None and self.lease is not None and self.lease.held:
                self.mirror.push()

        return reported

    def forget(self, steps_taken: int, close_writers: Callable[[], None] | None = None) -> None:
        """A new run that fails before its first step (bad data found in the first batch, a model that
        does not fit) leaves nothing half-written: rank 0 closes what writes into run.dir
        (`close_writers`) and removes what it wrote, so the rerun with the problem fixed starts as the
        first would."""
        if not (self.fresh and self.is_main and steps_taken == 0):
            return
        if close_writers is not None:
            close_writers()
        rundir.remove(
            [self.run_dir / name for name in rundir.OUTPUTS if name != "checkpoints" and (self.run_dir / name).exists()]
        )

    def release(self, remove_if_created: bool = False) -> None:
        """Drop the lock; on a refused start, also remove a run.dir the lock created. On a store, first
        send what the run wrote (final weights, the last metrics), then give the lease back."""
        try:
            if self.mirror is not None and self.lease is not None and self.lease.held:
                self.mirror.push()
        finally:
            if self.lease is not None:
                self.lease.release()
            self.lock.release(remove_if_created=remove_if_created)

    def end(self, _kind: object, error: BaseException | None, _trace: object) -> None:
        """Release at the end of fit (an ExitStack exit callback). A run that lost its lease on the store
        after its last step (sooner, it stops there: train.stopping) and would otherwise end well is
        refused: what it wrote since its last sending never reached the store and is only in the staging
        folder, which a later run on the same run.dir here would empty."""
        self.release()
        lost = self.lease.lost_line if self.lease is not None else ""
        if error is None and lost:
            raise RunDirLost(
                f"{lost}; what this run wrote after that (its final weights among them, once written) was not "
                f"sent there and is only in {self.run_dir} on this machine: copy it out before a run on the same "
                f"run.dir starts here"
            )


def _whose(again: bool, overwrite: bool) -> str:
    """Whose outputs take() replaces, as the console line says it: without `again` or `overwrite`, only
    those of a run that did no lasting work are (see rundir.earlier_outputs)."""
    if again:
        return "an earlier attempt of this run"
    if overwrite:
        return "the earlier run (run.overwrite)"
    return "an earlier run that ended before its first checkpoint (no checkpoint, no final weights)"


def weights_bytes(module: nn.Module) -> int:
    """About the size of model.safetensors: every tensor of the state dict, those stored under several
    names (tied embeddings) once, as the file holds them, plus room for its header."""
    # keep_vars: the parameters themselves, so a tied one is the same object under both names (and a
    # sharded DTensor counts whole, as the gathered file holds it).
    sizes = {id(t): t.numel() * t.element_size() for t in module.state_dict(keep_vars=True).values()}
    return sum(sizes.values()) + (64 << 10)
