"""Replay tables: the refresh decision computed from teacher-forced acceptance tables instead of real decodes.

The draft's cache never changes what the target emits, so one decode per prompt fixes the continuation, and one
teacher-forced pass of the draft per refresh time on a grid gives, at every later position, whether (greedy) or
with what probability (sampling) a drafted token is accepted, and the signals a controller reads there. Any
refresh schedule's rounds, acceptance length and refresh count are then arithmetic over the table
(``rift_ada.replay.process``); docs/replay.md derives why, and measures how closely it follows the real decoder.
"""

from .table import ReplayTable

__all__ = ["ReplayTable"]
