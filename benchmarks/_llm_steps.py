"""Worker for the step-cost benchmarks: a small random-init Llama with LoRA and activation checkpointing, trained
for a few steps on each rank under several DDP configurations at once, interleaved step by step.

Configurations (all on the same data, the same initial weights):
  unpatched   the best configuration that works without the library: non-reentrant checkpointing,
              find_unused_parameters=False. Built before apply(); its steps run with the offload wrapper's
              pass-through only (one ``yield from`` per checkpoint call).
  patched     apply() with DDP's defaults: reentrant kwargs (run non-reentrant under DDP),
              find_unused_parameters unset (kept False), the unused-parameter bookkeeping and the trainable-set
              guard.
  patched-fu-true  the same with find_unused_parameters=True (what the Trainer passes for a PeftModel, and what
              an earlier design forced): this / patched = the cost of DDP's own search for unused parameters.
In a single process (world size 1) DDP is not used: every configuration is the plain model.

``--model moe`` (ddp_overhead's many-tensors config): a tiny Switch Transformers model (encoder and decoder, every
block sparse, 320 experts each), LoRA on every expert's ``wi``/``wo`` and on attention: 10,336 trainable tensors.
transformers 5 fuses the experts of the decoder-only MoE families (Mixtral, Qwen-MoE: 3-D parameters, one LoRA
pair per block), Switch keeps one ``nn.Linear`` pair per expert, so LoRA on the experts gives four tensors per
expert. Each rank routes fewer tokens per block than there are experts, so experts idle on every rank and every
step, and the best working unpatched configuration is non-reentrant checkpointing with
find_unused_parameters=True: with False the reducer raises "Expected to have finished reduction" at the second
forward (checked in every run, ``fu_false_error``), and static_graph=True fixes the unused set at the first step
while the idle experts change from step to step. So for this model "unpatched" is find_unused=True; "patched"
and "patched-fu-true" are as above.

``--device cuda``: both ranks on cuda:0 (gloo all-reduces CUDA tensors through host copies); step times wait for
the device. ``--hook-steps N``: after the interleaved rounds, N more steps of each patched configuration with the
library's per-parameter hooks timed on their own (``_HookTimers``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = ("unpatched", "patched", "patched-fu-true")


def build(ckpt_kwargs: dict, hidden: int, layers: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                  max_position_embeddings=4096, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    model.config.use_cache = False
    lora = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    model.train()
    return model


def build_moe(ckpt_kwargs: dict, hidden: int, layers: int, experts: int, seq: int):
    """Switch Transformers, ``layers`` encoder and ``layers`` decoder blocks, all sparse, ``experts`` experts each
    (one ``nn.Linear`` pair per expert); LoRA r=4 on every expert's ``wi``/``wo`` and on attention. No router
    jitter and no dropout, so a recompute routes as its forward did without any RNG state."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(0)
    config = SwitchTransformersConfig(
        vocab_size=512, d_model=hidden, d_kv=hidden // 2, d_ff=hidden, num_layers=layers, num_decoder_layers=layers,
        num_heads=2, num_experts=experts, expert_capacity=seq, encoder_sparse_step=1, decoder_sparse_step=1,
        router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = SwitchTransformersForConditionalGeneration(config)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["wi", "wo", "q", "k", "v", "o"]))
    model.train()
    return model


def _builder(args):
    """``build(ckpt_kwargs)`` for ``--model``."""
    if args.model == "llama":
        return lambda kwargs: build(kwargs, args.hidden, args.layers)
    tokens = args.batch * max(args.seqs)
    if tokens >= args.experts:  # pigeonhole: fewer routed tokens than experts leaves experts idle on every rank
        raise SystemExit(f"--model moe needs fewer tokens per rank ({tokens}) than experts ({args.experts}), so that "
                         "experts idle on every rank and step")
    return lambda kwargs: build_moe(kwargs, args.hidden, args.layers, args.experts, max(args.seqs))


