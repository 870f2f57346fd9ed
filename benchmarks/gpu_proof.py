"""The GPU proof: everything only a GPU can show, in one command on one machine with one GPU.

    python -m benchmarks.gpu_proof                        # all steps; writes docs/gpu-proof.json + README section
    python -m benchmarks.gpu_proof --steps cuda-tests,offload-gpu-bound
    python -m benchmarks.gpu_proof --dry-run --out /tmp/p.json   # no GPU needed: checks the harness (CI runs it)

Steps, each a subprocess with its own time limit, so one failure or hang cannot hide the others:

  cuda-tests          tests/test_offload_cuda.py: races under a delayed side stream and the CUDA sanitizer, the
                      mutation checks (the race test must FAIL without each stream dependency), release while the
                      CPU runs ahead (active bytes), the 100-step bf16 stress run (random lengths, randomly slowed
                      side stream, gradients bit-equal, memory levels off), DDP with offload on two gloo ranks
                      sharing the GPU and on one NCCL rank
  offload-gpu-bound   benchmarks/offload.py, Llama-8B-shaped layers (8, bf16) at 8K and 16K, one process per mode
  offload-small       the same for a Qwen2-0.5B-shaped model at 4K (24 thin layers: the bus-bound end)
  validate-cuda       validate_ddp_fix.py scenarios on CUDA, two gloo ranks on the one GPU, patched side (the CPU
                      runs in CI show the unpatched failures), QLoRA with the real CUDA bitsandbytes kernels
  tiled-mlp-cuda      benchmarks/tiled_mlp.py, a Llama-8B MLP (H=4096, I=14336, bf16, LoRA) at 8K and 32K tokens
  max-seq-cuda        benchmarks/max_seq.py, the longest sequence per rank in 20 GiB (two ranks share the GPU),
                      Llama-8B-shaped layers (4, bf16), fused LM head, patched (tiled MLP + offload) vs unpatched

Packages the GPU machine lacks (trl, bitsandbytes, datasets...) travel as wheels; a step whose imports fail is
reported as "not run" with the missing module, never skipped silently. Results: a JSON file (date, GPU, driver,
torch/CUDA and library versions, each step's status, figures and output tail) and the README section between
the ``gpu-proof`` markers, generated from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "docs", "gpu-proof.json")
README = os.path.join(ROOT, "README.md")
START, END = "<!-- gpu-proof:start -->", "<!-- gpu-proof:end -->"
PACKAGES = ("torch", "transformers", "peft", "accelerate", "trl", "bitsandbytes", "datasets")
VALIDATE_ON_CUDA = ("raw-offload-stack", "raw-static-graph-accum", "llama-lora-tiled-mlp", "llama-qlora-find-unused",
                    "qwen2-lora-static-accum", "qwen3-moe-lora-find-unused")
# The HF Trainer (through accelerate) puts rank r on cuda:r, so these need one GPU per rank: on a one-GPU machine
# rank 1 fails with "invalid device ordinal" (measured 2026-11-23, docs/gpu-runs/). Run where there are two.
NEEDS_A_GPU_PER_RANK = ("hf-trainer-lora", "trl-sft-lora", "gemma3-trainer-vlm")


def validate_scenarios(gpus: int) -> tuple[str, ...]:
    return VALIDATE_ON_CUDA + (NEEDS_A_GPU_PER_RANK if gpus >= 2 else ())


@dataclasses.dataclass
class Step:
    name: str
    command: list[str]
    timeout: int
    needs: tuple[str, ...] = ()  # modules that must import, else the step is "not run"
    result_file: str | None = None  # a JSON file the command writes (its path is substituted for {out})


def steps(tmp: str, gpus: int = 1) -> list[Step]:
    py = sys.executable
    return [
        Step("cuda-tests", [py, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/test_offload_cuda.py"],
             480, ("transformers", "peft")),
        Step("offload-gpu-bound", [py, "benchmarks/offload.py", "--config", "gpu-bound", "--reps", "1",
                                   "--out-dir", "{out}"], 420,
             ("transformers", "peft"), "offload.json"),
        Step("offload-small", [py, "benchmarks/offload.py", "--config", "qwen2-0.5b", "--seq", "4096", "--reps", "1",
                               "--out-dir", "{out}"], 300, ("transformers", "peft"), "offload.json"),
        Step("validate-cuda", [py, "validate_ddp_fix.py", "--device", "cuda", "--skip-unpatched", "--timeout", "180",
                               "--scenarios", ",".join(validate_scenarios(gpus)), "--json", "{out}/validate.json"],
             540,
             ("transformers", "peft", "trl", "bitsandbytes"), "validate.json"),
        Step("tiled-mlp-cuda", [py, "benchmarks/tiled_mlp.py", "--device", "cuda", "--hidden", "4096",
                                "--intermediate", "14336", "--tokens", "8192", "32768", "--repeats", "3", "--out-dir",
                                "{out}"], 300, ("transformers", "peft"), "tiled_mlp.json"),
        Step("max-seq-cuda", [py, "benchmarks/max_seq.py", "--device", "cuda", "--hidden", "4096", "--intermediate",
                              "14336", "--vocab", "128256", "--layers", "4", "--budget-mib", "20480", "--first-seq",
                              "4096", "--resolution", "2048", "--probe-tokens", "4096", "--out-dir", "{out}"], 540,
             ("transformers", "peft", "trl"), "max_seq.json"),
    ]


def environment() -> dict:
    env = {"date": datetime.date.today().isoformat(), "python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        env["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        env["gpu"] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["driver"] = smi.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["driver"] = None
    return env


def missing_modules(names: tuple[str, ...]) -> list[str]:
    missing = []
    for name in names:
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
            missing.append(f"{name} ({last[:160]})")
    return missing


def run_step(step: Step, tmp: str, dry_run: bool) -> dict:
    out_dir = os.path.join(tmp, step.name)
    os.makedirs(out_dir, exist_ok=True)
    command = [part.replace("{out}", out_dir) for part in step.command]
    record = {"name": step.name, "command": " ".join(command[1:]), "timeout_s": step.timeout}
    if dry_run:
        return {**record, "status": "dry-run", "summary": "not run (--dry-run)"}
    missing = missing_modules(step.needs)
    if missing:
        return {**record, "status": "not run", "summary": "missing: " + "; ".join(missing)}
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=step.timeout, cwd=ROOT, env=env)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output, code = output + f"\n[timed out after {step.timeout}s]", None
    record["seconds"] = round(time.monotonic() - start, 1)
    record["exit_code"] = code
    record["output_tail"] = output[-3000:]
    result = None
    if step.result_file and os.path.exists(os.path.join(out_dir, step.result_file)):
        with open(os.path.join(out_dir, step.result_file)) as f:
            result = json.load(f)
    record.update(judge(step.name, code, output, result))
    return record


# -- reading each step's output ---------------------------------------------------------------------------------
def judge(name: str, code: int | None, output: str, result) -> dict:
    if code is None:
        return {"status": "fail", "summary": "timed out"}
    if name == "cuda-tests":
        return judge_pytest(code, output)
    if name.startswith("offload-"):
        return judge_rows(code, output, result, "seq")
    if name == "tiled-mlp-cuda":
        return judge_rows(code, output, result, "tokens")
    if name == "validate-cuda":
        return judge_validate(code, output, result)
    if name == "max-seq-cuda":
        if code != 0 or not result:
            return {"status": "fail", "summary": f"exit {code}; no result file"}
        return {"status": "pass", "result": result,
                "summary": f"longest sequence per rank: unpatched {result['unpatched']['max_seq']}, patched "
                           f"{result['patched']['max_seq']} ({result['ratio'] or 0:.2f}x)"}
    return {"status": "pass" if code == 0 else "fail", "summary": f"exit {code}"}


def judge_pytest(code: int, output: str) -> dict:
    outcomes = {}
    for line in output.splitlines():
        match = re.match(r"^(PASSED|FAILED|SKIPPED|ERROR) (\S+)", line)
        if match:
            outcomes[match.group(2)] = match.group(1).lower()
        skipped = re.match(r"^SKIPPED \[\d+\] (\S+): (.*)", line)
        if skipped:
            outcomes[skipped.group(1)] = "skipped: " + skipped.group(2)
    counts = re.findall(r"(\d+) (passed|failed|skipped|error)", output)
    summary = ", ".join(f"{n} {what}" for n, what in counts[-4:]) or f"exit {code}"
    failed = any(v in ("failed", "error") for v in outcomes.values())
    return {"status": "pass" if code == 0 and not failed else "fail", "summary": summary, "tests": outcomes}


def judge_rows(code: int, output: str, result, key: str) -> dict:
    if code != 0 or not result:
        return {"status": "fail", "summary": f"exit {code}; no result file"}
    misses = [f"{r[key]}: {m}" for r in result["rows"] for m in r.get("misses", [])]
    return {"status": "pass" if not misses else "missed targets", "summary": "; ".join(misses) or "targets met",
            "result": result}


def judge_validate(code: int, output: str, result) -> dict:
    if not result:
        return {"status": "fail", "summary": f"exit {code}; no result file"}
    rows = result if isinstance(result, list) else result.get("rows", [])
    outcomes = {r["scenario"]: r["patched"]["status"] for r in rows}
    passed = sum(v == "pass" for v in outcomes.values())
    summary = f"{passed} of {len(outcomes)} scenarios pass patched on CUDA (two gloo ranks on the GPU)"
    if not any(name in outcomes for name in NEEDS_A_GPU_PER_RANK):
        summary += "; not run here: " + ", ".join(NEEDS_A_GPU_PER_RANK) + " (the HF Trainer needs a GPU per rank)"
    return {"status": "pass" if passed == len(outcomes) and outcomes else "fail", "summary": summary,
            "scenarios": outcomes, "result": result}


# -- the README section -------------------------------------------------------------------------------------------
def readme_section(proof: dict) -> str:
    env = proof["environment"]
    lines = [START, "",
             f"GPU proof of {env['date']} on {env.get('gpu') or 'no GPU'} (driver {env.get('driver')}), torch "
             f"{env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')}, peft "
             f"{env.get('peft')}, trl {env.get('trl')}, bitsandbytes {env.get('bitsandbytes')}. Generated by "
             "`python -m benchmarks.gpu_proof` from `docs/gpu-proof.json`.", "",
             "| step | status | what it showed |", "|---|---|---|"]
    for s in proof["steps"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['summary']} |")
    for s in proof["steps"]:
        rows = (s.get("result") or {}).get("rows") if isinstance(s.get("result"), dict) else None
        if s["name"].startswith("offload-") and rows:
            lines += ["", f"{s['name']}: active-byte peaks, one process per mode", "",
                      "| seq | moved / movable | active peak off → on | drop / expected | step off → on | stall |",
                      "|---|---|---|---|---|---|"]
            for r in rows:
                lines.append(
                    f"| {r['seq']} | {r['moved_bytes'] / 2**20:.0f} / {r['movable_bytes'] / 2**20:.0f} MiB | "
                    f"{r['active_peak_off'] / 2**30:.2f} → {r['active_peak_on'] / 2**30:.2f} GiB | "
                    f"{r['removed_fraction']:.2f} | {r['step_s_off']:.3f} → {r['step_s_on']:.3f} s "
                    f"({r['time_ratio']:.3f}x) | {(r['offload_stats'] or {}).get('stall_ms', 0):.1f} ms |")
        if s["name"] == "tiled-mlp-cuda" and rows:
            lines += ["", "tiled-mlp-cuda: per-rank active peak of one MLP forward+backward", "",
                      "| tokens | untiled → tiled | memory ratio | time ratio |", "|---|---|---|---|"]
            for r in rows:
                lines.append(f"| {r['tokens']} | {r['peak_bytes_untiled'] / 2**20:.0f} → "
                             f"{r['peak_bytes_tiled'] / 2**20:.0f} MiB | {r['mem_ratio']:.2f}x | "
                             f"{r['time_ratio']:.2f}x |")
    lines += ["", END]
    return "\n".join(lines)


def write_readme(proof: dict, path: str = README) -> bool:
    with open(path) as f:
        text = f.read()
    if START not in text or END not in text:
        return False
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    with open(path, "w") as f:
        f.write(before + readme_section(proof) + after)
    return True


def merge(paths: list[str], out: str, readme: bool = True) -> int:
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    proof = {"environment": parts[0]["environment"], "dry_run": any(p["dry_run"] for p in parts),
             "steps": [s for p in parts for s in p["steps"]]}
    with open(out, "w") as f:
        json.dump(proof, f, indent=1, default=str)
    print(f"wrote {out}")
    if readme and write_readme(proof):
        print(f"updated the gpu-proof section of {README}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="the JSON results (default docs/gpu-proof.json)")
    p.add_argument("--steps", default=None, help="comma-separated step names (default: all)")
    p.add_argument("--dry-run", action="store_true", help="check the harness without running the steps")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite the README section")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="combine the results of runs split over several "
                   "calls (steps in the given order) into --out and the README section, then exit")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out, readme=not args.no_readme)
    env = environment()
    if not args.dry_run and not env.get("gpu"):
        print("gpu_proof: no CUDA device is visible; nothing to prove here (use --dry-run to check the harness)")
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu_proof_") as tmp:
        chosen = steps(tmp, env.get("gpu_count") or 1)
        if args.steps:
            wanted = {name.strip() for name in args.steps.split(",")}
            unknown = wanted - {s.name for s in chosen}
            if unknown:
                print(f"gpu_proof: unknown steps {sorted(unknown)}; known: {[s.name for s in chosen]}")
                return 2
            chosen = [s for s in chosen if s.name in wanted]
        results = []
        for step in chosen:
            print(f"[gpu_proof] {step.name} ...", flush=True)
            record = run_step(step, tmp, args.dry_run)
            print(f"[gpu_proof] {step.name}: {record['status']} -- {record['summary']}", flush=True)
            results.append(record)
    proof = {"environment": env, "dry_run": args.dry_run, "steps": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(proof, f, indent=1, default=str)
    print(f"wrote {args.out}")
    if not args.dry_run and not args.no_readme and write_readme(proof):
        print(f"updated the gpu-proof section of {README}")
    ok = all(r["status"] in ("pass", "dry-run") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
