"""Two nodes on one machine: two torchrun agents (``--nnodes=2 --node_rank=0/1 --nproc_per_node=1``, static
rendezvous on 127.0.0.1), so rank 1 runs with LOCAL_RANK 0 and LOCAL_WORLD_SIZE 1 -- what a node-local assumption
(a rank 0 per machine, a world counted as the node's ranks) would get wrong. The variables of
``ddp-patches-run --print-env`` are exported once, as an sbatch script would, and reach both agents' ranks.

Each rank (tests/two_nodes_script.py) runs the unused-parameter rescue with parity every step, offload's CPU path
with its pinned pool capped per node (LOCAL_WORLD_SIZE, not WORLD_SIZE), and the replica check, which names a drift
on rank 1 through the rendezvous store the agent of node 0 serves; the QLoRA builder's saved model reaches rank 1
without a file system shared with rank 0 (NOTE [A saved model reaches every node]).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.external import RUNNER, run_bounded
from tests.harness import ROOT, _free_port

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(ROOT, "tests", "two_nodes_script.py")


def _expected_cap(monkeypatch, local_world_size: int) -> int:
    from ddp_patches.offload.pinned_pool import default_cap_bytes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    return default_cap_bytes()


def test_two_torchrun_nodes_on_one_machine(tmp_path, monkeypatch):
    port = _free_port()
    agents = " ".join(
        f"{sys.executable} -m torch.distributed.run --nnodes=2 --node_rank={node} --nproc_per_node=1 "
        f"--master_addr=127.0.0.1 --master_port={port} {SCRIPT} {tmp_path} > {tmp_path}/node{node}.log 2>&1 & "
        f"p{node}=$!;"
        for node in (0, 1))
    print_env = " ".join(RUNNER + ["--print-env", "--offload", "true"])
    shell = f'set -e; eval "$({print_env})"; {agents} wait $p0; wait $p1'
    out = run_bounded(["bash", "-c", shell], timeout=120)
    logs = "".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1) if (tmp_path / f"node{n}.log").exists())
    assert out.returncode == 0, (out.stderr + logs)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    for rank, r in enumerate(ranks):
        assert r["env"]["RANK"] == str(rank) and r["env"]["LOCAL_RANK"] == "0", r["env"]
        assert r["env"]["WORLD_SIZE"] == "2" and r["env"]["LOCAL_WORLD_SIZE"] == "1", r["env"]
        # --print-env: applied in both agents' ranks, with the option it exported
        assert r["applied"] and r["env"]["DDP_PATCHES_APPLY"] == "1" and r["offload_option"] is True, r
        # the rescue: rank 1 never runs the branch, find_unused_parameters=False; exact every step
        assert r["rescue"]["max_rel_error"] < 1e-12 and r["rescue"]["ranks_in_sync"], r["rescue"]
        assert r["rescue"]["iterations"] == 3
        assert not [line for line in r["rescue_lines"] if line.startswith("ERROR")], r["rescue_lines"]
        # offload's CPU path moved the checkpoint inputs (4 blocks, the last kept) into a pool capped per node
        assert r["offload"]["offloaded"] == 3 and 0 < r["offload"]["owned_bytes"] <= r["offload"]["cap_bytes"]
    per_node, per_world = _expected_cap(monkeypatch, 1), _expected_cap(monkeypatch, 2)
    assert per_node != per_world and all(r["offload"]["cap_bytes"] == per_node for r in ranks), ranks

    # the replica check: both ranks publish; the later one at step 2 compares and names the weight rank 1 nudged
    drift = ranks[0]["drift_lines"] + ranks[1]["drift_lines"]
    assert 1 <= len(drift) <= 2 and all(d.startswith("ERROR") and "optimizer step 2" in d for d in drift), drift
    assert all("'2.bias'" in d and "rank 1" in d and "rank 0" in d for d in drift), drift
    # the QLoRA builder's saved model: rank 1 reads rank 0's files from a directory of its own
    assert all(r["saved_files"] == {"same": True, "files": ["sub"]} for r in ranks), ranks
