"""DDP step overhead of the patches: patched vs the best working unpatched configuration, on 2 CPU ranks.

    python benchmarks/ddp_overhead.py            # Llama-shaped, hidden 256, 4 layers, LoRA r=8, batch 4 x 256
    python benchmarks/ddp_overhead.py --quick
    python benchmarks/ddp_overhead.py --config many-tensors              # 10,336 trainable tensors, idle experts
    python benchmarks/ddp_overhead.py --config many-tensors --device cuda  # both ranks on cuda:0, over gloo

Three DDP models on each rank, stepped in interleaved rounds (see benchmarks/_llm_steps.py): "unpatched"
(non-reentrant checkpointing, find_unused=False), "patched" (apply(), reentrant kwargs, DDP's defaults kept)
and "patched-fu-true" (apply() with find_unused=True, as the Trainer passes for a PeftModel). Reports the median
step-time ratios patched / unpatched (target <= 1.03x) and patched-fu-true / patched (the cost of DDP's search
for unused parameters, which an earlier design forced on every run).
Writes benchmarks/results/ddp_overhead.json and .png.

``--config many-tensors``: what the library's per-parameter hooks cost at scale. A tiny Switch Transformers MoE
(4 encoder + 4 decoder blocks, all sparse, 320 experts each, hidden 32) with LoRA r=4 on every expert's two
``nn.Linear`` and on attention: 10,336 trainable tensors, each hooked by the library (rescue/edges.py's AccumulateGrad
post-hook, the guard's post-accumulate-grad hook) and reduced by DDP. Each rank routes 64 tokens per block to 320
experts, so most experts idle on every rank and step (about 8,700 of the 10,336 tensors get no gradient).
"Best working unpatched" is then non-reentrant checkpointing with find_unused_parameters=True:
  * find_unused_parameters=False raises "Expected to have finished reduction in the prior iteration" at the
    second forward (an idle expert fires no hook); the worker checks this in every run (``fu_false_error``);
  * static_graph=True fixes the set of unused parameters at the first step, while the idle experts change from
    step to step (the ranks drift apart silently: NOTE [Static graph needs a defined zero] in rescue/edges.py);
  * reentrant checkpointing fails under DDP without the library ("marked as ready twice":
    NOTE [Why non-reentrant] in checkpointing.py);
  * with find_unused=True DDP finds the idle experts itself: one graph search per forward and an all-reduce of
    its used-parameter map per step, in C++.
"patched" keeps DDP's defaults (find_unused=False) and relies on the library's rescue (rescue/edges.py: a post-hook per
parameter, the settle that fires the idle ones' hooks at the end of backward, and one all-reduce of a float per
parameter); "patched-fu-true" is find_unused=True under apply() (reach steps aside there; the trainable-set guard
and the guard stay). Besides the step times, a few extra steps of each patched model time the library's hooks on
their own (``_HookTimers`` in _llm_steps.py: exclusive microseconds per hook per step), and a microbenchmark gives
what the autograd engine spends calling one Python post-hook beyond its body. Reported as microseconds per step
and as a fraction of the patched step. Not counted as the library's: DDP's own finalize (waiting for the peer,
copying the averages into the gradients), which runs inside the settle's nested backward
(NOTE [DDP's finalize inside the settle] in _llm_steps.py), the settle's one all-reduce (mostly a wait for the
slower rank, which the next collective would otherwise take), and garbage-collection pauses; they are reported
apart. The MoE workers freeze the objects of the model build (``gc.freeze()``): three models of 64k modules each
make a full collection take about 1.4 s, which otherwise lands in a random step of a random configuration. The
figures go into the JSON report under ``configs`` (with ``"many-tensors on cpu"`` etc. as keys), next to the Llama
figures of an earlier default run, which are kept.

``--device cuda``: both ranks on cuda:0 over gloo (it all-reduces CUDA tensors through host copies), the same
comparison; every step waits for the device. Needs a CUDA GPU; refuses with a clear error otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._common import RESULTS, finish, launch_ranks, new_figure, save_figure  # noqa: E402

NAME = "ddp_overhead"
TARGET = 1.03
STEPS = os.path.join(ROOT, "benchmarks", "_llm_steps.py")
CONFIG_CHOICES = ("llama", "many-tensors")
DEVICES = ("cpu", "cuda")
# The Llama figures of the default run: the report's top level (docs/benchmarks.md table); the other configurations
# go under report["configs"].
LLAMA_KEYS = ("setup", "targets", "median_step_s", "per_round_s", "patched_over_unpatched", "find_unused_cost",
              "misses")
# --config many-tensors: worker arguments, full size and --quick (a plumbing check: far fewer tensors).
MANY_TENSORS = {False: {"experts": 320, "hidden": 32, "layers": 4, "batch": 2, "seq": 32, "hook_steps": 6},
                True: {"experts": 24, "hidden": 32, "layers": 1, "batch": 2, "seq": 8, "hook_steps": 2}}
HOOK_LABELS = {"post_hooks": "AccumulateGrad post-hooks (reach _Recorder), body",
               "post_hook_dispatch": "  the same, engine -> Python call (measured apart)",
               "backward_start": "backward start (_BackwardStart -> backward_started)",
               "reducer_marking": "  the reducer marking the idle parameters ready (_fire)",
               "settle": "settle (_settle: fires the idle parameters' hooks)",
               "reset_unused": "settle's all-reduce and reset (_reset_unused_everywhere)",
               "forward_hooks": "reach forward hooks (_begin, _attach)",
               "trainable_guard": "trainable-set guard (trainable_set.TrainableGuard)",
               "guard_post_accumulate": "guard post-accumulate-grad hooks (guard._Written)",
               "guard_step": "guard optimizer-step check (guard._check_step)",
               "guard_forward": "guard forward counter (guard._Counter)",
               "other_forward_hooks": "other library forward hooks"}


def run(quick: bool = False, *, seq: int = 256, rounds: int | None = None, config: str = "llama",
        device: str = "cpu", carry_from: str | None = os.path.join(RESULTS, f"{NAME}.json")) -> dict:
    """Measure ``config`` on ``device``; sections of ``carry_from`` (an earlier report) that this run does not
    measure are kept, marked ``carried``, so the docs/benchmarks.md rows of every configuration survive a run of
    one."""
    if device == "cuda":
        _require_cuda()
    if config == "llama" and device == "cpu":
        report = _run_llama(quick, seq=seq, rounds=rounds)
    else:
        report = {"benchmark": NAME, "configs": {_key(config, device): _run_config(config, device, quick, seq=seq,
                                                                                    rounds=rounds)}}
    return _carry(report, carry_from)


def _run_llama(quick: bool, *, seq: int, rounds: int | None) -> dict:
    rounds = rounds or (6 if quick else 20)
    ranks = launch_ranks(STEPS, 2, ["--seqs", str(seq), "--rounds", str(rounds)])[0]
    # Per round, a rank's step time; the slower rank sets the pace, so compare the ranks' per-round maxima.
    per_round = {k: [max(r["all_s"][k][i] for r in ranks) for i in range(rounds)] for k in ranks[0]["all_s"]}
    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratio = med["patched"] / med["unpatched"]
    fu_cost = med["patched-fu-true"] / med["patched"]
    return {
        "benchmark": NAME,
        "setup": {"model": "llama hidden 256, 4 layers, LoRA r=8, checkpointing", "batch": 4, "seq": seq,
                  "ranks": 2, "backend": "gloo", "threads_per_rank": 1, "rounds": rounds},
        "targets": {"patched_over_unpatched_max": TARGET},
        "median_step_s": med,
        "per_round_s": per_round,
        "patched_over_unpatched": ratio,
        "find_unused_cost": fu_cost,
        "misses": [f"patched/unpatched {ratio:.3f}x > {TARGET}x"] if ratio > TARGET else [],
    }


def _key(config: str, device: str) -> str:
    return f"{config} on {device}"


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("ddp_overhead --device cuda needs a CUDA GPU (torch.cuda.is_available() is False here); "
                         "run without --device for the CPU figures")


def _worker_args(config: str, device: str, quick: bool, seq: int, rounds: int) -> tuple[list[str], dict]:
    """The worker's arguments and the setup they describe."""
    common = ["--rounds", str(rounds), "--device", device]
    if config == "llama":
        hook_steps = 2 if quick else 6
        setup = {"model": "llama hidden 256, 4 layers, LoRA r=8, checkpointing", "batch": 4, "seq": seq,
                 "best_unpatched": "non-reentrant checkpointing, find_unused_parameters=False"}
        return ["--seqs", str(seq), "--hook-steps", str(hook_steps), *common], setup
    size = MANY_TENSORS[quick]
    setup = {"model": (f"switch-transformers MoE, {size['layers']} encoder + {size['layers']} decoder blocks, all "
                       f"sparse, {size['experts']} experts each, hidden {size['hidden']}; LoRA r=4 on every expert's "
                       "wi/wo and on attention q/k/v/o; checkpointing"),
             "experts": size["experts"], "batch": size["batch"], "seq": size["seq"],
             "best_unpatched": "non-reentrant checkpointing, find_unused_parameters=True (experts idle)"}
    args = ["--model", "moe", "--experts", str(size["experts"]), "--hidden", str(size["hidden"]),
            "--layers", str(size["layers"]), "--batch", str(size["batch"]), "--seqs", str(size["seq"]),
            "--hook-steps", str(size["hook_steps"]), *common]
    return args, setup


