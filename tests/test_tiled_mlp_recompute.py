"""Tiled MLP inside a non-reentrant checkpoint: the recompute ends before the tiled forward
(NOTE [Recompute ends before the tiled forward] in ddp_patches/tiled_mlp/function.py).

Each case trains 2 steps on 2 gloo ranks fed different data three ways -- untiled, the tiled path as it was before
the change (``LegacyTiledMLPFunction`` below, swapped in for ``tiled_mlp.patch.apply_tiled``), and the tiled path as it
is -- and counts the token rows that go through every gated MLP's ``gate_proj`` per step, in units of the rank's
tokens per layer ("passes"). Untiled under a non-reentrant checkpoint: 2 (forward + the checkpoint's recompute).
Tiled: the forward, then each shard again in the tiled backward; before the change the recompute ran the whole
tiled forward as well (3). Where nothing after the MLP in the checkpointed region saves its output (Llama,
Qwen2-VL's text tower, a bare checkpointed MLP) it is now 2; where something does (Gemma3's post-feedforward
norm) or torch's early stop is off, the recompute must produce the MLP output and it stays 3. Every case also
checks the new path's gradients bit-identical to the old one's and fp64 parity against a single process on the
global batch (untiled).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import ddp_patches
from ddp_patches import engines, tiled_mlp
from ddp_patches.offload import offloader as offload
from ddp_patches.tiled_mlp.function import _autocast_state, _replay, _rng_state
from ddp_patches.verify import fsdp2, hf_models, mlp_models, tiny, vlm_models
from ddp_patches.verify.cpu_offload import cpu_path_offloader
from ddp_patches.verify.parity import full_tensor, run_parity

SHARD = 5
STEPS = 2
PATHS = ("untiled", "legacy", "new")


# -- the tiled path before the change (commit d1bd874), kept here as the reference for bit-identity --------------
class LegacyTiledMLPFunction(torch.autograd.Function):
    """TiledMLPFunction as it was: it saved its own input, after its forward (so a checkpoint's recompute had to
    run the whole tiled forward before it could stop)."""

    @staticmethod
    def forward(ctx, forward_fn, rows, x2d, *params):
        ctx.forward_fn, ctx.rows, ctx.params = forward_fn, rows, params
        ctx.autocast = _autocast_state(x2d.device.type)
        ctx.rng_states = []
        out, start = None, 0
        for shard in x2d.split(rows):
            ctx.rng_states.append(_rng_state(x2d.device))
            y = forward_fn(shard)
            if out is None:
                out = y.new_empty((x2d.shape[0], y.shape[-1]))
            out[start:start + shard.shape[0]] = y
            start += shard.shape[0]
        ctx.save_for_backward(x2d)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x2d,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        dx = torch.empty_like(x2d) if want_x else None
        grads = [None] * len(ctx.params)
        start = 0
        for shard, g_shard, rng in zip(x2d.split(ctx.rows), grad_out.split(ctx.rows), ctx.rng_states):
            shard = shard.detach().requires_grad_(want_x)
            with _replay(x2d.device, rng, ctx.autocast), torch.enable_grad():
                out = ctx.forward_fn(shard)
            inputs = ([shard] if want_x else []) + [ctx.params[i] for i in wanted]
            got = torch.autograd.grad(out, inputs, g_shard, allow_unused=True)
            if want_x:
                dx[start:start + shard.shape[0]] = got[0] if got[0] is not None else 0
                got = got[1:]
            for i, g in zip(wanted, got):
                if g is not None:
                    grads[i] = g if grads[i] is None else grads[i].add_(g)
            start += shard.shape[0]
        for i in wanted:
            if grads[i] is None:
                grads[i] = torch.zeros_like(ctx.params[i])
        return (None, None, dx, *grads)


def _legacy_apply(forward_fn, rows, x2d, params, module=None):
    return LegacyTiledMLPFunction.apply(forward_fn, rows, x2d, *params)


@contextlib.contextmanager
def tiling(path: str):
    """Run the block untiled, with the old tiled path, or with the current one. (On code without ``apply_tiled``
    the swap is a no-op, so "legacy" and "new" are the same path there: the count assertions then fail.)"""
    if path == "untiled":
        with tiled_mlp.untiled():
            yield
        return
    missing = object()
    kept = vars(tiled_mlp.patch).get("apply_tiled", missing)  # the patched forward looks it up there
    if path == "legacy":
        tiled_mlp.patch.apply_tiled = _legacy_apply
    try:
        yield
    finally:
        if kept is missing:
            vars(tiled_mlp.patch).pop("apply_tiled", None)
        else:
            tiled_mlp.patch.apply_tiled = kept


# -- models: build, batch, tokens per rank ------------------------------------------------------------------------
def _llama(ckpt_kwargs, qlora=False):
    # 3 layers: under PEFT the first layer's input is a grad-requiring leaf and the last one stays, so offload
    # has one layer input to move
    return lambda: hf_models.build_lora_model("llama", ckpt_kwargs, qlora=qlora, layers=3)


def _gemma3_text(ckpt_kwargs):
    def build():
        from peft import LoraConfig, get_peft_model

        model = tiny.build("gemma3_text").double()
        hf_models.enable_checkpointing(model, ckpt_kwargs)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=hf_models.LORA_TARGETS))
        model.train()
        return model

    return build


def _qwen2_vl(ckpt_kwargs):
    return lambda: vlm_models.build_vlm("qwen2_vl", ckpt_kwargs, dtype=torch.float64)


def _vlm_batch(r, i, m):  # rank 1 text-only: its language model sees no image tokens
    b = vlm_models.vlm_batch("qwen2_vl", r, i, m, text_only_rank=1)
    return {k: (v.double() if v.is_floating_point() else v) for k, v in b.items()}


MODELS = {  # name -> (build(ckpt_kwargs, qlora), batch, combine, loss)
    "llama": (_llama, hf_models.lm_batch, hf_models.combine_lm, hf_models.lm_loss),
    "gemma3_text": (lambda ck, qlora=False: _gemma3_text(ck), hf_models.lm_batch, hf_models.combine_lm,
                    hf_models.lm_loss),
    "qwen2_vl": (lambda ck, qlora=False: _qwen2_vl(ck), _vlm_batch, hf_models.combine_lm, hf_models.lm_loss),
    # MLPs checkpointed on their own behind a frozen projection: the first MLP's input does not require grad
    "mlp_stack": (lambda ck, qlora=False: (lambda: mlp_models.build_stack("llama", checkpointed=False)),
                  mlp_models.stack_batch, list, mlp_models.stack_loss),
}


def _tokens(batch) -> int:
    x = batch["input_ids"] if isinstance(batch, dict) else batch[..., 0]
    return x.numel()


def _mlps(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if tiled_mlp.rules._structure_problem(m) is None]


def _count_rows(model) -> list[int]:
    """A one-element counter of the rows through every gated MLP's gate_proj (forward, recompute, replay)."""
    rows = [0]

    # A wrapped forward, not a forward hook: a hook inside a gated MLP makes it run untiled
    # (NOTE [Hooks inside a tiled MLP]), which is what this counter must not change.
    def counted(forward):
        def forward_and_count(x, *args, **kwargs):
            rows[0] += x.numel() // x.shape[-1]
            return forward(x, *args, **kwargs)

        return forward_and_count

    for mlp in _mlps(model):
        mlp.gate_proj.forward = counted(mlp.gate_proj.forward)
    return rows


