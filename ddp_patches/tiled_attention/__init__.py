"""The projections around Hugging Face attention run tiled along the token dimension, DDP-safe (opt-in).

Under DDP with grad enabled, a call runs the input norm, q/k/v (LoRA included, and q/k norms) and o_proj in token
shards through the tiled MLP's machinery, while the class's own forward runs RoPE and the attention kernel on the
whole sequence. ``call``: one tiled call; ``rules``: whether, and in how many shards, a call tiles; ``patch``: the
patched forwards, discovery, ``install``. ``tile_model(model)`` tiles one model's attention in any process (the
memory simulator, single-process checks); ``counts()`` says how many calls tiled.
"""

from __future__ import annotations

from . import call, patch, rules
from .call import counts
from .patch import discover, enabled, install, tile_model
from .rules import AUTO_SHARDS, auto_shards, forget, shard_sizes

__all__ = ["AUTO_SHARDS", "auto_shards", "call", "counts", "discover", "enabled", "forget", "install", "patch", "rules",
           "shard_sizes", "tile_model"]
