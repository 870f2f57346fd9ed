"""One rank of tests/test_two_nodes.py: two torchrun agents on one machine, one per "node" (``--nnodes=2
--nproc_per_node=1``), so rank 1 has LOCAL_RANK 0 and LOCAL_WORLD_SIZE 1. The library reaches it only through the
variables ``ddp-patches-run --print-env --offload true --on-unsynced warn`` exported before the agents started.

Writes OUT/rank<RANK>.json: the launch variables, what was applied, the unused-parameter rescue's parity, the pinned
pool cap of offload's CPU path and what it moved, the library's WARNING/ERROR lines of the replica check, and
what reload_4bit's file hand-over gave this rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def rescue() -> dict:
    """A branch only rank 0 runs, ``find_unused_parameters=False``, reentrant checkpoints: parity every step."""
    from ddp_patches.verify.parity import run_parity
    from ddp_patches.verify.raw_models import UnusedOnSomeRanks, raw_batch, raw_loss

    return run_parity(lambda: UnusedOnSomeRanks(use_reentrant=True).double(), raw_batch, torch.cat, raw_loss,
                      ddp_kwargs={"find_unused_parameters": False}).as_dict()


def offload_cpu_path() -> dict:
    """Offload's real pack path on CPU under DDP, its pool built with the default (per-node) cap."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_patches.offload import offloader as offload
    from ddp_patches.verify.cpu_offload import cpu_path_offloader
    from ddp_patches.verify.raw_models import CheckpointStack, raw_batch

    off = cpu_path_offloader()
    with offload.use_offloader(off):
        torch.manual_seed(0)
        model = DDP(CheckpointStack().double())
        model(raw_batch(dist.get_rank(), 0, 0)[:, :-1]).pow(2).mean().backward()
        stats = off.stats
    return {"cap_bytes": off.pool.cap_bytes, "owned_bytes": off.pool.owned_bytes,
            "offloaded": stats.offloaded_tensors}


def replica_drift() -> None:
    """Step 1 in sync; then rank 1 nudges one weight, and the check before step 2 (checked by default) names it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        if step == 1 and dist.get_rank() == 1:
            with torch.no_grad():
                model.module[2].bias.add_(1e-4)
        x = torch.full((2, 4), float(dist.get_rank() + step), dtype=torch.float64)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def saved_files() -> dict:
    """reload_4bit's file hand-over: each rank a directory of its own, rank 0 alone writes (as transformers does under
    a process group), and every rank then reads rank 0's files from its own directory."""
    import tempfile

    from ddp_patches.verify.hf_models import rank0_files_into

    with tempfile.TemporaryDirectory() as own:
        if dist.get_rank() == 0:
            os.makedirs(os.path.join(own, "sub"))
            with open(os.path.join(own, "sub", "weights.bin"), "wb") as f:
                f.write(bytes(range(256)) * 4)
        rank0_files_into(own)
        with open(os.path.join(own, "sub", "weights.bin"), "rb") as f:
            return {"same": f.read() == bytes(range(256)) * 4, "files": sorted(os.listdir(own))}


def main(out: str) -> None:
    import ddp_patches
    from ddp_patches import api

    dist.init_process_group("gloo")
    capture = _Capture()
    logging.getLogger("ddp_patches").addHandler(capture)
    report = api.current_report()
    result = {
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                                "DDP_PATCHES_APPLY", "DDP_PATCHES_OFFLOAD")},
        "applied": ddp_patches.is_applied(), "offload_option": report.options.get("offload") if report else None,
        "rescue": rescue(),
    }
    result["rescue_lines"] = list(capture.lines)
    result["offload"] = offload_cpu_path()
    capture.lines.clear()
    replica_drift()
    result["drift_lines"] = capture.lines
    result["saved_files"] = saved_files()
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
