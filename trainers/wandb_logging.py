"""Route stable-baselines3's logger to a W&B run (no tensorboard needed, unlike wandb's own SB3 callback)."""

from __future__ import annotations


def sb3_logger(run, prefix: str):
    from stable_baselines3.common.logger import KVWriter, Logger

    class WandbWriter(KVWriter):
        def write(self, key_values, key_excluded, step: int = 0) -> None:
            scalars = {f"{prefix}/{k}": v for k, v in key_values.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if scalars:
                run.log({**scalars, f"{prefix}/timesteps": step})

        def close(self) -> None:
            pass

    return Logger(folder=None, output_formats=[WandbWriter()])
