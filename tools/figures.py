"""``python -m tools.figures``: one source per figure. Renders the README's short benchmarks table and, under each
generated figure block of docs/benchmarks.md, a line naming the commit each result was measured at, both from
the result files alone, with "stale since <commit>" where a result's sources changed after it was measured
(benchmarks/provenance.py); the benchmarks table's rows carry the same mark (``python -m benchmarks --readme-only``).

    python -m tools.figures              # rewrite the README block, the provenance lines and the benchmarks table
    python -m tools.figures --check      # exit 1, naming each block that differs from its rendering
    python -m tools.figures stamp FILE   # record the commit and source hashes in a result written by hand
    python -m tools.figures backfill     # results without provenance: the commit that last wrote them (git log)
    python -m tools.figures measure-chunked-loss   # the chunked loss's bytes (meta device, seconds), then render
    python -m tools.figures rehash       # each result's hashes again, at its recorded commit (the hashing changed)
"""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import provenance  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
README = os.path.join(ROOT, "README.md")
_R, _D = "benchmarks/results/", "docs/data/"
BENCHMARK_RESULTS = [f"{_R}{n}.json" for n in ("ddp_overhead", "tiled_mlp", "tiled_layer", "scaling", "offload",
                                               "max_seq", "guard")]
# block -> (page, the result files its figures come from)
BLOCKS: dict[str, tuple[str, list[str]]] = {
    "benchmarks": (PAGE, BENCHMARK_RESULTS),
    "max-seq-simulated": (PAGE, [f"{_D}plan-llama-3.1-8b-80gib.json", f"{_D}plan-qwen2.5-vl-7b-text-80gib.json"]),
    "long-context": (PAGE, [f"{_D}plan-long-context.json"]),
    "chunked-loss": (PAGE, [f"{_D}chunked-loss-bytes.json"]),
    "gpu-proof": (PAGE, [f"{_D}gpu-proof.json"]),
    "readme-benchmarks": (README, [f"{_R}ddp_overhead.json", f"{_R}offload.json", f"{_R}tiled_mlp.json",
                                   f"{_D}plan-long-context.json", f"{_R}guard.json"]),
}
README_START, README_END = "<!-- readme-benchmarks:start -->", "<!-- readme-benchmarks:end -->"
CHUNKED_START, CHUNKED_END = "<!-- chunked-loss:start (python -m tools.figures measure-chunked-loss) -->", \
    "<!-- chunked-loss:end -->"
CHUNKED_TOKENS = (8192, 65536)


def _load(rel: str) -> dict:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return json.load(f)


def _cell(text: str, rel: str) -> str:
    mark = provenance.mark(rel)
    return f"{text} (**{mark}**)" if mark else text


