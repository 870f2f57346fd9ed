"""Run a callback right after a named module's body has executed, without importing it first."""

from __future__ import annotations

import importlib.util
import sys
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
        loader, original = spec.loader, spec.loader.exec_module

        def exec_module(module):
            try:
                original(module)
            finally:
                del loader.exec_module  # back to the class's method
            if self in sys.meta_path:
                sys.meta_path.remove(self)
                self.callback()

        loader.exec_module = exec_module
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def when_imported(name: str, callback: Callable[[], None]) -> AfterImport | None:
    """``callback()`` now if ``name`` is imported, else right after its import; the finder, or None if it ran."""
    if name in sys.modules:
        callback()
        return None
    finder = AfterImport(name, callback)
    sys.meta_path.insert(0, finder)
    return finder
