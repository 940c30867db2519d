"""[run]: where a run keeps its outputs, its seed, and what it may do with a run.dir that holds some."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dtrain import objstore
from dtrain.config.section import Section
from dtrain.config.settings import setting
from dtrain.errors import ConfigError


@dataclass(slots=True)
class RunConfig(Section):
    dir: str = setting(
        "runs/dtrain",
        "Where the run writes config.toml, metrics.jsonl, TensorBoard events, checkpoints and model.safetensors: "
        "a folder, or s3://bucket/prefix (staged in a local cache folder and kept equal to the store; "
        "credentials from boto's environment).",
    )
    seed: int = setting(
        0, "Seeds model init, the data order (as DistributedSampler(seed=...)) and synthetic data.", min=0
    )
    overwrite: bool = setting(
        False,
        "Start afresh even when run.dir holds an earlier run: its outputs "
        "(checkpoints included) are deleted first. Off: such a run.dir is resumed "
        "from its newest checkpoint, or refused when it has none.",
    )
    allow_other_files: bool = setting(
        False,
        "Write into a run.dir that holds files dtrain did not write "
        "(they are left alone). Off: such a run.dir is refused.",
    )

    def check(self) -> None:
        if not self.dir.strip():
            raise ConfigError(
                "run.dir is empty (an unset shell variable?); give the folder the run writes to, "
                "e.g. run.dir=runs/first"
            )
        if "\0" in self.dir:
            # An escape in a quoted override ("\u0000") reaches no file system call: refuse it here, where
            # it would otherwise end the launcher in a traceback.
            raise ConfigError(
                f"run.dir = {self.dir!r} holds a NUL character, which no path can; e.g. run.dir=runs/first"
            )
        if objstore.credentials_in(self.dir):  # it would be written into config.toml and the logs
            raise ConfigError(
                f"run.dir = '{objstore.without_credentials(self.dir)}' carries a password in the URL; give "
                f"credentials through the store's environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a "
                f"profile) and only the URL here"
            )
        if objstore.is_url(self.dir) and objstore.protocol(self.dir) not in ("s3", "s3a"):
            # Its lock is a lease object taken with a conditional write, which only S3's protocol offers.
            raise ConfigError(
                f"run.dir = '{self.dir}': a run.dir on object storage must be on an S3-compatible store "
                f"(s3://bucket/prefix); use a local folder for {objstore.protocol(self.dir)}://"
            )
        # A path the shell did not expand (run.dir=~/runs/x is one argument, not an assignment): expand it,
        # rather than make a folder called "~" in the current one.
        self.dir = os.path.expanduser(self.dir)
