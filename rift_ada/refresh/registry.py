"""The controller kinds rift-ada knows. One registration makes a :class:`~rift_ada.refresh.base.Controller` subclass
loadable from its files (``load_controller``), nameable as ``--controller`` (with a ``spelling``) and swept by both
train_controller.py and reproduce_figures.py (with a ``knob``, ``rift_ada.sweep``):

    @register
    @dataclass
    class MyController(Controller):
        kind: ClassVar[str] = "mine"
        ...

Kinds keep their registration order: it is the order of the sweeps' families and of the kinds an error lists.
"""

from __future__ import annotations

from .base import Controller

KINDS: dict[str, type[Controller]] = {}


def register(cls: type[Controller]) -> type[Controller]:
    """Make ``cls`` known by its ``kind`` (a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Controller)) or not cls.kind:
        raise ValueError(f"{cls!r}: a registered controller subclasses rift_ada.refresh.base.Controller and sets kind")
    if KINDS.get(cls.kind, cls) is not cls:
        raise ValueError(f"controller kind {cls.kind!r} is registered already ({KINDS[cls.kind].__name__})")
    KINDS[cls.kind] = cls
    return cls


def kinds(suffix: str | None = None) -> list[str]:
    """The registered kinds (those saved as ``suffix`` files)."""
    return [k for k, c in KINDS.items() if suffix is None or c.suffix == suffix]


def swept() -> list[type[Controller]]:
    """The kinds the tradeoff sweeps vary (those with a knob), in registration order."""
    return [c for c in KINDS.values() if c.knob is not None]