def _run_config(config: str, device: str, quick: bool, *, seq: int, rounds: int | None) -> dict:
    rounds = rounds or (4 if quick else 20)
    args, setup = _worker_args(config, device, quick, seq, rounds)
    ranks = launch_ranks(STEPS, 2, args, cuda=device == "cuda")[0]
    per_round = {k: [max(r["all_s"][k][i] for r in ranks) for i in range(rounds)] for k in ranks[0]["all_s"]}
    med = {k: statistics.median(v) for k, v in per_round.items()}
    ratio = med["patched"] / med["unpatched"]
    round_ratios = sorted(p / u for p, u in zip(per_round["patched"], per_round["unpatched"]))
    hooks = {name: _hooks(ranks, name, med[name]) for name in ("patched", "patched-fu-true")}
    misses = [f"patched/unpatched {ratio:.3f}x > {TARGET}x"] if ratio > TARGET else []
    if hooks["patched"]["fraction_of_step"] > TARGET - 1:
        misses.append(f"library hooks {hooks['patched']['fraction_of_step']:.1%} of the patched step > "
                      f"{TARGET - 1:.0%}")
    return {
        "config": config, "device": device, "date": time.strftime("%Y-%m-%d"),
        "setup": {**setup, "ranks": 2, "backend": "gloo", "threads_per_rank": 1, "rounds": rounds,
                  "gc_frozen_after_build": bool(ranks[0].get("gc_frozen"))},
        "trainable_tensors": ranks[0]["trainable_tensors"],
        "fu_false_error": ranks[0].get("fu_false_error"),
        "targets": {"patched_over_unpatched_max": TARGET, "hooks_fraction_of_step_max": TARGET - 1},
        "median_step_s": med,
        "per_round_s": per_round,
        "patched_over_unpatched": ratio,
        "round_ratio_quartiles": statistics.quantiles(round_ratios, n=4) if len(round_ratios) > 1 else round_ratios,
        "patched_fu_true_over_unpatched": med["patched-fu-true"] / med["unpatched"],
        "hooks": hooks,
        "misses": misses,
    }


