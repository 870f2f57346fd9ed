"""The library's own record of what it replaced, so that revert() restores the originals by identity.

Originals are kept here, never as attributes on torch or transformers objects. A replacement carries a marker
(``__ddp_patches__``) and ``__wrapped__`` pointing at what it replaced, so a reader of a traceback or of
``inspect.unwrap`` can see what happened.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("ddp_patches")

MARKER = "__ddp_patches__"


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any
    replacement: Any


class PatchRegistry:
    """Attribute replacements plus removable hooks, undone together and in reverse order."""

    def __init__(self) -> None:
        self._patches: dict[tuple[int, str], _Patch] = {}
        self._handles: list[Any] = []
        self._instance_handles: list[Any] = []  # NOTE [Live DDPs stay protected]

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` was before it was patched (the live attribute when it is not patched)."""
        patch = self._patches.get((id(owner), name))
        return patch.original if patch is not None else vars(owner)[name]

    def is_patched(self, owner: Any, name: str) -> bool:
        return (id(owner), name) in self._patches

    def install(self, owner: Any, name: str, make_replacement: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` (a module global or a class attribute) with ``make_replacement(original)``.

        Installing twice is a no-op, which is what makes apply() idempotent.
        """
        key = (id(owner), name)
        if key in self._patches:
            return
        if name not in vars(owner):
            # vars(), not getattr(): a class attribute must be the raw descriptor defined on that very class,
            # or revert() would write an inherited function onto a subclass.
            raise ImportError(
                f"ddp_patches: cannot patch {_qualname(owner)}.{name}: no such attribute in this version. "
                "See the supported versions in README.md."
            )
        original = vars(owner)[name]
        replacement = make_replacement(original)
        _mark(replacement, original)
        setattr(owner, name, replacement)
        self._patches[key] = _Patch(owner, name, original, replacement)
        logger.debug("patched %s.%s", _qualname(owner), name)

    def add_handle(self, handle: Any) -> None:
        """Keep a ``torch.utils.hooks.RemovableHandle`` (it holds its hook dict weakly) for revert()."""
        self._handles.append(handle)

    def add_instance_handle(self, handle: Any) -> None:
        """A hook that protects one live DDP instance (NOTE [Live DDPs stay protected]); removed by revert() only."""
        self._instance_handles.append(handle)

    def restore_all(self, keep_instances: bool = False) -> list[str]:
        """Undo everything, newest first; return the names restored. ``keep_instances``: leave the hooks that
        protect live DDP instances in place (a re-apply that keeps the reducer patches)."""
        restored = []
        handles = self._handles if keep_instances else self._instance_handles + self._handles
        for handle in reversed(handles):
            handle.remove()
        self._handles.clear()
        if not keep_instances:
            self._instance_handles.clear()
        for patch in reversed(list(self._patches.values())):
            current = vars(patch.owner).get(patch.name)
            if current is not patch.replacement:
                logger.warning(
                    "ddp_patches: %s.%s was replaced again by someone else after apply(); restoring the "
                    "original anyway",
                    _qualname(patch.owner),
                    patch.name,
                )
            setattr(patch.owner, patch.name, patch.original)
            restored.append(f"{_qualname(patch.owner)}.{patch.name}")
        self._patches.clear()
        return restored


def _mark(replacement: Any, original: Any) -> None:
    try:
        setattr(replacement, MARKER, True)
        setattr(replacement, "__wrapped__", original)
    except (AttributeError, TypeError):  # e.g. a bound builtin; the registry still knows
        pass


def _qualname(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))


REGISTRY = PatchRegistry()
