"""The controller kinds rift-ada knows. One registration makes a :class:`~rift_ada.refresh.base.Controller` subclass
loadable from its files (``load_controller``), nameable as ``--controller`` (with a ``spelling``), swept by both
train_controller.py and reproduce_figures.py (with a ``knob``, ``rift_ada.sweep``) and, for a learned kind (with a
``train``), trained and exported by the main job:

    @register
    @dataclass
    class MyController(Controller):
        kind: ClassVar[str] = "mine"
        ...

The rule kinds live in this package; the learned kinds in ``rift_ada.controllers`` (one file each, registered by
importing it), which sits above the core: it is found through the ``rift_ada.controllers`` entry-point group
(pyproject.toml), loaded the first time a kind is looked up, so the core never imports it.
Kinds keep their registration order: it is the order of the sweeps' families and of the kinds an error lists.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from .base import Controller

KINDS: dict[str, type[Controller]] = {}
_plugins_loaded = False


def register(cls: type[Controller]) -> type[Controller]:
    """Make ``cls`` known by its ``kind`` (a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Controller)) or not cls.kind:
        raise ValueError(f"{cls!r}: a registered controller subclasses rift_ada.refresh.base.Controller and sets kind")
    if KINDS.get(cls.kind, cls) is not cls:
        raise ValueError(f"controller kind {cls.kind!r} is registered already ({KINDS[cls.kind].__name__})")
    KINDS[cls.kind] = cls
    return cls


def known() -> dict[str, type[Controller]]:
    """Every registered kind, the installed packages' learned kinds included (imported once, on first use)."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        for ep in entry_points(group="rift_ada.controllers"):
            ep.load()
    return KINDS


def kinds(suffix: str | None = None) -> list[str]:
    """The registered kinds (those saved as ``suffix`` files)."""
    return [k for k, c in known().items() if suffix is None or c.suffix == suffix]


def swept() -> list[type[Controller]]:
    """The rule kinds the tradeoff sweeps vary over values given on the command line (a knob, no training), in
    registration order."""
    return [c for c in known().values() if c.knob is not None and not c.learned()]


def learned() -> list[type[Controller]]:
    """The learned kinds (those with a ``train``), in registration order."""
    return [c for c in known().values() if c.learned()]