def readme_block() -> str:
    """The README's short table, every figure read from a result file."""
    ddp, off, mlp = _load(f"{_R}ddp_overhead.json"), _load(f"{_R}offload.json"), _load(f"{_R}tiled_mlp.json")
    plans, guard = _load(f"{_D}plan-long-context.json")["results"]["LoRA r=16 80GiB"], _load(f"{_R}guard.json")
    many = next(iter(ddp.get("configs", {}).values()), None)
    longest = {r["setup"]: r["longest"] for r in plans["rows"]}
    k = lambda n: f"{n / 1000:.0f}K"  # noqa: E731
    best = longest["best unpatched (+ fused head)"]
    plain = longest["plain HF (checkpointing, unfused head)"]
    top = longest["patched + tiled attention"]
    pinned = next(r["pinned"] for r in plans["rows"] if r["setup"] == "patched + tiled attention")
    o, m = off["rows"][-1], mlp["rows"][-1]
    rows = [("DDP step time, patched / best configuration that works unpatched (CPU, 2 ranks)",
             f"{ddp['patched_over_unpatched']:.3f}x", f"{_R}ddp_overhead.json")]
    if many:
        rows.append((f"the same at {many['trainable_tensors']:,} trainable tensors (MoE, LoRA on every expert)",
                     f"{many['patched_over_unpatched']:.3f}x (target 1.03x: {'missed' if many['misses'] else 'met'})",
                     f"{_R}ddp_overhead.json"))
    rows += [
        (f"offload, Llama-8B-shaped layers at {o['seq'] // 1024}K tokens ({off['device']})",
         f"{o['moved_fraction']:.0%} of movable inputs moved, {o['removed_fraction']:.0%} of the expected "
         f"active-memory drop, {o['time_ratio']:.3f}x step time", f"{_R}offload.json"),
        (f"tiled MLP alone at {m['tokens'] // 1024}K tokens (CPU, 2 ranks)",
         f"{m['mem_ratio']:.1f}x less MLP memory, {m['time_ratio']:.2f}x time", f"{_R}tiled_mlp.json"),
        ("longest sequence, Llama-3.1-8B LoRA on one 80 GiB GPU (simulated)",
         f"{k(top)} tokens with `tiled_attention` too, given {pinned / 2**30:.0f} GiB of pinned host memory per GPU "
         f"({k(longest['patched + tiled attention, chunked loss (HF Trainer)'])} on the plain `Trainer` with "
         f"`chunked_loss`; {k(longest['patched (tiled MLP + offload + fused head)'])} without either) vs {k(best)} "
         f"best unpatched ({top / best:.1f}x) and {k(plain)} plain HF ({top / plain:.0f}x)",
         f"{_D}plan-long-context.json"),
        ("guard (hooks + replica check) per step", f"{guard['rows']['lora']['cost_ratio']:.3%} (LoRA)",
         f"{_R}guard.json"),
    ]
    lines = [README_START, "| what | measured |", "|---|---|"]
    lines += [f"| {what} | {_cell(figure, rel)} |" for what, figure, rel in rows]
    return "\n".join(lines + [README_END])


def measure_chunked_loss() -> None:
    """docs/data/chunked-loss-bytes.json: the loss path's bytes, unchunked and chunked (tools/chunked_loss_bytes)."""
    from tools import chunked_loss_bytes as clb

    rows = []
    for tokens in CHUNKED_TOKENS:
        row = {"tokens": tokens}
        for chunked in (False, True):
            mode = clb.measure(tokens, chunked)
            row["chunked" if chunked else "unchunked"] = {"peak": mode.peak, "largest": mode.largest}
        rows.append(row)
    path = os.path.join(ROOT, _D, "chunked-loss-bytes.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"shapes": {"hidden": clb.HIDDEN, "vocab": clb.VOCAB, "dtype": "bfloat16"}, "rows": rows}, f,
                  indent=1)
        f.write("\n")
    provenance.stamp(path)


def chunked_loss_block() -> str:
    data, g = _load(f"{_D}chunked-loss-bytes.json"), lambda n: f"{n / 2**30:.1f} GiB"
    lines = [CHUNKED_START, "", "| tokens | unchunked: peak / largest tensor | `chunked_loss=True`: peak / largest tensor |",
             "|---|---|---|"]
    lines += [f"| {r['tokens'] // 1024}K | {g(r['unchunked']['peak'])} / {g(r['unchunked']['largest'])} | "
              f"{g(r['chunked']['peak'])} / {g(r['chunked']['largest'])} |" for r in data["rows"]]
    return "\n".join(lines + ["", CHUNKED_END])


def provenance_line(name: str) -> str:
    """The line under a block: where each of its results was measured, and which are stale."""
    parts = []
    for rel in BLOCKS[name][1]:
        data, where = _load(rel), os.path.basename(rel)
        changed = provenance.changed(rel)
        commits = sorted({p.get("commit", "unknown")[:7] for p in provenance._records(data)})
        if changed:
            files = sorted({os.path.basename(f) for moved in changed.values() for f in moved})
            parts.append(f"`{where}` **stale since {next(iter(changed))}** ({', '.join(files)} changed)")
        else:
            parts.append(f"`{where}` {', '.join(commits)}")
    return f"Measured at: {'; '.join(parts)}. <!-- figures:{name} -->"


