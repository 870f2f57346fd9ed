"""The benchmark scripts run end to end at toy sizes and produce their JSON, plots and docs/benchmarks.md rows.

No timing or memory assertions here: the targets live in the benchmarks' own output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.slow
def test_tiled_mlp_smoke_writes_json_plots_and_a_readme_row(tmp_path):
    proc = _run(["benchmarks/tiled_mlp.py", "--smoke", "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "tiled_mlp.json").read_text())
    assert [r["tokens"] for r in report["rows"]] == [512, 1024]
    assert all(r["peak_bytes_tiled"] > 0 and r["shards"] > 1 for r in report["rows"])
    assert (tmp_path / "tiled_mlp.png").stat().st_size > 0 and (tmp_path / "tiled_mlp_time.png").stat().st_size > 0

    sys.path.insert(0, ROOT)
    from benchmarks.__main__ import END, START, readme_table, update_readme

    table = readme_table(str(tmp_path))
    assert any(line.startswith("| tiled MLP alone, no checkpoint") and "1024 tokens" in line for line in table)
    assert any("ddp_overhead | not measured yet" in line for line in table)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nold\n{END}\nrest\n")
    assert update_readme(str(readme), table)
    text = readme.read_text()
    assert "old" not in text and "| tiled MLP alone, no checkpoint" in text and text.endswith("rest\n")


@pytest.mark.slow
def test_offload_smoke_on_cpu_and_skip_message(tmp_path):
    proc = _run(["benchmarks/offload.py", "--smoke", "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "offload.json").read_text())
    assert report["rows"][0]["offload_stats"]["offloaded_tensors"] >= 1  # the forced CPU path really ran
    assert (tmp_path / "offload.png").exists()
    proc = _run(["benchmarks/offload.py"])
    assert proc.returncode == 0 and "needs a CUDA GPU" in proc.stdout and "skipped" in proc.stdout


def test_runner_rejects_unknown_names():
    proc = _run(["-m", "benchmarks", "--only", "nope"], timeout=120)
    assert proc.returncode == 2 and "choose from" in proc.stderr


def test_gpu_proof_dry_run_and_its_readers(tmp_path):
    """The GPU proof cannot run in CI; its harness can: every step listed, results written, outputs parsed."""
    from benchmarks import gpu_proof

    out = tmp_path / "proof.json"
    proc = _run(["-m", "benchmarks.gpu_proof", "--dry-run", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proof = json.loads(out.read_text())
    assert [s["name"] for s in proof["steps"]] == [s.name for s in gpu_proof.steps("/tmp")]
    assert all(s["status"] == "dry-run" for s in proof["steps"]) and proof["dry_run"]

    pytest_out = ("PASSED tests/test_offload_cuda.py::test_a\nFAILED tests/test_offload_cuda.py::test_b - boom\n"
                  "SKIPPED [1] tests/test_offload_cuda.py:12: needs two CUDA devices\n1 failed, 1 passed, 1 skipped")
    judged = gpu_proof.judge("cuda-tests", 1, pytest_out, None)
    assert judged["status"] == "fail" and judged["tests"]["tests/test_offload_cuda.py::test_b"] == "failed"
    assert gpu_proof.judge("cuda-tests", None, "", None) == {"status": "fail", "summary": "timed out"}
    validate = {"rows": [{"scenario": "raw-offload-stack", "patched": {"status": "pass"}},
                         {"scenario": "llama-qlora-find-unused", "patched": {"status": "error"}}]}
    assert gpu_proof.judge("validate-cuda", 1, "", validate)["summary"].startswith("1 of 2 scenarios pass")
    rows = {"rows": [{"seq": 8192, "misses": ["time 1.1x > 1.03x"]}]}
    assert gpu_proof.judge("offload-gpu-bound", 0, "", rows)["status"] == "missed targets"
    section = gpu_proof.readme_section({"environment": {"date": "2026-01-01"}, "steps": [
        {"name": "cuda-tests", "status": "pass", "summary": "3 passed"}]})
    assert section.startswith(gpu_proof.START) and section.endswith(gpu_proof.END) and "| cuda-tests | — | pass |" in section
    assert gpu_proof.merge([str(out), str(out)], str(tmp_path / "merged.json"), readme=False) == 0
    assert len(json.loads((tmp_path / "merged.json").read_text())["steps"]) == len(proof["steps"])


def test_gpu_proof_dry_run_never_touches_the_committed_results(tmp_path):
    """A dry run without --out writes nothing (it used to replace docs/data/gpu-proof.json with placeholders), and one
    that names the committed file is refused."""
    from benchmarks import gpu_proof

    before = open(gpu_proof.DEFAULT_OUT, "rb").read()
    proc = _run(["-m", "benchmarks.gpu_proof", "--dry-run"])
    assert proc.returncode == 0 and "wrote" not in proc.stdout, proc.stdout + proc.stderr
    proc = _run(["-m", "benchmarks.gpu_proof", "--dry-run", "--out", gpu_proof.DEFAULT_OUT])
    assert proc.returncode == 2 and "never writes" in proc.stdout
    assert open(gpu_proof.DEFAULT_OUT, "rb").read() == before


def test_gpu_proof_keeps_earlier_evidence_when_it_merges():
    """A new run replaces a step's record only where it ran the step; steps never run say so; each record keeps
    the run (date, GPU) that gave it, and the runs list keeps only runs that some step still cites."""
    from benchmarks import gpu_proof

    old_env = {"date": "2026-11-23", "gpu": "H100"}
    new_env = {"date": "2026-12-01", "gpu": "H200"}
    older = {"environment": old_env, "runs": [old_env], "dry_run": False, "steps": [
        {"name": "cuda-tests", "status": "pass", "summary": "13 passed", "date": "2026-11-23", "gpu": "H100"},
        {"name": "offload-small", "status": "pass", "summary": "targets met", "date": "2026-11-23", "gpu": "H100"}]}
    newer = {"environment": new_env, "runs": [new_env], "dry_run": False, "steps": [
        {"name": "max-seq-cuda", "status": "missed targets", "summary": "2x", "date": "2026-12-01", "gpu": "H200"},
        {"name": "cuda-tests", "status": "not run", "summary": "no time left", "date": "2026-12-01", "gpu": "H200"},
        {"name": "offload-small", "status": "fail", "summary": "exit 1", "date": "2026-12-01", "gpu": "H200"}]}
    merged = gpu_proof.combine(older, newer)
    by = {r["name"]: r for r in merged["steps"]}
    assert [r["name"] for r in merged["steps"]] == [s.name for s in gpu_proof.steps("/tmp")]
    assert by["cuda-tests"]["summary"] == "13 passed" and by["offload-small"]["status"] == "fail"
    assert by["tiled-layer-cuda"] == {"name": "tiled-layer-cuda", "status": "not run",
                                      "summary": "never run on a GPU yet"}
    assert merged["runs"] == [old_env, new_env] and merged["environment"] == new_env
    section = gpu_proof.readme_section(merged)
    assert "GPU run of 2026-11-23 on H100" in section and "GPU run of 2026-12-01 on H200" in section
    assert "| cuda-tests | 2026-11-23 | pass | 13 passed |" in section


@pytest.mark.slow
def test_gpu_proof_default_group_fits_one_call(tmp_path):
    """Every step is in exactly one group; the default group is the four steps never run on a GPU, most valuable
    first, and its limits plus the harness's own seconds fit one device call of 540 s, as --dry-run reports
    (NOTE [One call, new evidence first]); ``--steps`` runs a group's steps in the proof's order."""
    from benchmarks import gpu_proof

    names = [s.name for s in gpu_proof.steps("/tmp")]
    grouped = [n for group in gpu_proof.GROUPS.values() for n in group]
    assert sorted(grouped) == sorted(names) and len(grouped) == len(set(grouped))
    assert gpu_proof.GROUPS["default"] == ("max-seq-cuda", "tiled-layer-cuda", "host-sync-cuda", "ddp-overhead-cuda")
    assert names[:4] == list(gpu_proof.GROUPS["default"])
    limits = {s.name: s.timeout for s in gpu_proof.steps("/tmp")}
    total = sum(limits[n] for n in gpu_proof.GROUPS["default"]) + gpu_proof.HARNESS_S
    assert total <= gpu_proof.CALL_LIMIT_S <= 540
    proc = _run(["-m", "benchmarks.gpu_proof", "--dry-run", "--steps", "default"])
    assert proc.returncode == 0 and f"= {total} s <= 540 s" in proc.stdout, proc.stdout + proc.stderr
    for group, members in gpu_proof.GROUPS.items():
        out = tmp_path / f"{group}.json"
        proc = _run(["-m", "benchmarks.gpu_proof", "--dry-run", "--steps", group, "--out", str(out)])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [s["name"] for s in json.loads(out.read_text())["steps"]] == list(members)
    chosen, unknown = gpu_proof.select(gpu_proof.steps("/tmp"), "rerun,max-seq-cuda,nope")
    assert [s.name for s in chosen] == ["max-seq-cuda", *gpu_proof.GROUPS["rerun"]] and unknown == ["nope"]


def test_gpu_proof_reads_the_new_steps_outputs():
    """The readers of the default group's steps, on outputs shaped as the scripts write them (a GPU run cannot be had in
    CI): the tiled layer's rows as a list or a mapping, the CUDA overhead section, the host-sync test, max_seq."""
    from benchmarks import gpu_proof

    row = {"tokens": 8192, "layer_time_ratio": 1.02, "step_time_ratio": 1.01, "mlp_mem_ratio": 9.5, "misses": []}
    judged = gpu_proof.judge("tiled-layer-cuda", 0, "", {"rows": [row]})
    assert judged["status"] == "pass" and "8192: layer time 1.02x" in judged["summary"]
    by_length = {k: v for k, v in row.items() if k != "tokens"}
    judged = gpu_proof.judge("tiled-layer-cuda", 0, "", {"rows": {"32768": {**by_length, "misses": ["time 1.2x"]}}})
    assert judged["status"] == "missed targets" and judged["summary"].startswith("32768:")
    assert "| 32768 | 1.02x | 1.01x | 9.50x | — | — |" in gpu_proof.tiled_layer_table({"32768": by_length})
    assert gpu_proof.judge("tiled-layer-cuda", 0, "", {"rows": []})["status"] == "fail"

    section = {"trainable_tensors": 10336, "patched_over_unpatched": 1.01, "fu_false_error": "Expected to have",
               "hooks": {"patched": {"us_per_step": {"settle": 900.0, "post_hooks": 300.0}, "total_us": 1200.0,
                                     "fraction_of_step": 0.012}}, "misses": []}
    judged = gpu_proof.judge("ddp-overhead-cuda", 0, "", {"configs": {"many-tensors on cuda": section}})
    assert judged["status"] == "pass" and "1.010x" in judged["summary"] and "largest: settle" in judged["summary"]
    cpu_only = {"configs": {"many-tensors on cpu": section}}
    assert gpu_proof.judge("ddp-overhead-cuda", 0, "", cpu_only)["status"] == "fail"

    passed = "PASSED tests/test_reach_protocol.py::test_a_synced_step_adds_no_device_synchronisation_on_cuda\n1 passed"
    assert gpu_proof.judge("host-sync-cuda", 0, passed, None)["summary"].startswith("0 host-device")
    skipped = "SKIPPED [1] tests/test_reach_protocol.py:267: needs CUDA\n1 skipped, 40 deselected"
    assert gpu_proof.judge("host-sync-cuda", 0, skipped, None)["status"] == "fail"  # a skip proves nothing
    failed = ("FAILED tests/test_reach_protocol.py::test_a_synced - AssertionError\n"
              "E       AssertionError: rank 0 step 2: ['called a synchronizing CUDA operation']\n1 failed")
    assert "rank 0 step 2" in gpu_proof.judge("host-sync-cuda", 1, failed, None)["summary"]

    probes = [{"seq": 65536, "fits": True, "step1": {"active": 3 << 30, "reserved": 4 << 30},
               "step2": {"active": 3 << 30, "reserved": 4 << 30}}]
    side = {"max_seq": 65536, "bounded_by": None, "probes": probes, "seconds": 10.0}
    result = {"setup": {"device": "cuda", "budget_mib": 30720, "layers": 4, "hidden": 4096},
              "patched": {**side, "max_seq": 65536, "parts": {"tokens": 65536, "limit": "attention_one_layer",
                                                              "per_token": {"attention_one_layer": 40960.0}}},
              "best_unpatched": {**side, "max_seq": 32768, "probes": []}, "plain_hf": {**side, "max_seq": 4096,
                                                                                      "probes": []},
              "ratios": {"over_best_unpatched": 2.0, "over_plain_hf": 16.0, "lower_bound": False},
              "goals": {"over_best_unpatched": 4.0, "over_plain_hf": 16.0}}
    judged = gpu_proof.judge("max-seq-cuda", 0, "", result)
    assert judged["status"] == "missed targets" and "2.00x over (a)" in judged["summary"]
    assert "limit: attention_one_layer" in judged["summary"]
    section = gpu_proof.readme_section({"environment": {"date": "2026-01-01"}, "steps": [
        {"name": "max-seq-cuda", "status": judged["status"], "summary": judged["summary"], "result": result}]})
    assert "| patched | 65536 | first OOM | 3.0 / 4.0 GiB | 1 |" in section and "Limit: attention_one_layer" in section


