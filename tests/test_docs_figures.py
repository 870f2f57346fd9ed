"""One source per figure: every result file records the commit and the hashes of the sources it measured; the
figure blocks of docs/benchmarks.md and the README are those results rendered, a result whose sources changed
since shown as "stale since <commit>"; the design document links figures instead of copying them."""

from __future__ import annotations

import copy
import json
import os
import re

import pytest

from benchmarks import provenance
from tools import figures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.docs


def _load(rel: str) -> dict:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return json.load(f)


def test_every_result_records_its_commit_and_its_sources():
    results = sorted(p for d in ("benchmarks/results", "docs/data") for p in
                     (f"{d}/{n}" for n in os.listdir(os.path.join(ROOT, d)) if n.endswith(".json")))
    not_figures = {"docs/data/compatibility.json", "docs/data/tested-versions.json", "docs/data/user-reports.json"}
    assert sorted(set(results) - not_figures) == sorted(provenance.SOURCES), "declare each result's sources"
    for rel, sources in provenance.SOURCES.items():
        assert all(os.path.exists(os.path.join(ROOT, s)) for s in sources), (rel, sources)
        record = _load(rel).get("provenance")
        assert record and re.fullmatch(r"[0-9a-f]{7,10}", record["commit"]), f"{rel}: no commit recorded"
        assert list(record["sources"]) == sources, f"{rel}: recorded sources are not the declared ones"


def test_a_stale_figure_is_shown_stale_where_it_is_rendered():
    """For every block and each of its results whose sources changed since they were measured, the block says
    "stale since <commit>" (README: beside the figure; docs/benchmarks.md: under the block and in its rows)."""
    missing = []
    for name, (page, results) in figures.BLOCKS.items():
        with open(page, encoding="utf-8") as f:
            text = f.read()
        end = f"<!-- figures:{name} -->" if name != "readme-benchmarks" else figures.README_END
        region = text[text.index(f"<!-- {name}:start"):text.index(end)]
        missing += [f"{os.path.relpath(page, ROOT)} block {name}: {rel} is stale since {commit}, not said"
                    for rel in results if (commit := provenance.stale(rel)) and f"stale since {commit}" not in region]
    assert not missing, "\n  ".join(["figures whose sources changed since they were measured:", *missing])


def test_figure_blocks_are_their_results_rendered():
    assert figures.drift() == []


def test_a_changed_source_turns_a_figure_stale_in_every_renderer(tmp_path):
    """The renderers on a result whose recorded hash of one source no longer matches the tree."""
    from benchmarks.__main__ import readme_table

    key = "benchmarks/results/tiled_mlp.json"
    fresh = _load(key) | {"provenance": provenance.record(key)}
    assert provenance.stale(key, fresh) is None and provenance.mark(key, fresh) == ""
    old = copy.deepcopy(fresh)
    old["provenance"].update(commit="abcdef1234", sources={**old["provenance"]["sources"],
                                                           "ddp_patches/tiled_mlp/function.py": "0" * 16})
    assert provenance.changed(key, old) == {"abcdef1": ["ddp_patches/tiled_mlp/function.py"]}
    for report, stale in ((fresh, False), (old, True)):
        (tmp_path / "tiled_mlp.json").write_text(json.dumps(report))
        rows = [r for r in readme_table(str(tmp_path)) if r.startswith("| tiled MLP alone")]
        assert rows and all(("stale since abcdef1" in r) == stale for r in rows)
        assert all(r.count(" | ") == 3 for r in rows)  # still four cells


def test_write_report_records_the_commit_and_the_sources(tmp_path):
    from benchmarks._common import write_report

    path = write_report("tiled_mlp", {"rows": []}, str(tmp_path))
    record = json.loads(open(path).read())["provenance"]
    assert list(record["sources"]) == provenance.SOURCES["benchmarks/results/tiled_mlp.json"]
    assert record["sources"] == provenance.source_hashes("benchmarks/results/tiled_mlp.json")


def test_the_design_document_links_figures_instead_of_copying_them():
    """A measured ratio or a percentage of a step in the design document is a copy that drifts: it links
    docs/benchmarks.md, where each figure is rendered from its result."""
    with open(os.path.join(ROOT, "DDP_GRADIENT_CHECKPOINTING_FIX.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    copied = [f"{i}: {line.strip()[:100]}" for i, line in enumerate(lines, 1)
              if re.search(r"\b\d\.\d{2,3}x\b|\d+(\.\d+)? ms/step", line)]
    assert not copied, "\n  ".join(["measured figures copied into the design document:", *copied])
    assert "docs/benchmarks.md#" in "\n".join(lines)
