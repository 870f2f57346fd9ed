"""A pool of N spawned ranks (gloo, CPU) kept alive across tests, so process start-up is paid once.

``pool.run(fn, **kwargs)`` runs the module-level function ``fn`` on every rank at once and returns the list
of per-rank results. A rank that raises, or a run that outlasts its timeout (a hang), poisons the process
group, so the pool is killed and the next run starts a fresh one; the error names the rank and carries its
traceback.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RankError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun would set; accelerate's PartialState reads them too."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }


def _forget_task_state(environ: dict[str, str]) -> None:
    """What one task leaves behind for the next in a reused worker: TrainingArguments(torch_compile=True) writes
    ACCELERATE_DYNAMO_BACKEND into os.environ, and accelerate's AcceleratorState singleton keeps that task's
    dynamo plugin; either made every later Accelerator() of the worker compile its model (accelerate's own tests
    reset the state in tearDown the same way)."""
    os.environ.clear()
    os.environ.update(environ)
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state()
        state.GradientState._reset_state()  # a task left inside accumulate(): sync_gradients=False skips steps


def _worker(rank: int, world: int, port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.update(rank_env(rank, world, port))
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, module, name, kwargs = task
        environ = dict(os.environ)
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((task_id, rank, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:
            _forget_task_state(environ)
    import gc

    gc.collect()  # free DDP reducers before the group goes (a reducer freed after it can hang gloo at exit)
    dist.destroy_process_group()


class DistPool:
    def __init__(self, world_size: int = 2):
        self.world_size = world_size
        self._procs: list[Any] = []
        self._task_id = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, timeout: float = 300, **kwargs) -> list[Any]:
        if not self._procs:
            self._start()
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, fn.__module__, fn.__name__, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            while len(results) + len(failures) < self.world_size:
                task_id, rank, ok, value = self._results.get(timeout=timeout)
                if task_id != self._task_id:
                    continue  # a late answer from a run that already failed
                (results if ok else failures)[rank] = value
                if failures and len(results) + len(failures) < self.world_size:
                    # The other ranks may now wait forever in a collective: do not wait for them.
                    break
        except queue.Empty:
            self.close()
            raise TimeoutError(f"{fn.__name__} did not finish on every rank within {timeout}s (a hang)") from None
        if failures:
            self.close()
            rank, tb = sorted(failures.items())[0]
            raise RankError(f"{fn.__name__} failed on rank {rank}:\n{tb}")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []


def grad_fn_names(t: Any) -> "Counter[str]":
    """How many nodes of each type t's autograd graph has (``CheckpointFunctionBackward``: a reentrant checkpoint
    that ran as such)."""
    from collections import Counter

    seen, stack, names = set(), [t.grad_fn], Counter()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names[fn.name()] += 1
        stack.extend(f for f, _ in fn.next_functions)
    return names