# FSDP2: the vision blocks join the root's group (the text-only rank never runs them: their own all-gathers would
# not match), and a parameter a rank did not use reduce-scatters a zero (as tests/test_engines.py shards a VLM)
FSDP2_SHARDING = {"skip": ("Qwen2VLVisionBlock",), "unused_params": True}


def _wrap(engine: str):
    if engine == "fsdp2":
        return lambda model, **_: fsdp2.shard(model, **FSDP2_SHARDING)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return lambda model, **_: DDP(model)


def _train(path: str, build, batch, loss_fn, engine: str, early_stop: bool) -> dict:
    """STEPS optimizer steps on this rank's batches; the gradients after each backward and the MLP passes."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(1234)
    local = build()
    model = _wrap(engine)(local)
    layers = len(_mlps(local))
    rows = _count_rows(local)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    grads, passes, moved = [], [], 0
    for it in range(STEPS):
        b = batch(rank, it, 0)
        rows[0] = 0
        with tiling(path), torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            loss_fn(model, b).backward()
        passes.append(rows[0] / (layers * _tokens(b)))
        moved += offload.current().stats.offloaded_tensors if offload.current() is not None else 0
        grads.append([full_tensor(p.grad).clone() for p in local.parameters() if p.requires_grad])
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "passes": passes, "offloaded": moved}


def recompute_case(name: str, ckpt_kwargs=None, *, engine: str = "ddp", early_stop: bool = True,
                   offloaded: bool = False, qlora: bool = False) -> dict:
    make, batch, combine, loss_fn = MODELS[name]
    build = make(ckpt_kwargs, qlora=qlora)
    with contextlib.ExitStack() as stack:
        stack.enter_context(ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD, offload=offloaded))
        if offloaded:  # offload's real pack/unpack path on CPU tensors (ddp_patches/verify/cpu_offload.py)
            stack.enter_context(offload.use_offloader(cpu_path_offloader()))
        runs = {path: _train(path, build, batch, loss_fn, engine, early_stop) for path in PATHS}
        tiled_before = tiled_mlp.counts()["tiled_calls"]
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            parity = run_parity(build, batch, combine, loss_fn, iters=STEPS, lr=0.5,
                                reference_context=tiled_mlp.untiled, wrap=_wrap(engine),
                                stands_in_for=engines.FSDP2 if engine == "fsdp2" else engines.DDP)
        tiled_calls = tiled_mlp.counts()["tiled_calls"] - tiled_before
    new, legacy = runs["new"]["grads"], runs["legacy"]["grads"]
    return {
        # after the first step: that one also ran each class's probe (4 + 2 + 2 rows, once)
        "passes": {path: runs[path]["passes"][1:] for path in PATHS},
        "bit_identical": all(torch.equal(a, b) for step_new, step_old in zip(new, legacy)
                             for a, b in zip(step_new, step_old)),
        "grads_compared": sum(len(step) for step in new),
        "parity": parity.as_dict(),
        "tiled_calls": tiled_calls,
        "offloaded": {path: runs[path]["offloaded"] for path in PATHS},
    }


# name, kwargs, expected passes of the new path (untiled 2, old tiled 3), parity tolerance. Early stop off: torch's
# recompute then runs the whole region, tiled MLP included, by the user's choice (as before the change).
NON_REENTRANT = {"use_reentrant": False}
CASES = {
    "llama": ("llama", {"ckpt_kwargs": NON_REENTRANT}, 2, 1e-9),
    "llama-early-stop-off": ("llama", {"ckpt_kwargs": NON_REENTRANT, "early_stop": False}, 3, 1e-9),
    "llama-offload": ("llama", {"ckpt_kwargs": NON_REENTRANT, "offloaded": True}, 2, 1e-9),
    "llama-reentrant-swapped": ("llama", {"ckpt_kwargs": {"use_reentrant": True}}, 2, 1e-9),
    "llama-fsdp2": ("llama", {"ckpt_kwargs": NON_REENTRANT, "engine": "fsdp2"}, 2, 1e-9),
    "llama-qlora": ("llama", {"qlora": True}, 2, 1e-4),  # fp32, peft's kbit prep: {} kwargs, reentrant, swapped
    # Gemma3's post-feedforward norm saves what it computes from the MLP output: the recompute must run the MLP
    "gemma3_text": ("gemma3_text", {"ckpt_kwargs": NON_REENTRANT}, 3, 1e-9),
    "gemma3_text-early-stop-off": ("gemma3_text", {"ckpt_kwargs": NON_REENTRANT, "early_stop": False}, 3, 1e-9),
    "qwen2_vl": ("qwen2_vl", {"ckpt_kwargs": NON_REENTRANT}, 2, 1e-9),
    "qwen2_vl-early-stop-off": ("qwen2_vl", {"ckpt_kwargs": NON_REENTRANT, "early_stop": False}, 3, 1e-9),
    "qwen2_vl-offload-fsdp2": ("qwen2_vl", {"ckpt_kwargs": NON_REENTRANT, "engine": "fsdp2", "offloaded": True},
                               2, 1e-9),
    "mlp-stack-frozen-input": ("mlp_stack", {}, 2, 1e-9),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tiled_mlp_runs_no_extra_forward_in_the_recompute(pool, case):
    name, kwargs, expected, tol = CASES[case]
    results = pool.run(recompute_case, name=name, **kwargs)
    for r in results:
        assert r["passes"]["untiled"] == [2.0] * (STEPS - 1), r["passes"]
        assert r["passes"]["legacy"] == [3.0] * (STEPS - 1), r["passes"]
        assert r["passes"]["new"] == [float(expected)] * (STEPS - 1), r["passes"]
        assert r["bit_identical"] and r["grads_compared"] > 0
        assert r["parity"]["max_rel_error"] <= tol and r["parity"]["ranks_in_sync"], r["parity"]
        assert r["tiled_calls"] > 0
    if kwargs.get("offloaded"):  # each path moved checkpoint inputs every step (on one rank at least)
        assert all(sum(r["offloaded"][path] for r in results) >= STEPS for path in PATHS), results


# -- the Functions on their own, in one process ---------------------------------------------------------------------
class _Toy:
    """A gated MLP as a closure over fp64 weights, counting the rows it runs, and a layer around it:
    ``h + mlp(sin(h))`` (nothing after the MLP saves) or ``h + mlp(sin(h))**2`` (the square saves its input)."""

    def __init__(self, hidden=8, inter=16):
        g = torch.Generator().manual_seed(0)
        self.gate, self.up = (torch.randn(hidden, inter, generator=g, dtype=torch.float64).requires_grad_()
                              for _ in range(2))
        self.down = torch.randn(inter, hidden, generator=g, dtype=torch.float64).requires_grad_()
        self.rows = 0

    def params(self):
        return (self.gate, self.up, self.down)

    def mlp(self, x):
        self.rows += x.shape[0]
        return (torch.nn.functional.silu(x @ self.gate) * (x @ self.up)) @ self.down

    def layer(self, h, path, saves_output):
        x = torch.sin(h)
        rows = tiled_mlp.shard_sizes(x.shape[0], x.shape[1], 4)
        if path == "untiled":
            y = self.mlp(x)
        else:
            y = (_legacy_apply if path == "legacy" else tiled_mlp.apply_tiled)(self.mlp, rows, x, self.params())
        return h + (y * y if saves_output else y)


def _toy_run(path, *, early_stop=True, saves_output=False, h_grad=True, backwards=1):
    toy = _Toy()
    h = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(h_grad)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        out = torch.utils.checkpoint.checkpoint(toy.layer, h, path, saves_output, use_reentrant=False)
        loss = out.pow(2).sum()
        toy.rows = 0
        for i in range(backwards):
            loss.backward(retain_graph=i < backwards - 1)
    grads = [p.grad for p in toy.params()] + ([h.grad] if h_grad else [])
    return {"passes": toy.rows / h.shape[0], "grads": grads}


@pytest.mark.parametrize("early_stop,saves_output,expected", [
    (True, False, 1), (True, True, 2), (False, False, 2), (False, True, 2)],
    ids=["early-stop", "output-saved", "early-stop-off", "early-stop-off-output-saved"])
@pytest.mark.parametrize("h_grad", [True, False], ids=["input-grad", "frozen-input"])
def test_functions_alone_in_a_checkpoint(early_stop, saves_output, expected, h_grad):
    """Rows run in backward (the forward's are not counted): untiled recomputes once; the tiled replay runs once
    more; the new path skips the recompute's tiled forward exactly where nothing saves the output and early stop is
    on. With a frozen input the anchor makes the saving node, and no input gradient is computed."""
    runs = {path: _toy_run(path, early_stop=early_stop, saves_output=saves_output, h_grad=h_grad)
            for path in PATHS}
    assert runs["untiled"]["passes"] == 1 and runs["legacy"]["passes"] == 2
    assert runs["new"]["passes"] == expected
    assert all(torch.equal(a, b) for a, b in zip(runs["new"]["grads"], runs["legacy"]["grads"]))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(runs["new"]["grads"],
                                                                             runs["untiled"]["grads"]))


@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpointed", "plain"])
def test_retain_graph_backward_twice(checkpointed):
    """The tiled backward reads the saving node's input in each backward of a retained graph (that node releases
    it only after its own backward, which comes after the tiled one's)."""
    def run(path):
        toy = _Toy()
        h = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = torch.utils.checkpoint.checkpoint(toy.layer, h, path, False, use_reentrant=False) if checkpointed \
            else toy.layer(h, path, False)
        loss = out.pow(2).sum()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in (*toy.params(), h)]
        loss.backward()
        return first, [p.grad for p in (*toy.params(), h)]

    (first, second), (old_first, old_second) = run("new"), run("legacy")
    assert all(torch.equal(a, b) for a, b in zip(first + second, old_first + old_second))
    assert all(torch.equal(2 * a, b) for a, b in zip(first, second))


