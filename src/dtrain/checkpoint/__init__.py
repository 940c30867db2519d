"""Checkpoints: scheduled and on preemption, atomic, verified, resumed exactly.

`checkpointer` is what the trainer talks to; `store` knows the folders, `state` what goes in them,
`parts` how each named part (model, optimizer, …, and every registered one) is saved and put back,
`tensors` the writing and reading of them all, `formats` the layouts by number, `pending` the seam
between writing a checkpoint and sealing it, `background` the writing while training goes on
(`checkpoint.async`), `manifest` what seals one, `remote` and `on_store` checkpoints on an object store
(sealed there, node by node), `init_from` the weights a new run starts from. Which checkpoint a run
continues from is run.dir's question (rundir/resume_point.py).

This module only names what the others define; importing it imports no torch.distributed.
"""

from dtrain.checkpoint.state import Parts, Position
from dtrain.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore

__all__ = ["Checkpoint", "CheckpointError", "CheckpointStore", "Parts", "Position"]
