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
        self._resets: dict[str, Callable[[], None]] = {}  # NOTE [Each module forgets its own state]
        self._deferred: list[tuple[Callable[[], None], tuple[tuple[Any, str], ...]]] = []

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
                "See the supported versions in docs/compatibility.md."
            )
        original = vars(owner)[name]
        replacement = make_replacement(original)
        _mark(replacement, original)
        setattr(owner, name, replacement)
        self._patches[key] = _Patch(owner, name, original, replacement)
        logger.debug("patched %s.%s", _qualname(owner), name)

    def restore(self, owner: Any, name: str) -> None:
        """Put back the original of one patch (a no-op when ``owner.name`` is not patched)."""
        patch = self._patches.pop((id(owner), name), None)
        if patch is not None and vars(owner).get(name) is patch.replacement:
            setattr(owner, name, patch.original)

    # NOTE [A deferred apply() settles first]
    # Invariant: a deferred apply() runs before anything it was deferred for. ddp-patches-run may have to defer
    # apply() past an import chain (NOTE [Import-safe at torch import]); stand-ins wait on the entry points instead
    # (installed here, so revert() and inspect.unwrap see them).
    # Rule: whatever comes first -- a stand-in's call, or the script's own apply() -- settles: the stand-ins go,
    # the deferred apply() runs with the environment's options, and only then the caller proceeds. revert() drops
    # what still waits.
    # Test: tests/test_api.py::test_a_deferred_apply_settles_first_and_revert_drops_it
    # Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §3
    def defer(self, run: Callable[[], None], *targets: tuple[Any, str]) -> None:
        """Keep ``run`` for the next settle(); ``targets`` are the (owner, name) patches, installed by the caller,
        that wait for it: settle() puts their originals back first (NOTE [A deferred apply() settles first])."""
        self._deferred.append((run, targets))

    def settle(self) -> None:
        """Run what was deferred, once, oldest first."""
        while self._deferred:
            run, targets = self._deferred.pop(0)
            for owner, name in targets:
                self.restore(owner, name)
            run()

    # NOTE [Each module forgets its own state]
    # Invariant: no module's state outlives the patches (probe verdicts, once-only log keys, the engine seen).
    # Rule: such a module registers its own ``forget`` here when it is imported; restore_all() -- revert(), a
    # re-apply, an apply() that failed half-way -- calls every one. So api lists no module's internals, and a
    # module added later cannot be forgotten by it.
    # Test: tests/test_api.py::test_revert_forgets_every_modules_state
    # Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §3
    def on_reset(self, forget: Callable[[], None]) -> None:
        """Call ``forget`` after every restore_all(): a module's state that must not outlive the patches."""
        self._resets[f"{forget.__module__}.{forget.__qualname__}"] = forget

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
        for _, targets in self._deferred:  # stand-ins for an apply() that never ran: not patches of it
            for owner, name in targets:
                self.restore(owner, name)
        self._deferred.clear()
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
        for forget in self._resets.values():
            forget()
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