def test_saved_input_is_released_after_backward():
    """Without retain_graph the saving node drops its input after its own backward, as the old Function did."""
    toy = _Toy()
    x = torch.randn(20, 8, dtype=torch.float64).requires_grad_()
    out = tiled_mlp.apply_tiled(toy.mlp, [5] * 4, x * 1, toy.params())
    node = out.grad_fn.next_functions[0][0]
    assert type(node).__name__ == "SaveMLPInputBackward"
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        node.saved_tensors


# -- discovery: a wrapper around a bare MLP is not an MLP ---------------------------------------------------------
def wrapper_case() -> dict:
    """A PeftModel around a bare LlamaMLP reaches gate/up/down through its ``__getattr__``; its class was taken
    for an MLP and patched, so a PeftModel around a language model, called with keyword arguments, then failed
    (TypeError: forward() missing 'x'). Now the MLP inside tiles and every other call runs as without apply()."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches._registry import REGISTRY

    rank = torch.distributed.get_rank()
    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        torch.manual_seed(0)
        mlp = DDP(get_peft_model(mlp_models.build_mlp("llama").double(),
                                 LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"])))
        mlp(mlp_models.stack_batch(rank, 0, 0)).pow(2).sum().backward()
        tiled = tiled_mlp.counts()["tiled_calls"]
        inner = mlp.module.base_model.model
        x = mlp_models.stack_batch(rank, 0, 0)
        with engines.acting_as(engines.DDP):  # a keyword call runs the original forward, untiled
            by_keyword = inner(x=x)
            with tiled_mlp.untiled():
                by_keyword = torch.equal(by_keyword, inner(x)) and tiled_mlp.counts()["tiled_calls"] == tiled
        lm = DDP(hf_models.build_lora_model("llama", NON_REENTRANT))
        lm(**hf_models.lm_batch(rank, 0, 0)).loss.backward()  # keyword arguments only
        return {"tiled": tiled, "peft_forward_patched": REGISTRY.is_patched(PeftModel, "forward"),
                "keyword_call_same": by_keyword, "lm_trained": all(p.grad is not None for p in lm.parameters()
                                                                   if p.requires_grad)}


def test_a_wrapper_around_an_mlp_is_not_taken_for_one(pool):
    for r in pool.run(wrapper_case):
        assert r == {"tiled": 1, "peft_forward_patched": False, "keyword_call_same": True, "lm_trained": True}