def _hooks(ranks: list[dict], name: str, step_s: float) -> dict:
    """The ranks' median microseconds per step for each hook, averaged over the ranks, plus the engine's cost of
    calling the post-hooks (calls x the per-call dispatch measured apart); as a fraction of the median step."""
    per_rank = [r["hooks"][name] for r in ranks]
    keys = list(per_rank[0]["median_us"])
    us = {k: statistics.mean(h["median_us"][k] for h in per_rank) for k in keys}
    dispatch_per_call = statistics.mean(r["post_hook_dispatch_us"] for r in ranks)
    us["post_hook_dispatch"] = per_rank[0]["calls"]["post_hooks"] * dispatch_per_call
    total = sum(us.values())
    gc_us = statistics.mean(statistics.median(s["gc_us"] for s in h["per_step"]) for h in per_rank)
    apart = {k: statistics.mean(h["apart_median_us"][k] for h in per_rank) for k in per_rank[0]["apart_median_us"]}
    # Counted in the total: the reducer's own hook for each idle parameter, the marking DDP's find_unused=True does
    # in C++ for the same parameters; shown apart so that the library's own Python time can be read beside it.
    own = total - us.get("reducer_marking", 0.0)
    return {"us_per_step": us, "total_us": total, "fraction_of_step": total / (step_s * 1e6),
            "own_fraction_of_step": own / (step_s * 1e6),
            "apart_us_per_step": apart,
            "calls_per_step": per_rank[0]["calls"], "settle_fired": [h["settle_fired"] for h in per_rank],
            "post_hook_dispatch_us_per_call": dispatch_per_call, "gc_us_per_step": gc_us,
            "timed_steps": len(per_rank[0]["per_step"])}