def _with_line(text: str, name: str) -> str:
    line = provenance_line(name)
    pattern = re.compile(rf"^.*<!-- figures:{re.escape(name)} -->$", re.M)
    if pattern.search(text):
        return pattern.sub(lambda _: line, text)
    end = f"<!-- {name}:end -->"
    return text.replace(end, f"{end}\n{line}", 1)


def rendered(path: str) -> str:
    """``path`` with its blocks as the results render them."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path == PAGE:
        from benchmarks.__main__ import END, START, readme_table

        head, rest = text.split(START, 1)
        text = head + START + "\n" + "\n".join(readme_table(os.path.join(ROOT, _R))) + "\n" + END + rest.split(END, 1)[1]
    if path == README:
        text = re.sub(re.escape(README_START) + ".*?" + re.escape(README_END), lambda _: readme_block(), text,
                      flags=re.S)
    if path == PAGE and CHUNKED_START in text:
        text = re.sub(re.escape(CHUNKED_START) + ".*?" + re.escape(CHUNKED_END), lambda _: chunked_loss_block(), text,
                      flags=re.S)
    for name, (page, _) in BLOCKS.items():
        if page == path and name != "readme-benchmarks":
            text = _with_line(text, name)
    return text


def drift() -> list[str]:
    """Pages whose figure blocks differ from what their results render."""
    out = []
    for path in (PAGE, README):
        with open(path, encoding="utf-8") as f:
            if f.read() != rendered(path):
                out.append(f"{os.path.relpath(path, ROOT)}: a figure block differs from its results "
                           "(run python -m tools.figures)")
    return out


def backfill() -> list[str]:
    """Stamp each result that has no provenance with the commit that last wrote it: its sources as there."""
    done = []
    for rel in provenance.SOURCES:
        if "provenance" not in _load(rel):
            commit = provenance._git("log", "-1", "--format=%H", "--", rel)
            provenance.stamp(os.path.join(ROOT, rel), commit=commit)
            done.append(f"{rel}: {commit[:10]}{' (stale)' if provenance.stale(rel) else ''}")
    return done


def rehash() -> list[str]:
    """Record each result's source hashes again, as its recorded commit has them (after a change to the hashing)."""
    done = []
    for rel in provenance.SOURCES:
        commit = _load(rel).get("provenance", {}).get("commit")
        if commit:
            provenance.stamp(os.path.join(ROOT, rel), commit=commit)
            done.append(f"{rel}: {commit}{' (stale)' if provenance.stale(rel) else ''}")
    return done


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        problems = drift()
        print("\n".join(problems) or "every figure block is its results rendered")
        return 1 if problems else 0
    if argv[:1] == ["stamp"]:
        unknown = [p for p in argv[1:] if os.path.relpath(os.path.abspath(p), ROOT) not in provenance.SOURCES]
        if unknown or not argv[1:]:
            print(f"tools.figures stamp: expected result files declared in benchmarks/provenance.py SOURCES; found "
                  f"{unknown or 'none'}; add the file and its sources there first", file=sys.stderr)
            return 2
        for p in argv[1:]:
            provenance.stamp(p)
        return 0
    if argv[:1] == ["measure-chunked-loss"]:
        measure_chunked_loss()
        argv = []
    elif argv[:1] == ["rehash"]:
        print("\n".join(rehash()))
        return 0
    elif argv[:1] == ["backfill"]:
        print("\n".join(backfill()) or "every result has its provenance")
        return 0
    if argv:
        print(f"tools.figures: expected no argument, --check, stamp FILE..., backfill, rehash or "
              "measure-chunked-loss; "
              f"found {argv}",
              file=sys.stderr)
        return 2
    for path in (PAGE, README):
        text = rendered(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    print("rendered the figure blocks of docs/benchmarks.md and README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