@pytest.mark.docs
def test_committed_gpu_proof_matches_its_docs_section():
    """The GPU section of docs/benchmarks.md is generated from docs/data/gpu-proof.json, not edited by hand."""
    from benchmarks import gpu_proof

    with open(gpu_proof.DEFAULT_OUT) as f:
        proof = json.load(f)
    with open(gpu_proof.PAGE) as f:
        assert gpu_proof.readme_section(proof) in f.read()


@pytest.mark.slow
def test_max_seq_smoke_finds_a_length_on_each_side(tmp_path):
    """Three sides (patched, (a) best unpatched, (b) plain HF), the per-token parts at the patched maximum with the
    name of the largest, the ratios against both, and the docs/benchmarks.md row."""
    proc = _run(["benchmarks/max_seq.py", "--smoke", "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "max_seq.json").read_text())
    assert all(report[side]["max_seq"] > 0 for side in ("patched", "best_unpatched", "plain_hf"))
    assert report["patched"]["tiled_calls"] > 0  # the patched side really tiled
    parts = report["patched"]["parts"]
    assert parts["tokens"] == report["patched"]["max_seq"] and parts["limit"] in parts["per_token"]
    assert set(parts["per_token"]) >= {"checkpoint_inputs_device", "checkpoint_inputs_host", "attention_one_layer",
                                       "mlp_one_layer", "fused_head", "rest"}
    assert report["ratios"]["over_best_unpatched"] == report["patched"]["max_seq"] / report["best_unpatched"]["max_seq"]
    assert all(p["fits"] == (p["peak_bytes"] <= 8 << 20) for p in report["plain_hf"]["probes"])  # the CPU judge
    sys.path.insert(0, ROOT)
    from benchmarks import max_seq

    row = max_seq.summarize(report)[0]
    assert "(a) best unpatched" in row and "over (b)" in row and f"limit: {parts['limit']}" in row
    assert (tmp_path / "max_seq.png").stat().st_size > 0


TINY_LLAMA = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}


@pytest.mark.slow
def test_max_seq_from_a_config_prints_the_planners_prediction(tmp_path):
    """The GPU proof's real-shape form on the CPU: the whole model built from a config.json (here a tiny one, all
    its layers), LoRA at --lora-r, and the planner's prediction for the same budget beside each side. On the CPU the
    prediction models a GPU (bf16, offload), so only its presence is checked; ``--budget-mib 0`` needs CUDA."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    proc = _run(["benchmarks/max_seq.py", "--smoke", "--config-json", str(config), "--whole", "--lora-r", "4",
                 "--plan", "--max-probes", "3", "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "max_seq.json").read_text())
    assert report["setup"]["lora_r"] == 4 and report["setup"]["layers"] == 2 and report["setup"]["hidden"] == 64
    assert set(report["predicted"]) == {"patched", "best_unpatched", "plain_hf"}
    assert all(isinstance(p["longest"], int) for p in report["predicted"].values())
    assert "planner:" in proc.stdout
    refused = _run(["benchmarks/max_seq.py", "--budget-mib", "0"])
    assert refused.returncode == 2 and "expected --device cuda" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (the GPU proof's "
                    "max-seq-cuda step runs this on one)")
def test_max_seq_whole_llama_8b_on_cuda(tmp_path):
    """The GPU proof's max-seq-cuda step as it runs: the whole Llama-3.1-8B from its config, LoRA r=16, each rank
    half the free memory; every side finds a length, and the planner's prediction stands beside each."""
    from benchmarks import gpu_proof

    (step,) = [s for s in gpu_proof.steps(str(tmp_path)) if s.name == "max-seq-cuda"]
    command = [part.replace("{out}", str(tmp_path)) for part in step.command]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=step.timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "max_seq.json").read_text())
    assert report["setup"]["layers"] == 32 and report["setup"]["lora_r"] == 16
    assert all(report[side]["max_seq"] > 0 for side in ("patched", "best_unpatched", "plain_hf"))
    assert all(report["predicted"][side]["longest"] > 0 for side in ("patched", "best_unpatched", "plain_hf"))


