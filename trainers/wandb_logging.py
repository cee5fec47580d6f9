"""W&B for resumable jobs, and stable-baselines3's logger routed to W&B (no tensorboard needed, unlike wandb's own
SB3 callback)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from rift_ada.resume import write_json


class ResumableRun:
    """A W&B run whose id and step count live in a job's state file, so a resumed job resumes its run.

    wandb 0.31 offline: each session writes its own ``offline-run-<time>-<id>`` folder under the same id, with
    ``resume`` recorded, and restarts its step count at 0; ``wandb sync <dir>/wandb/offline-run-*`` uploads them in
    order of start time as one run. Logging at explicit steps counted on from the last session keeps the merged
    history's steps increasing (a re-done unit logs again, at later steps). wandb writes an offline run's file every
    15 s, so a SIGKILL loses up to the last 15 s of that session's W&B history (the job's own state loses nothing).
    """

    def __init__(self, state_file: str | Path, **init_kwargs):
        import wandb

        self.file = Path(state_file)
        saved = json.loads(self.file.read_text()) if self.file.is_file() else {}
        self.id, self.step = saved.get("id") or uuid.uuid4().hex[:12], saved.get("step", 0)
        self.resumed = bool(saved)
        self._save()  # the id is on disk before the run starts: a kill during init still resumes this run
        self.run = wandb.init(id=self.id, resume="allow", **init_kwargs)
        self.summary = self.run.summary

    def log(self, data: dict) -> None:
        self.step += 1
        self._save()  # saved before logging: a kill in between skips a step number rather than reusing one
        self.run.log(data, step=self.step - 1)

    def define_metric(self, *args, **kwargs):
        return self.run.define_metric(*args, **kwargs)

    def finish(self) -> None:
        self.run.finish()

    def _save(self) -> None:
        write_json(self.file, {"id": self.id, "step": self.step})


def sb3_logger(log, prefix: str):
    """An SB3 Logger sending its scalars to ``log(dict)`` (e.g. ``ResumableRun.log``) under ``prefix/``."""
    from stable_baselines3.common.logger import KVWriter, Logger

    class WandbWriter(KVWriter):
        def write(self, key_values, key_excluded, step: int = 0) -> None:
            scalars = {f"{prefix}/{k}": v for k, v in key_values.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if scalars:
                log({**scalars, f"{prefix}/timesteps": step})

        def close(self) -> None:
            pass

    return Logger(folder=None, output_formats=[WandbWriter()])
