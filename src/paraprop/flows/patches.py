"""Patches on instances (:func:`paraprop.flows.accelerate`): one library method of one
autoregressive part replaced on the instance (never the class) by a bound accelerated method,
the record of what to restore, and the counters of what the accelerated inverses did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from paraprop.flows.arguments import require_deterministic_parts
from paraprop.flows.part_solve import Settings
from paraprop.result import Solution

PATCH = "_paraprop_accelerate"   # the instance attribute that holds a part's Patch


@dataclasses.dataclass
class Counters:
    """What the accelerated inverses did since the flow was accelerated."""

    inversions: int = 0        # autoregressive inverses solved
    passes: int = 0            # passes (evaluations of the transform's network) they took
    library_passes: int = 0    # passes the library's own loops would have taken


@dataclasses.dataclass
class Patch:
    """One patched method of one part: the settings, and what to restore.

    Neither pickling (``pickle``, ``torch.save``) nor ``copy.deepcopy`` carries a patch: the
    part comes back with the library's own method (see :class:`Bound`), and this record as
    ``None``; no handle would own a patched copy.
    """

    cfg: Settings
    counters: Counters
    attribute: str                  # the patched method's name
    saved: Callable | None = None   # the instance attribute it replaced (None: the class's)
    where: str = ""                 # the part's name in the accelerated flow (for messages)

    def __reduce__(self):
        return (_no_patch, ())

    def original(self, part) -> Callable:
        """The method as it was before the patch, bound to ``part``."""
        if self.saved is not None:
            return self.saved
        return getattr(type(part), self.attribute).__get__(part)

    def recorder(self, library_passes: int) -> Callable[[Solution], None]:
        def record(sol: Solution) -> None:
            self.counters.inversions += 1
            self.counters.passes += sol.evaluations
            self.counters.library_passes += library_passes
        return record


def _no_patch() -> None:
    """What a pickled :class:`Patch` loads as: no patch."""
    return None


def _same(obj):
    return obj


class Bound:
    """``method`` bound to ``part``, installed as the part's instance attribute in place of the
    library's method (like ``types.MethodType``, with ``__func__`` and ``__self__``).

    Pickled (``pickle``, ``torch.save``) or deep-copied (``copy.deepcopy``) it becomes the
    method it replaced, so a saved or copied flow is the library's plain flow: acceleration is a
    patch of live instances owned by a handle, not state (apply
    :func:`paraprop.flows.accelerate` to the copy for one of its own).
    """

    __slots__ = ("__func__", "__self__", "attribute")

    def __init__(self, method: Callable, part: nn.Module, attribute: str):
        self.__func__, self.__self__, self.attribute = method, part, attribute

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        patch = self.__self__.__dict__.get(PATCH)
        saved = patch.saved if isinstance(patch, Patch) else None
        if saved is None:   # the class's method, looked up when the part loads
            return (getattr, (self.__self__, self.attribute))
        return (_same, (saved,))

    def __repr__(self) -> str:
        return (f"<paraprop.flows accelerated {type(self.__self__).__name__}.{self.attribute} "
                f"of {object.__repr__(self.__self__)}>")


def patch_of(part) -> Patch:
    return part.__dict__[PATCH]


def is_patched(part) -> bool:
    """Whether ``part`` carries an active patch (a loaded pickle carries ``None``)."""
    return isinstance(getattr(part, "__dict__", {}).get(PATCH), Patch)


def install(part: nn.Module, attribute: str, method: Callable, patch: Patch) -> None:
    """Bind ``method`` to ``part`` as its ``attribute`` (the instance only)."""
    patch.saved = part.__dict__.get(attribute)
    part.__dict__[PATCH] = patch
    part.__dict__[attribute] = Bound(method, part, attribute)


def remove(part: nn.Module) -> None:
    """Undo :func:`install` (nothing if ``part`` is not patched)."""
    patch = part.__dict__.pop(PATCH, None)
    if not isinstance(patch, Patch):
        return
    if patch.saved is None:
        part.__dict__.pop(patch.attribute, None)
    else:
        part.__dict__[patch.attribute] = patch.saved


def patch_name(part) -> str:
    """:func:`part_name` of an accelerated part (its name in the accelerated flow)."""
    where = patch_of(part).where
    return f"{where!r} ({type(part).__name__})" if where else type(part).__name__


ACCELERATE_HINT = ("; or call undo() on the paraprop.flows.accelerate handle to run the "
                   "library's own loop")


def check_accelerated(part: nn.Module) -> None:
    """At an accelerated call: the part's network must be deterministic now (the flow's mode
    may have changed since :func:`paraprop.flows.accelerate`)."""
    require_deterministic_parts([(patch_of(part).where, part)],
                                entry="paraprop.flows.accelerate", argument="flow",
                                hint=ACCELERATE_HINT)
