"""Deprecated module paths: the layout before docs/design.md's (``remat.graph``, ``remat.plan`` as a
module, ``remat.solvers.ilp_scalable``, ...).  Each old path is registered in ``sys.modules`` as a
thin module that forwards every attribute to the module that now holds it with a
`DeprecationWarning`, so ``from remat.graph import Graph`` keeps working.  Nothing here
imports torch.
"""
from __future__ import annotations

import importlib
import sys
import types
import warnings


class MovedModule(types.ModuleType):
    """A module name kept for old imports: attributes come from the first of `targets` that has
    them (each imported on first use)."""

    def __init__(self, old: str, targets: tuple[str, ...]):
        super().__init__(old, f"Deprecated: moved to {', '.join(targets)}.")
        self.__dict__["_moved_to"] = targets

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        for target in self.__dict__["_moved_to"]:
            module = importlib.import_module(target)
            if hasattr(module, name):
                break
        else:
            raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(self.__dict__['_moved_to'])}) "
                                 f"has no attribute {name!r}")
        warnings.warn(f"{self.__name__}.{name} moved to {target}.{name}; the old path goes in a later release",
                      DeprecationWarning, stacklevel=2)
        return getattr(module, name)

    def __dir__(self):
        return sorted({n for t in self.__dict__["_moved_to"] for n in dir(importlib.import_module(t))})


def register_moved(moves: dict[str, "str | tuple[str, ...]"]) -> None:
    """Register each old module path (key) as a `MovedModule` forwarding to its new one, or to
    the first of several that has a name (value), unless the old path is a real module already."""
    for old, new in moves.items():
        sys.modules.setdefault(old, MovedModule(old, (new,) if isinstance(new, str) else tuple(new)))


__all__ = ["MovedModule", "register_moved"]