# What torchrun printed when a rank of an unpatched TRL sft.py run aborted at exit in CI (stop 24), shortened.
EXIT_ABORT_OUTPUT = """100%|##########| 3/3 [00:00<00:00,  5.33it/s]
terminate called without an active exception
W1123 19:34:10.267000 29749 api.py:1028] Sending process 29751 closing signal SIGTERM
E1123 19:34:10.299000 29749 api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 29752)
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : -6 (pid: 29752)  (SIGABRT)
"""


def test_an_exit_abort_is_told_apart_from_a_failing_rank():
    """benchmarks._common.aborted_only_at_exit, which launch_ranks and tests/external.py allow to runs without the
    library only: torch's exit-time abort, and nothing else."""
    from benchmarks._common import aborted_only_at_exit

    assert aborted_only_at_exit(1, EXIT_ABORT_OUTPUT)
    assert not aborted_only_at_exit(0, EXIT_ABORT_OUTPUT)  # nothing failed
    rank_raised = "Traceback (most recent call last):\nRuntimeError: marked as ready twice\n" + EXIT_ABORT_OUTPUT
    assert not aborted_only_at_exit(1, rank_raised)  # a rank's own traceback: a real failure
    assert not aborted_only_at_exit(1, EXIT_ABORT_OUTPUT.replace("SIGABRT", "SIGSEGV"))


