"""The broad sweeps behind the generated "Every family" block of docs/compatibility.md, re-measured on 2 ranks.

Every gate/up/down MLP class of the installed transformers (tiled vs untiled) and every image-text-to-text
family (the VLM Trainer scenario). Each live result must equal the committed row in docs/data/compatibility.json,
and the page's block must be that file rendered: a table cannot claim what this run does not measure. After a
deliberate change, regenerate with ``python -m tools.compat``. Marked ``sweep`` (CI runs it;
``-m "not sweep"`` skips it locally).
"""

from __future__ import annotations

import json

import pytest

from tools import compat

pytestmark = pytest.mark.sweep

with open(compat.JSON_PATH) as _f:
    COMMITTED = json.load(_f)
REGENERATE = "re-run `python -m tools.compat` if the change is intended"


def mlp_part() -> list[dict]:
    import torch.distributed as dist

    from tools.mlp_sweep import sweep

    return sweep(dist.get_rank(), dist.get_world_size())


@pytest.mark.slow
def test_every_gated_mlp_class_tiles_with_parity_or_says_why(pool):
    rows = [r for part in pool.run(mlp_part, timeout=600) for r in part]
    assert not [r for r in rows if r["status"] == "failing"], "tiled and wrong, or raised"
    assert not [r for r in rows if "discovery missed" in r["detail"]], "a built gate/up/down class was not patched"
    live = {(r["package"], r["cls"]): r["status"] for r in rows}
    committed = {(r["package"], r["cls"]): r["status"] for r in COMMITTED["mlp"]}
    assert live == committed, f"the MLP sweep no longer matches docs/data/compatibility.json; {REGENERATE}"


def vlm_case(family: str) -> dict:
    from tools.vlm_sweep import run_family

    return run_family(family)


@pytest.mark.slow
@pytest.mark.parametrize("row", COMMITTED["vlm"], ids=lambda r: r["family"])
def test_vlm_family_as_committed(pool, row):
    """LoRA on text + vision, reentrant kwargs, rank 1 text-only, accumulation 2: trains on both ranks (in sync,
    finite) exactly where the table says so; elsewhere it fails or does not build, as the table says."""
    live = compat._worst(tuple(pool.run(vlm_case, family=row["family"], timeout=120)))
    assert live["status"] == row["status"], f"{live}; {REGENERATE}"


def test_moe_rows_are_the_families_test_moe_trains():
    from ddp_patches.verify.moe_models import FAMILIES

    assert [r["family"] for r in COMMITTED["moe"]] == list(FAMILIES)
    assert all(r["status"] == "trains" for r in COMMITTED["moe"])  # re-measured by tests/test_moe.py


@pytest.mark.docs
def test_docs_block_is_the_committed_sweep_rendered():
    assert compat.read_block(compat.PAGE) == compat.render(COMMITTED), REGENERATE