def _fu_false_error(make, wrap, ids, sync) -> str:
    """Two steps of the MoE model, non-reentrant, find_unused_parameters=False, without the library: the second
    forward raises on every rank (thousands of idle expert tensors in each of DDP's one or two buckets on every
    rank: no bucket became ready, so no rank issued a collective that its peer would wait for).
    Returns the error's first line ("" if it trained: then find_unused=False would be the best configuration)."""
    model = wrap(make({"use_reentrant": False}), find_unused_parameters=False)
    try:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            sync()
        return ""
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    finally:
        del model


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_patches
    from ddp_patches.offload import offloader as offload

    from benchmarks._common import leave_group, peak_bytes

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # every rank on the one GPU: gloo copies CUDA tensors through the host
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    place = (lambda m: m.to("cuda")) if cuda else (lambda m: m)
    ddp_kw = {"device_ids": [0]} if cuda else {}
    wrap = (lambda m, **kw: DDP(place(m), **ddp_kw, **kw)) if world > 1 else (lambda m, **kw: place(m))
    make = _builder(args)
    extra = {}  # keys only the non-default options add to a rank's row
    if args.model == "moe" and world > 1:
        ids = torch.randint(2, 512, (args.batch, max(args.seqs)), generator=torch.Generator().manual_seed(rank))
        extra["fu_false_error"] = _fu_false_error(make, wrap, ids.to(args.device), sync)

    # The best working unpatched configuration: find_unused=False for the Llama (every parameter is used),
    # find_unused=True for the MoE (experts idle; see the module docstring).
    models = {"unpatched": wrap(make({"use_reentrant": False}), find_unused_parameters=args.model == "moe")}
    ddp_patches.apply()
    models["patched"] = wrap(make({"use_reentrant": True}))
    models["patched-fu-true"] = wrap(make({"use_reentrant": True}), find_unused_parameters=True)
    optims = {k: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-3) for k, m in models.items()}
    if args.model != "llama" or cuda or args.hook_steps:
        extra["trainable_tensors"] = len(optims["patched"].param_groups[0]["params"])
    if args.model == "moe":
        # Three MoE models of 64k modules hold 3.4M Python objects: a full collection takes about 1.4 s here and
        # lands in whichever step allocates when it is due (measured: 2.6 s steps). Freezing what the build made
        # keeps those pauses out of every configuration alike; the steps' own garbage is still collected.
        gc.collect()
        gc.freeze()
        extra["gc_frozen"] = True

    def step(name, ids):
        ctx = offload.use_offloader(None) if name == "unpatched" else _null()
        with ctx:
            models[name](input_ids=ids, labels=ids).loss.backward()
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)

    rows = []
    for seq in args.seqs:
        g = torch.Generator().manual_seed(1000 + rank)
        ids = torch.randint(2 if args.model == "moe" else 0, 512, (args.batch, seq), generator=g).to(args.device)
        times = {k: [] for k in CONFIGS}
        for i in range(args.warmup + args.rounds):
            order = CONFIGS if i % 2 == 0 else tuple(reversed(CONFIGS))  # neither goes first every time
            for name in order:
                sync()
                start = time.perf_counter()
                step(name, ids)
                sync()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        peaks = {name: peak_bytes(lambda name=name: step(name, ids)) for name in CONFIGS} if args.memory else {}
        row = {"seq": seq, "world": world, "median_s": {k: statistics.median(v) for k, v in times.items()},
               "all_s": times, "peak_bytes": peaks, **extra}
        if args.hook_steps:
            row["hooks"] = {name: time_hooks(models[name], lambda name=name: step(name, ids), args.hook_steps, sync)
                            for name in ("patched", "patched-fu-true")}
            row["post_hook_dispatch_us"] = post_hook_dispatch_us(row["trainable_tensors"], args.device)
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        rows.append(gathered)
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    ddp_patches.revert()
    models.clear()
    optims.clear()
    leave_group()


# -- the library's per-parameter hooks, timed on their own ------------------------------------------------------
HOOK_KEYS = ("post_hooks", "backward_start", "reducer_marking", "settle", "reset_unused", "forward_hooks",
             "trainable_guard", "guard_post_accumulate", "guard_step", "guard_forward", "other_forward_hooks")
# Timed, but shown apart from the library's Python time: DDP's own finalize
# (NOTE [DDP's finalize inside the settle]), and the settle's one all-reduce of a float per parameter, most of which
# is waiting for the slower rank (a wait that, without it, the next collective would take).
APART_KEYS = ("ddp_finalize_in_settle", "settle_all_reduce")


