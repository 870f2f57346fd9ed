"""A causal LM's training loss computed from the final hidden states in chunks of tokens (opt-in).

``function``: the loss in chunks (``ChunkedCrossEntropy``, ``chunked_causal_lm_loss``); ``deferred``: lm_head's
placeholder inside an acting call (NOTE [Deferred logits]); ``rules``: when it acts
(NOTE [When the chunked loss acts]); ``patch``: the patched causal-LM ``forward``, discovery, ``install``. The
returned ``logits`` is None where it acts. ``unchunked()`` computes the loss as without the library inside a block; ``counts()`` says how many calls
were chunked.
"""

from __future__ import annotations

from . import deferred, function, patch, rules
from .deferred import DeferredLogits
from .function import ChunkedCrossEntropy, chunk_rows, chunk_sizes, chunked_causal_lm_loss, counts, unchunked
from .patch import enabled, install, note_fused

__all__ = ["ChunkedCrossEntropy", "DeferredLogits", "chunk_rows", "chunk_sizes", "chunked_causal_lm_loss", "counts",
           "deferred", "enabled", "function", "install", "note_fused", "patch", "rules", "unchunked"]
