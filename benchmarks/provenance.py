"""Where each figure comes from: every result file (benchmarks/results/*.json, the planner's and the GPU proof's
docs/data/*.json) records the commit it was measured at and a hash of each source file it measures (SOURCES: the
script plus the ddp_patches modules it exercises). A figure whose sources changed since is stale: the renderers
show it as "stale since <commit>" and tests/test_docs_figures.py fails where a page shows it otherwise.

    stamp(path)          record the current commit and source hashes in a result file (write_report does it)
    stale(path)          None, or the short commit after which the figure's sources changed
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package(name: str) -> list[str]:
    """Every module of a ddp_patches package (a figure depends on the whole room: a module added there counts)."""
    folder = os.path.join(ROOT, "ddp_patches", name)
    return sorted(f"ddp_patches/{name}/{f}" for f in os.listdir(folder) if f.endswith(".py"))


_OFFLOAD = _package("offload")
_RESCUE = [m for m in _package("rescue") if not m.endswith("/teardown.py")]
_GUARD = _package("guard")
_DDP_CORE = [*_RESCUE, "ddp_patches/checkpointing.py", *_GUARD, "ddp_patches/engines/__init__.py"]
_TILED_MLP = _package("tiled_mlp")
_CHUNKED_LOSS = _package("chunked_loss")
_PLANNER = [*_package("plan"), *_TILED_MLP, *_package("tiled_attention"),
            *_CHUNKED_LOSS]
# result file -> the sources its figures depend on (what is measured, not the harness that launches it)
SOURCES: dict[str, list[str]] = {
    "benchmarks/results/ddp_overhead.json": ["benchmarks/ddp_overhead.py", "benchmarks/_llm_steps.py", *_DDP_CORE],
    "benchmarks/results/guard.json": ["benchmarks/guard.py", "benchmarks/_llm_steps.py", *_GUARD],
    "benchmarks/results/max_seq.json": ["benchmarks/max_seq.py", *_TILED_MLP,
                                        "ddp_patches/checkpointing.py", *_OFFLOAD],
    "benchmarks/results/offload.json": ["benchmarks/offload.py", "ddp_patches/checkpointing.py", *_OFFLOAD],
    "benchmarks/results/scaling.json": ["benchmarks/scaling.py", "benchmarks/_llm_steps.py", *_DDP_CORE],
    "benchmarks/results/tiled_layer.json": ["benchmarks/tiled_layer.py", *_TILED_MLP,
                                            "ddp_patches/checkpointing.py"],
    "benchmarks/results/tiled_mlp.json": ["benchmarks/tiled_mlp.py", *_TILED_MLP],
    "docs/data/plan-llama-3.1-8b-80gib.json": [*_PLANNER, "tests/data/llama-3.1-8b/config.json"],
    "docs/data/plan-qwen2.5-vl-7b-text-80gib.json": [*_PLANNER, "tests/data/qwen2.5-vl-7b-text/config.json"],
    "docs/data/plan-long-context.json": ["tools/long_context.py", *_PLANNER, "tests/data/llama-3.1-8b/config.json"],
    "docs/data/chunked-loss-bytes.json": ["tools/chunked_loss_bytes.py", *_CHUNKED_LOSS],
    "docs/data/gpu-proof.json": ["benchmarks/gpu_proof.py", "benchmarks/offload.py", "benchmarks/tiled_mlp.py",
                                 "tests/test_offload_cuda.py", *_TILED_MLP, *_OFFLOAD],
}


def _git(*args: str) -> str:
    """git's answer, or "" where there is no repository (a copy of the tree on a GPU machine)."""
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _digest(rel: str, data: bytes | None) -> str:
    """A source's hash; for Python, of its tokens without comments and blank lines, so that a comment (a NOTE's
    design line, say) does not make a measurement stale, and any change to the code does."""
    if data is None:
        return "absent"
    if rel.endswith(".py"):
        try:
            tokens = tokenize.tokenize(io.BytesIO(data).readline)
            data = "\x00".join(f"{t.type}:{t.string}" for t in tokens
                                if t.type not in (tokenize.COMMENT, tokenize.NL)).encode()
        except (tokenize.TokenError, SyntaxError):
            pass  # not tokenizable: its bytes
    return hashlib.sha256(data).hexdigest()[:16]


def source_hashes(result: str, commit: str | None = None) -> dict[str, str]:
    """Each declared source's hash, in the working tree or (``commit``) as committed there."""
    hashes = {}
    for rel in SOURCES[result]:
        if commit is None:
            path = os.path.join(ROOT, rel)
            data = open(path, "rb").read() if os.path.exists(path) else None
        else:
            done = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=ROOT, capture_output=True)
            data = done.stdout if done.returncode == 0 else None
        hashes[rel] = _digest(rel, data)
    return hashes


def record(result: str, commit: str | None = None) -> dict:
    """The provenance of a result measured now (or, for ``commit``, of one measured there)."""
    head = _git("rev-parse", "HEAD")
    commit = commit or head or "unknown"
    return {"commit": commit[:10], "sources": source_hashes(result, None if commit in (head, "unknown") else commit)}


def stamp(path: str, commit: str | None = None, key: str | None = None) -> None:
    """Write ``record`` into the result file at ``path``: a key of SOURCES, or a copy of the result ``key`` names
    (a benchmark run with --out-dir elsewhere)."""
    rel = key or os.path.relpath(os.path.abspath(path), ROOT)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    data = json.loads(text)
    indent = next((n for n in (1, 2) if json.dumps(data, indent=n) == text.rstrip("\n")), 2)  # keep the layout
    data["provenance"] = record(rel, commit)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=indent) + ("\n" if text.endswith("\n") else ""))


def _records(data: dict) -> list[dict]:
    """The provenances a result holds: its own, and (the GPU proof) each run step's, recorded when it ran."""
    steps = [s for s in data.get("steps", []) if s.get("status") not in ("not run", "dry-run")]
    own = [s["provenance"] for s in steps if "provenance" in s]
    return own + ([data.get("provenance", {})] if len(own) < len(steps) or not steps else [])


def changed(result: str, data: dict | None = None) -> dict[str, list[str]]:
    """commit -> the declared sources whose content differs from what the result (``data``: as loaded, else the
    committed file) recorded at that commit."""
    if data is None:
        with open(os.path.join(ROOT, result), encoding="utf-8") as f:
            data = json.load(f)
    now, found = source_hashes(result), {}
    for rec in _records(data):
        moved = [rel for rel in SOURCES[result] if rec.get("sources", {}).get(rel) != now[rel]]
        if moved:
            found.setdefault(rec.get("commit", "unknown")[:7], moved)
    return found


def stale(result: str, data: dict | None = None) -> str | None:
    """None when every source is as measured; otherwise the commit a figure was measured at ("unknown" when the
    result records none): its sources changed after that commit."""
    return next(iter(changed(result, data)), None)


def mark(result: str, data: dict | None = None) -> str:
    """The words a renderer puts beside a stale figure ("" for a fresh one)."""
    commit = stale(result, data)
    return "" if commit is None else f"stale since {commit}"
