"""The activation peak of one decoder layer's forward+backward, attention projections tiled or not: memsim's
machinery (fake tensors at real shapes, ``memsim.LiveBytes``), no device needed.

    python benchmarks/tiled_attention_bytes.py        # Llama-8B layer (H 4096, I 14336, GQA 32/8) at 32K, 262K
    python benchmarks/tiled_attention_bytes.py --tokens 8192 --hidden 512 --intermediate 1792 --heads 8 --kv-heads 2

One Llama decoder layer, bf16, LoRA r=16 on q/k/v/o/gate/up/down (PEFT's float32 adapters), run in a non-reentrant
checkpoint with the tiled MLP on (its automatic rule, as ``memsim._tiling``), SDPA without a mask (memsim's
``ATTENTION``). Variants: untiled attention; the cheaper exact change (each LoRA input saved in bf16 and cast in
its backward, instead of saving PEFT's float32 copy); the tiled attention (``tiled_attention.tile_model``).
Bytes are those created in the step, beyond the layer's input, weights and upstream gradient.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddp_patches import tiled_attention, tiled_mlp  # noqa: E402
from ddp_patches.plan import memsim, model as sim_model  # noqa: E402


class _CastLinear(torch.autograd.Function):
    """lora_A on the bf16 input, cast inside: saves the bf16 input (the cast is deterministic, so exact)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        return (grad @ weight).to(x.dtype), flat.t() @ x.reshape(-1, x.shape[-1]).to(weight.dtype)


@contextlib.contextmanager
def _bf16_lora_inputs(layer):
    from peft.tuners.lora.layer import Linear

    for m in layer.modules():
        if isinstance(m, Linear):
            m._cast_input_dtype = lambda x, dtype: x
            a = m.lora_A["default"]
            a.forward = lambda x, a=a: _CastLinear.apply(x, a.weight)
    yield


@contextlib.contextmanager
def _tiled_mlp(layer):
    mlp = layer.mlp
    original = mlp.forward

    def forward(x):
        rows = x.numel() // x.shape[-1]
        sizes = tiled_mlp.shard_sizes(rows, x.shape[-1], None, tiled_mlp.rules.intermediate_width(mlp, x))
        if len(sizes) == 1:
            return original(x)
        params = tuple(p for p in mlp.parameters() if p.requires_grad)
        return tiled_mlp.apply_tiled(original, sizes, x.reshape(rows, x.shape[-1]), params).view(x.shape)

    mlp.forward = forward
    try:
        yield
    finally:
        del mlp.forward


def layer_peak(tokens: int, variant: str, *, hidden: int = 4096, intermediate: int = 14336, heads: int = 32,
               kv_heads: int = 8, lora_r: int = 16, shard_tokens: int | None = None) -> int:
    """Peak live bytes of one checkpointed layer's forward+backward; ``variant``: "untiled", "bf16-lora-inputs"
    or "tiled"."""
    from peft import LoraConfig, get_peft_model
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    sim_model._register_attention()
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=16)
    config._attn_implementation = sim_model.ATTENTION
    with torch.device("meta"):
        holder = torch.nn.Module()
        holder.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, 0).to(torch.bfloat16)])
    model = get_peft_model(holder, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    layer = model.base_model.model.layers[0]
    head_dim = hidden // heads
    with FakeTensorMode(allow_non_fake_inputs=True):
        sim_model._materialise(model)
        x = torch.empty(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = (torch.empty(1, tokens, head_dim, dtype=torch.bfloat16) for _ in range(2))
        grad = torch.empty(1, tokens, hidden, dtype=torch.bfloat16)
        live = memsim.LiveBytes()
        live.exclude([*model.parameters(), x, cos, sin, grad])
        with contextlib.ExitStack() as stack:
            stack.enter_context(_tiled_mlp(layer))
            if variant == "bf16-lora-inputs":
                stack.enter_context(_bf16_lora_inputs(layer))
            elif variant == "tiled":
                stack.enter_context(tiled_attention.tile_model(layer, shard_tokens))
            with live:
                out = torch.utils.checkpoint.checkpoint(lambda t: layer(t, position_embeddings=(cos, sin)), x,
                                                        use_reentrant=False)
                out.backward(grad)
    return live.peak["device"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 262144])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    args = parser.parse_args()
    shape = dict(hidden=args.hidden, intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads)
    for tokens in args.tokens:
        unit = tokens * args.hidden * 2  # one bf16 hidden-state tensor
        for variant in ("untiled", "bf16-lora-inputs", "tiled"):
            peak = layer_peak(tokens, variant, **shape)
            print(f"{tokens:>7} tokens  {variant:<17} {peak / memsim.GiB:7.2f} GiB  {peak / unit:5.1f} hidden-state "
                  "tensors", flush=True)


if __name__ == "__main__":
    main()
