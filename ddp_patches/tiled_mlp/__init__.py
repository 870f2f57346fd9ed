"""Hugging Face gated MLPs run tiled along the token dimension, with a DDP-safe backward (opt-in).

``function``: the autograd Functions (``apply_tiled``); ``rules``: whether, and in how many shards, a call tiles;
``patch``: the patched ``forward``, discovery by structure, ``install``. ``untiled()`` runs patched MLPs untiled
inside a block; ``counts()`` says how many calls tiled.
"""

from __future__ import annotations

from . import function, patch, rules
from .function import SaveMLPInput, TiledMLPFunction, apply_tiled
from .patch import counts, discover, enabled, install, install_discovery
from .rules import SAVED_PER_TOKEN, auto_shards, dropout_off, shard_sizes, untiled

__all__ = ["SAVED_PER_TOKEN", "SaveMLPInput", "TiledMLPFunction", "apply_tiled", "auto_shards", "counts",
           "discover", "dropout_off", "enabled", "function", "install", "install_discovery", "patch", "rules",
           "shard_sizes", "untiled"]
