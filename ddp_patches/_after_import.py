"""Run a callback right after a named module's body has executed, without importing it first; find the classes
imported so far (``imported_subclasses``) for the patches that also act on later imports."""

from __future__ import annotations

import importlib.util
import sys
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at start-up

if TYPE_CHECKING:
    from typing import Callable


class AfterImport:
    """A one-shot ``sys.meta_path`` finder: once ``name`` is really imported, run ``callback``.

    It stays on the path until the module body has run: ``importlib.util.find_spec(name)``, which libraries call
    to test availability, asks for a spec without executing it. ``remove()`` takes it off the path (a registry
    handle: revert() removes a finder that never fired).
    """

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback
        self._finding = False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)  # what the finders after this one would return
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        # This spec's loader only: a zip or frozen importer serves many modules with one loader object, so the
        # shared loader is never modified (the module's own imports go through it unchanged).
        spec.loader = _ThenCall(spec.loader, self._done)
        return spec

    def _done(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
            self.callback()

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _ThenCall:
    """A loader for one spec: the original loader executes the module, then ``after()`` runs. The module keeps
    the original loader as its ``__loader__`` and ``__spec__.loader``."""

    def __init__(self, loader, after: Callable[[], None]) -> None:
        self._loader, self._after = loader, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._after()

    def __getattr__(self, name):  # get_source, is_package, resource readers: the original's
        return getattr(self._loader, name)


def when_imported(name: str, callback: Callable[[], None]) -> AfterImport | None:
    """``callback()`` now if ``name`` is imported, else right after its import; the finder, or None if it ran."""
    if name in sys.modules:
        callback()
        return None
    finder = AfterImport(name, callback)
    sys.meta_path.insert(0, finder)
    return finder


def imported_subclasses(root: type, keep: Callable[[type], bool]) -> list[type]:
    """Every subclass of ``root`` imported so far, at any depth, for which ``keep`` is true: what a patch that
    also hooks later imports must patch at once."""
    seen, stack, found = set(), [root], []
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                if keep(sub):
                    found.append(sub)
    return found