def _carry(report: dict, carry_from: str | None) -> dict:
    if not carry_from or not os.path.exists(carry_from):
        return report
    try:
        with open(carry_from) as f:
            earlier = json.load(f)
    except (OSError, ValueError):
        return report
    if "median_step_s" not in report and "median_step_s" in earlier:
        report.update({k: earlier[k] for k in LLAMA_KEYS if k in earlier}, carried_llama=True)
        if "date" in earlier:
            report["date"] = earlier["date"]
    configs = report.setdefault("configs", {})
    for key, section in earlier.get("configs", {}).items():
        configs.setdefault(key, {**section, "carried": True})
    if not configs:
        del report["configs"]
    return report


def print_table(report: dict) -> None:
    if "median_step_s" in report and not report.get("carried_llama"):
        for name, s in report["median_step_s"].items():
            print(f"{name:18} median step {s * 1000:8.1f} ms")
        flag = "  <- " + "; ".join(report["misses"]) if report["misses"] else ""
        print(f"patched / unpatched: {report['patched_over_unpatched']:.3f}x (target <= {TARGET}x){flag}")
        print(f"cost of find_unused=True (patched-fu-true / patched with DDP defaults): "
              f"{report['find_unused_cost']:.3f}x")
    for key, section in report.get("configs", {}).items():
        if not section.get("carried"):
            _print_section(key, section)


def _print_section(key: str, section: dict) -> None:
    print(f"{key}: {section['trainable_tensors']:,} trainable tensors; best working unpatched: "
          f"{section['setup']['best_unpatched']}")
    if section.get("fu_false_error"):
        print(f"  find_unused=False without the library: {section['fu_false_error'][:90]}...")
    for name, s in section["median_step_s"].items():
        print(f"  {name:18} median step {s * 1000:8.1f} ms")
    q = section["round_ratio_quartiles"]
    flag = "  <- " + "; ".join(section["misses"]) if section["misses"] else ""
    print(f"  patched / unpatched: {section['patched_over_unpatched']:.3f}x (per-round quartiles "
          f"{q[0]:.3f}..{q[-1]:.3f}; target <= {TARGET}x){flag}")
    print(f"  patched-fu-true / unpatched: {section['patched_fu_true_over_unpatched']:.3f}x")
    for name, hooks in section["hooks"].items():
        print(f"  library hooks in a '{name}' step: {hooks['total_us'] / 1000:.1f} ms = "
              f"{hooks['fraction_of_step']:.1%} of its median step (settle fired {hooks['settle_fired']} per rank; "
              f"not counted: DDP's finalize inside the settle "
              f"{hooks['apart_us_per_step']['ddp_finalize_in_settle'] / 1000:.1f} ms, the settle's all-reduce with "
              f"its wait for the peer {hooks['apart_us_per_step']['settle_all_reduce'] / 1000:.1f} ms, gc pauses "
              f"{hooks['gc_us_per_step'] / 1000:.1f} ms)")
        print(f"  of which the reducer marking idle parameters ready: "
              f"{hooks['us_per_step'].get('reducer_marking', 0.0) / 1000:.1f} ms; the rest, the library's own: "
              f"{hooks['own_fraction_of_step']:.1%} of the step")
        for k, us in sorted(hooks["us_per_step"].items(), key=lambda kv: -kv[1]):
            if us >= 1.0:
                calls = hooks["calls_per_step"].get(k)
                print(f"    {HOOK_LABELS.get(k, k):60} {us:10.0f} us" + (f"  ({calls} calls)" if calls else ""))


def plot(report: dict, path: str) -> str:
    if "median_step_s" in report:
        _plot_llama(report, path)
    for key, section in report.get("configs", {}).items():
        _plot_section(key, section, path.replace(".png", "_" + key.replace(" on ", "_") + ".png"))
    return path


def _plot_llama(report: dict, path: str) -> str:
    fig, (left, right) = new_figure(2, 10)
    names = list(report["per_round_s"])
    left.boxplot([[s * 1000 for s in report["per_round_s"][n]] for n in names])
    left.set_xticks(range(1, len(names) + 1), names)
    left.set_ylabel("step time, ms (per round, slower rank)")
    ratios = {"patched / unpatched": report["patched_over_unpatched"],
              "find_unused cost": report["find_unused_cost"]}
    right.bar(list(ratios), list(ratios.values()), color=["tab:blue", "tab:orange"])
    right.axhline(TARGET, linestyle="--", color="grey", label=f"target {TARGET}")
    right.set_ylim(0.9, max(1.1, max(ratios.values()) + 0.02))
    right.set_ylabel("median ratio")
    right.legend()
    return save_figure(fig, (left, right), "DDP step overhead (CPU, 2 ranks, LoRA + checkpointing)", path)


