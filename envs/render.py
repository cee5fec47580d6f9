"""What the envs draw with ``render_mode="rgb_array"``: the episode's rounds as a strip chart, one column per round
(the last ``WIDTH``), the bar the share of the round's drafts accepted, a red cap where the round refreshed, a grey
stub for a plain target step (no drafts).

SB3's ``make_vec_env`` asks every env it makes for ``rgb_array`` (for ``VecVideoRecorder``); an env without it is
made after a gymnasium warning, so the envs draw something worth a look instead.
"""

from __future__ import annotations

import numpy as np

MODES = ("rgb_array",)
FPS = 8  # rounds per second in a recorded video
HEIGHT, WIDTH, CAP = 64, 128, 4


def check_render_mode(owner: str, render_mode) -> None:
    if render_mode is not None and render_mode not in MODES:
        raise ValueError(f"{owner}: render_mode must be None or one of {', '.join(map(repr, MODES))}, got "
                         f"{render_mode!r}")


def strip_chart(rounds) -> np.ndarray:
    """(HEIGHT, WIDTH, 3) uint8 of ``rounds`` (records with ``accepted``, ``draft_length`` and ``refreshed``)."""
    image = np.full((HEIGHT, WIDTH, 3), 255, dtype=np.uint8)
    body = HEIGHT - CAP
    for x, rec in enumerate(list(rounds)[-WIDTH:]):
        if rec.draft_length:
            bar = int(round(body * rec.accepted / rec.draft_length))
            image[HEIGHT - bar:, x] = (40, 90, 200)
        else:
            image[HEIGHT - 2:, x] = (150, 150, 150)
        if rec.refreshed:
            image[:CAP, x] = (220, 30, 30)
    return image
