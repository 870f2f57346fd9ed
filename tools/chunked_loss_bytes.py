"""Bytes of the LM-loss path, unchunked (transformers' ForCausalLMLoss on lm_head's logits) against
``apply(chunked_loss=True)``'s chunked loss, at real shapes on the meta device: a simulation (no real memory, no
compute). Every tensor an op creates is counted while it is alive; the hidden states and the head's weight, which
exist either way, are not. ``python -m tools.chunked_loss_bytes [tokens]`` prints one row per path.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HIDDEN, VOCAB = 4096, 128256  # Llama-3.1-8B


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes alive at once among the tensors created inside the block, and the largest one."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t._base is None:
                size = t.untyped_storage().nbytes()
                self.largest = max(self.largest, size)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, size)
        return out

    def _free(self, size: int) -> None:
        self.live -= size


def measure(tokens: int, chunked: bool, dtype=torch.bfloat16, device="meta") -> LiveBytes:
    from transformers.loss.loss_utils import ForCausalLMLoss

    from ddp_patches import chunked_loss

    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, device=device, dtype=dtype).requires_grad_(False)  # LoRA: frozen
    hidden = torch.empty(1, tokens, HIDDEN, device=device, dtype=dtype, requires_grad=True)
    labels = torch.zeros(1, tokens, dtype=torch.long, device=device)
    with LiveBytes() as mode:
        if chunked:
            loss = chunked_loss.chunked_causal_lm_loss(chunked_loss.function._Head(head, head.forward), hidden, labels,
                                                       ())
        else:
            loss = ForCausalLMLoss(head(hidden), labels, VOCAB)
        loss.backward()
    return mode


def main(argv: list[str]) -> None:
    tokens = int(argv[0]) if argv else 65536
    print(f"loss path of Llama-3.1-8B shapes (H {HIDDEN}, V {VOCAB}), {tokens} tokens, bf16, meta device "
          "(simulation)")
    for chunked in (False, True):
        mode = measure(tokens, chunked)
        print(f"{'chunked' if chunked else 'unchunked':>9}: peak {mode.peak / 2**30:7.2f} GiB, largest tensor "
              f"{mode.largest / 2**30:6.2f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
