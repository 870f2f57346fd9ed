"""The benchmark scripts run end to end at toy sizes and produce their JSON, plots and README rows.

No timing or memory assertions here: the targets live in the benchmarks' own output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


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
    assert any(line.startswith("| tiled MLP, 1024 tokens") for line in table)
    assert any("ddp_overhead | not measured yet" in line for line in table)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nold\n{END}\nrest\n")
    assert update_readme(str(readme), table)
    text = readme.read_text()
    assert "old" not in text and "| tiled MLP, 1024 tokens" in text and text.endswith("rest\n")


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