def _plot_section(key: str, section: dict, path: str) -> str:
    fig, (left, right) = new_figure(2, 12)
    names = list(section["per_round_s"])
    left.boxplot([[s * 1000 for s in section["per_round_s"][n]] for n in names])
    left.set_xticks(range(1, len(names) + 1), names)
    left.set_ylabel("step time, ms (per round, slower rank)")
    us = section["hooks"]["patched"]["us_per_step"]
    shown = [k for k in sorted(us, key=lambda k: -us[k]) if us[k] >= 1.0]
    right.barh([k.replace("_", " ") for k in shown], [us[k] / 1000 for k in shown], color="tab:blue")
    right.invert_yaxis()
    right.set_xlabel(f"ms per 'patched' step (median step {section['median_step_s']['patched'] * 1000:.0f} ms)")
    title = (f"DDP step, {section['trainable_tensors']:,} trainable tensors ({key}, 2 ranks): patched / unpatched "
             f"{section['patched_over_unpatched']:.3f}x; library hooks "
             f"{section['hooks']['patched']['fraction_of_step']:.1%} of the step")
    return save_figure(fig, (left, right), title, path)


def summarize(report: dict) -> list[str]:
    rows = []
    if "median_step_s" in report:
        status = "missed" if report["misses"] else "met"
        rows += [f"| DDP step, patched / best unpatched (CPU, 2 ranks) | {report['patched_over_unpatched']:.3f}x | "
                 f"<= {TARGET}x | {status} |",
                 f"| find_unused=True / DDP defaults, both patched (what an earlier design forced) | "
                 f"{report['find_unused_cost']:.3f}x | "
                 "(cost shown) | — |"]
    for key, section in report.get("configs", {}).items():
        rows += _summarize_section(section)
    return rows


def _summarize_section(section: dict) -> list[str]:
    n, device = section["trainable_tensors"], section["device"].upper() if section["device"] == "cpu" else "GPU"
    ratio, hooks = section["patched_over_unpatched"], section["hooks"]["patched"]
    ratio_status = "missed" if ratio > TARGET else "met"
    hook_status = "missed" if hooks["fraction_of_step"] > TARGET - 1 else "met"
    top = max(hooks["us_per_step"], key=hooks["us_per_step"].get)
    what, best = (("MoE, LoRA on every expert, experts idle", "find_unused=True") if section["config"] == "many-tensors"
                  else ("Llama, LoRA", "find_unused=False"))
    return [f"| DDP step at {n:,} trainable tensors ({what}), patched / best unpatched ({best}) ({device}, 2 ranks) | "
            f"{ratio:.3f}x | <= {TARGET}x | {ratio_status} |",
            f"| the library's per-parameter hooks in that step ({n:,} tensors, {device}) | "
            f"{hooks['total_us'] / 1000:.1f} ms/step, {hooks['fraction_of_step']:.1%} of the step (largest: "
            f"{top.replace('_', ' ')} {hooks['us_per_step'][top] / 1000:.1f} ms{_marking(hooks)}) | "
            f"<= {TARGET - 1:.0%} | {hook_status} |"]


def _marking(hooks: dict) -> str:
    """The reducer's share of the hooks' time, where the result has it (measured since it was timed apart)."""
    marking = hooks["us_per_step"].get("reducer_marking")
    if not marking or "own_fraction_of_step" not in hooks:
        return ""
    return (f"; of the total, the reducer marking idle parameters ready, as find_unused=True does in C++: "
            f"{marking / 1000:.1f} ms; the library's own Python: {hooks['own_fraction_of_step']:.1%}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int)
    p.add_argument("--config", choices=CONFIG_CHOICES, default="llama",
                   help="llama (default; the first rows of docs/benchmarks.md) or many-tensors (10,336 trainable "
                        "tensors)")
    p.add_argument("--many-tensors", dest="config", action="store_const", const="many-tensors",
                   help="same as --config many-tensors")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cuda: both ranks on cuda:0 over gloo (needs a GPU)")
    p.add_argument("--out-dir")
    args = p.parse_args(argv)
    out_dir = args.out_dir or RESULTS
    report = run(args.quick, seq=args.seq, rounds=args.rounds, config=args.config, device=args.device,
                 carry_from=os.path.join(out_dir, f"{NAME}.json"))
    finish(sys.modules[__name__], report, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