@pytest.mark.slow
def test_ddp_overhead_many_tensors_quick_keeps_earlier_rows_and_times_the_hooks(tmp_path):
    """The many-tensors configuration end to end at toy size (216 tensors, not 10,336): the worker confirms that
    find_unused=False fails without the library, the library's hooks are timed on their own, and the Llama figures
    of an earlier default run in the same folder are kept for the docs/benchmarks.md table."""
    sys.path.insert(0, ROOT)
    from benchmarks import ddp_overhead

    earlier = {"benchmark": "ddp_overhead", "date": "2026-01-01", "setup": {"model": "llama"}, "targets": {},
               "median_step_s": {"unpatched": 0.4, "patched": 0.41, "patched-fu-true": 0.42},
               "per_round_s": {"unpatched": [0.4], "patched": [0.41], "patched-fu-true": [0.42]},
               "patched_over_unpatched": 1.025, "find_unused_cost": 1.02, "misses": []}
    (tmp_path / "ddp_overhead.json").write_text(json.dumps(earlier))
    proc = _run(["benchmarks/ddp_overhead.py", "--many-tensors", "--quick", "--rounds", "2",
                 "--out-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "ddp_overhead.json").read_text())
    assert report["patched_over_unpatched"] == 1.025 and report["carried_llama"]  # the earlier rows survive
    section = report["configs"]["many-tensors on cpu"]
    assert "Expected to have finished reduction" in section["fu_false_error"]
    hooks = section["hooks"]["patched"]
    # One post-hook per parameter that got a gradient; the idle ones are marked ready through the reducer's own
    # hook (NOTE [Firing many hooks at once] in reach.py), so together they are every parameter, once.
    assert hooks["calls_per_step"]["post_hooks"] + hooks["settle_fired"][0] == section["trainable_tensors"]
    assert min(hooks["settle_fired"]) > 0 and hooks["us_per_step"]["settle"] > 0  # experts idled, the settle ran
    assert section["hooks"]["patched-fu-true"]["calls_per_step"]["settle"] == 0  # reach steps aside there
    rows = ddp_overhead.summarize(report)
    assert rows[0].startswith("| DDP step, patched / best unpatched") and len(rows) == 4
    assert "trainable tensors" in rows[2] and "per-parameter hooks" in rows[3]
    assert (tmp_path / "ddp_overhead_many-tensors_cpu.png").stat().st_size > 0


def test_ddp_overhead_cuda_mode_refuses_without_a_gpu():
    proc = _run(["benchmarks/ddp_overhead.py", "--config", "many-tensors", "--device", "cuda"], timeout=120)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr
