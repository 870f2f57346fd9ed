"""Every gate/up/down MLP class of the installed transformers, tiled against untiled, one row per class.

Classes are enumerated from the modeling sources (``__init__`` assigns gate_proj, up_proj and down_proj, or is
inherited in the same file), apart from the library's discovery, so the sweep also checks discovery. The first
instance in a tiny model (``ddp_patches.verify.tiny``) runs tiled (5-token shards) and untiled in fp64, every
parameter trainable. Status: ``tiled`` (parity held), ``untiled`` (declined; the probe's reason), ``failing``
(wrong or raised), ``not built`` (no tiny model built offline or none holds the class; the reason says which).
Run by ``python -m tools.compat``; ``tests/test_sweeps.py`` re-measures it.
"""

from __future__ import annotations

import ast
import os
from dataclasses import asdict, dataclass

import torch

from ddp_patches.verify import tiny
from ddp_patches.verify.parity import relative_error

SHARD = 5
TOL = 1e-9
_GATED = {"gate_proj", "up_proj", "down_proj"}
_AUTO_CLASSES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForImageTextToText")


@dataclass
class Row:
    package: str
    cls: str
    status: str
    detail: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def gated_mlp_classes() -> list[tuple[str, str]]:
    """(modeling package, class name) for every gate/up/down MLP class in the installed transformers."""
    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = []
    for package in sorted(os.listdir(root)):
        path = os.path.join(root, package, f"modeling_{package}.py")
        if os.path.exists(path):
            found += [(package, name) for name in _gated_in_file(path)]
    return found


def _gated_in_file(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    own = {name for name, node in classes.items() if _init_assigns(node) >= _GATED}
    changed = True
    while changed:  # subclasses in the same file that inherit the __init__
        changed = False
        for name, node in classes.items():
            inherits = any(isinstance(b, ast.Name) and b.id in own for b in node.bases)
            if name not in own and inherits and not _has_init(node):
                own.add(name)
                changed = True
    return sorted(own)


def _has_init(node: ast.ClassDef) -> bool:
    return any(isinstance(item, ast.FunctionDef) and item.name == "__init__" for item in node.body)


def _init_assigns(node: ast.ClassDef) -> set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for sub in ast.walk(item):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and isinstance(sub.ctx, ast.Store):
                    names.add(sub.attr)
    return names


def model_types(package: str) -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    return [mt for mt in CONFIG_MAPPING_NAMES if model_type_to_module_name(mt) == package]


def find_instance(package: str, cls_name: str, cache: dict) -> tuple[torch.nn.Module | None, str]:
    """The first module of class ``cls_name`` in a tiny model of the package's families, or the reasons none."""
    reasons = []
    for mt in model_types(package):
        for auto in _AUTO_CLASSES:
            key = (mt, auto)
            if key not in cache:
                try:
                    cache[key] = tiny.build(mt, auto).double()
                except Exception as exc:  # noqa: BLE001 - the reason goes into the table
                    cache[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:140] if str(exc) else ''}"
            model = cache[key]
            if isinstance(model, str):
                reasons.append(f"{mt}/{auto}: {model}")
                continue
            for module in model.modules():
                if type(module).__name__ == cls_name and type(module).__module__.endswith(f"modeling_{package}"):
                    return module, mt
            reasons.append(f"{mt}/{auto}: built, no {cls_name} in it")
            break  # one built model per family is enough to say the class is not in its tiny config
    return None, "; ".join(reasons) or "no config type maps to this package"


def check_class(module: torch.nn.Module) -> Row:
    """Tiled (SHARD-token shards) vs untiled on the same input; the caller has applied tiled_mlp and is
    distributed. The module acts as under DDP."""
    from ddp_patches import engines, tiled_mlp

    cls = type(module)
    row = Row(cls.__module__.rsplit(".", 2)[-2], cls.__name__, "failing")
    problem = tiled_mlp.rules._structure_problem(module)
    if problem is not None:  # e.g. fused expert weights named gate_proj: parameters, not projections
        row.status, row.detail = "untiled", problem
        return row
    linear = next((m for m in module.gate_proj.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is None:
        row.detail = "gate_proj holds no nn.Linear to read the hidden size from"
        return row
    hidden = linear.in_features
    module.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, hidden, generator=g, dtype=torch.float64)
    try:  # dropout off: tiled and untiled calls draw different masks (the replay is tested on its own)
        with engines.acting_as(engines.DDP), tiled_mlp.dropout_off(module):
            before = tiled_mlp.counts()["tiled_calls"]
            tiled = _grads(module, x)
            ran_tiled = tiled_mlp.counts()["tiled_calls"] > before
            with tiled_mlp.untiled():
                untiled = _grads(module, x)
    except Exception as exc:  # noqa: BLE001
        row.detail = f"{type(exc).__name__}: {str(exc)[:160]}"
        return row
    if not ran_tiled:
        row.status, row.detail = "untiled", tiled_mlp.rules._verdicts.get(cls) or "not patched (discovery missed it)"
        return row
    err = max(relative_error(a, b) for a, b in zip(tiled, untiled))
    row.status, row.detail = ("tiled", f"{err:.1e}") if err <= TOL else ("failing", f"gradient error {err:.1e}")
    return row


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.pow(2).sum().backward()
    return [out.detach(), x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p)
                                     for p in module.parameters()]


def sweep(part: int = 0, parts: int = 1) -> list[dict]:
    """Rows for every ``parts``-th class starting at ``part`` (ranks split the work); apply()s tiled_mlp."""
    import ddp_patches

    rows = []
    cache: dict = {}
    classes = gated_mlp_classes()[part::parts]
    with ddp_patches.patched(tiled_mlp=True, tiled_mlp_shard_tokens=SHARD):
        for package, name in classes:
            module, why = find_instance(package, name, cache)
            if module is None:
                rows.append(Row(package, name, "not built", why).as_dict())
                continue
            row = check_class(module)
            row.package, row.detail = package, f"{why}: {row.detail}"
            rows.append(row.as_dict())
    return rows