# NOTE [DDP's finalize inside the settle]
# The settle's nested backward fires the idle parameters' DDP hooks; the one that completes the last bucket makes the
# reducer launch its all-reduce and queue ``finalize_backward`` in the graph task that is running: the nested one.
# So DDP's finalize (waiting for the peer's all-reduce, copying the averages into the gradients) runs inside
# ``_settle``; without the library it runs at the end of the outer backward and is part of no hook. To keep it apart,
# ``_FireHooks.backward`` (the nested task's first node, before any of those DDP hooks) queues a final callback that
# notes the time; the finalize, queued later, runs after it, and what the settle spends from that mark on is DDP's.
# Test: tests/test_benchmarks.py::test_ddp_overhead_many_tensors_quick_keeps_earlier_rows_and_times_the_hooks
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §21


class _HookTimers:
    """Exclusive wall time and calls per hook key: a hook that runs inside another (the post-hooks that
    ``_settle``'s nested backward fires) counts for itself only, not for its caller too."""

    def __init__(self) -> None:
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()
        self._local = threading.local()  # on CUDA the backward (and its hooks) runs on the device's thread

    def wrap(self, key: str, fn):
        def timed(*args, **kwargs):
            stack = self._local.__dict__.setdefault("stack", [0.0])
            stack.append(0.0)  # time spent in wrapped hooks this call runs
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[key] += elapsed - stack.pop()
                self.calls[key] += 1
                stack[-1] += elapsed

        return timed

    def take(self) -> dict:
        out = {"us": {k: self.seconds[k] * 1e6 for k in HOOK_KEYS}, "calls": {k: self.calls[k] for k in HOOK_KEYS},
               "apart_us": {k: self.seconds[k] * 1e6 for k in APART_KEYS}}
        self.seconds.clear()
        self.calls.clear()
        return out


class _TimedHooks:
    """Wraps the library's hooks with ``_HookTimers`` for a few steps and puts the originals back: what is looked up
    at call time (``reach``'s AccumulateGrad post-hooks, its settle and the settle's callback; the guard's
    post-accumulate-grad hooks and its optimizer-step check), and the forward hooks the library registered on
    ``ddp`` (``reach``'s, the trainable-set guard's, the guard's forward counter), whatever their form."""

    def __init__(self, ddp, timers: _HookTimers) -> None:
        import torch.distributed as dist
        from ddp_patches.guard import steps as guard_steps, unsynced as guard
        from ddp_patches.rescue import counts, edges as reach

        self._class_attrs = [(reach._Recorder, "__call__", "post_hooks"),
                             (reach.UnusedParameterEdges, "backward_started", "backward_start"),
                             (reach.UnusedParameterEdges, "_settle", "settle"),
                             # inside backward_start and settle: the reducer's own hook for each idle parameter
                             (reach.UnusedParameterEdges, "_fire", "reducer_marking"),
                             (counts.CountAllReduce, "_reset_unused_everywhere", "reset_unused"),
                             (guard._Written, "__call__", "guard_post_accumulate"),
                             (guard_steps, "_check_step", "guard_step"),  # a module global, looked up by _pre_step
                             # looked up on the module by _reset_unused_everywhere; nothing else in a step calls it
                             (dist, "all_reduce", "settle_all_reduce")]
        self._forward = (getattr(ddp, "_forward_pre_hooks", {}), getattr(ddp, "_forward_hooks", {}))
        self._timers, self._saved = timers, []

    def _split_ddp_finalize(self) -> None:
        """NOTE [DDP's finalize inside the settle]."""
        import torch
        from ddp_patches.rescue import edges as reach

        timers, mark = self._timers, {}
        fire = getattr(reach, "_FireHooks", None)
        fire_backward = fire.__dict__.get("backward") if fire is not None else None
        timed_settle = reach.UnusedParameterEdges.__dict__.get("_settle")
        if fire_backward is None or timed_settle is None:
            return  # no nested backward in the settle: nothing of DDP's runs inside it

        def backward(ctx, grad):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: mark.update(t=time.perf_counter()))
            return fire_backward.__func__(ctx, grad)

        def settle(edges, ddp):
            mark.clear()
            try:
                return timed_settle(edges, ddp)
            finally:  # the settle's timer has closed: move the part from the mark on to DDP's key
                if "t" in mark:
                    split = time.perf_counter() - mark["t"]
                    timers.seconds["settle"] -= split
                    timers.seconds["ddp_finalize_in_settle"] += split

        for owner, name, new in ((reach._FireHooks, "backward", staticmethod(backward)),
                                 (reach.UnusedParameterEdges, "_settle", settle)):
            self._saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, new)

    @staticmethod
    def _key(hook) -> str | None:
        from ddp_patches.guard import unsynced as guard
        from ddp_patches.rescue import edges as reach, trainable_set

        owner = getattr(hook, "__self__", hook)
        if isinstance(owner, reach.UnusedParameterEdges):
            return "forward_hooks"
        if isinstance(owner, trainable_set.TrainableGuard):
            return "trainable_guard"
        if isinstance(owner, guard._Counter):
            return "guard_forward"
        module = getattr(owner, "__module__", None) or type(owner).__module__
        return "other_forward_hooks" if module.startswith("ddp_patches") else None

    def __enter__(self):
        for owner, name, key in self._class_attrs:
            original = owner.__dict__.get(name)
            if original is None:  # the library changed its structure: that hook reads 0 (its calls show it)
                continue
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timers.wrap(key, original))
        self._split_ddp_finalize()
        for hooks in self._forward:
            for hid, hook in list(hooks.items()):
                key = self._key(hook)
                if key is not None:
                    self._saved.append((hooks, hid, hook))
                    hooks[hid] = self._timers.wrap(key, hook)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            if isinstance(owner, dict):
                owner[name] = original
            else:
                setattr(owner, name, original)
        self._saved.clear()
        return False


def time_hooks(ddp, step, steps: int, sync) -> dict:
    """``steps`` steps with the hooks timed (their own step times are inflated by the timers: not compared).
    Per step: exclusive microseconds and calls per hook key, parameters the settle fired, the step's time."""
    from ddp_patches.rescue import edges as reach

    timers, per_step = _HookTimers(), []
    edges = reach.for_ddp(ddp) if hasattr(ddp, "module") else None
    collecting = {"start": 0.0, "s": 0.0}  # garbage-collection pauses in the step: not the library's, shown apart

    def on_gc(phase, info):
        if phase == "start":
            collecting["start"] = time.perf_counter()
        else:
            collecting["s"] += time.perf_counter() - collecting["start"]

    gc.callbacks.append(on_gc)
    try:
        with _TimedHooks(ddp, timers):
            for _ in range(steps):
                collecting["s"] = 0.0
                sync()
                start = time.perf_counter()
                step()
                sync()
                took = time.perf_counter() - start
                per_step.append({**timers.take(), "step_s": took, "gc_us": collecting["s"] * 1e6,
                                 "settle_fired": edges.attached_last if edges is not None else 0})
    finally:
        gc.callbacks.remove(on_gc)
    return {"per_step": per_step,
            "median_us": {k: statistics.median(s["us"][k] for s in per_step) for k in HOOK_KEYS},
            "apart_median_us": {k: statistics.median(s["apart_us"][k] for s in per_step) for k in APART_KEYS},
            "calls": per_step[-1]["calls"], "settle_fired": per_step[-1]["settle_fired"]}


class _NoopPostHook:
    __slots__ = ()

    def __call__(self, grad_inputs, grad_outputs) -> None:
        return None


def post_hook_dispatch_us(n: int, device: str, reps: int = 9) -> float:
    """What the autograd engine spends calling one Python AccumulateGrad post-hook, beyond the hook's body (which
    ``_HookTimers`` measures): backward over ``n`` leaves (at least 5,000, for a stable difference) with a no-op
    post-hook on each, minus without, per hook. Median of ``reps`` interleaved pairs."""
    import torch
    from torch.autograd.graph import get_gradient_edge

    n = max(n, 5000)
    sets = {hooked: [torch.zeros(4, device=device, requires_grad=True) for _ in range(n)] for hooked in (0, 1)}
    nodes = [get_gradient_edge(t).node for t in sets[1]]  # held: a leaf keeps its AccumulateGrad node weakly
    handles = [node.register_hook(_NoopPostHook()) for node in nodes]
    diffs = []
    for _ in range(reps):
        took = {}
        for hooked, leaves in sets.items():
            loss = torch.stack([t.sum() for t in leaves]).sum()
            start = time.perf_counter()
            loss.backward()
            if device == "cuda":
                torch.cuda.synchronize()
            took[hooked] = time.perf_counter() - start
            for t in leaves:
                t.grad = None
        diffs.append(took[1] - took[0])
    for handle in handles:
        handle.remove()
    return statistics.median(diffs) / n * 1e6


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker-out", required=True)
    p.add_argument("--seqs", type=int, nargs="+", default=[256])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--model", choices=("llama", "moe"), default="llama")
    p.add_argument("--experts", type=int, default=320, help="--model moe: experts per block")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--hook-steps", type=int, default=0)
    worker(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
