"""``ddp-patches-run [options] <command ...>``: apply() in every Python process a command starts, no code change.

In the style of ``opentelemetry-instrument`` and ``ddtrace-run``: the command runs with ``ddp_patches/_bootstrap``
first on PYTHONPATH and its options in ``DDP_PATCHES_*`` environment variables. Python imports the
``sitecustomize`` found there at start-up in every process the command starts (torchrun's and
``accelerate launch``'s ranks, the ``trl`` CLI, dataloader workers); it then imports the user's own
``sitecustomize``, if one is further on the path, so nothing of theirs is hidden. apply() itself runs when the
process first imports torch (NOTE [Apply when torch is imported]), so a Python process that never uses torch
pays nothing. This module imports only the standard library at module level, for the same reason.

Options (each also an environment variable, which is what the child processes read):

    --checkpointing true|false          DDP_PATCHES_CHECKPOINTING
    --reducer true|false                DDP_PATCHES_REDUCER
    --offload auto|true|false           DDP_PATCHES_OFFLOAD
    --offload-min-bytes N               DDP_PATCHES_OFFLOAD_MIN_BYTES
    --offload-max-pinned-bytes N|auto   DDP_PATCHES_OFFLOAD_MAX_PINNED_BYTES
    --tiled-mlp true|false              DDP_PATCHES_TILED_MLP
    --tiled-mlp-shard-tokens N|auto     DDP_PATCHES_TILED_MLP_SHARD_TOKENS
    --log-level LEVEL                   DDP_PATCHES_LOG_LEVEL (show the library's lines at LEVEL, e.g. INFO)

``DDP_PATCHES_APPLY=1`` switches the start-up hook on; without it, a leftover PYTHONPATH entry does nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import sys
from typing import Callable

ENABLE = "DDP_PATCHES_APPLY"
LOG_LEVEL = "DDP_PATCHES_LOG_LEVEL"
PREFIX = "DDP_PATCHES_"
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")

logger = logging.getLogger("ddp_patches")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _offload(text: str) -> bool | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _bool(text)
    except ValueError:
        raise ValueError("expected auto, true or false") from None


def _count(text: str) -> int:
    value = int(text.strip())
    if value < 0:
        raise ValueError("expected a number >= 0")
    return value


def _count_or_auto(text: str) -> int | None:
    return None if text.strip().lower() in ("auto", "none", "") else _count(text)


# apply() keyword -> how its value is read from text. tests/test_autoapply.py checks it covers apply() exactly.
OPTIONS: dict[str, Callable[[str], object]] = {
    "checkpointing": _bool,
    "reducer": _bool,
    "offload": _offload,
    "offload_min_bytes": _count,
    "offload_max_pinned_bytes": _count_or_auto,
    "tiled_mlp": _bool,
    "tiled_mlp_shard_tokens": _count_or_auto,
}


def env_name(option: str) -> str:
    return PREFIX + option.upper()


def parse_options(raw: dict[str, str], spell: Callable[[str], str]) -> dict:
    """apply() keywords from their text values; a bad one raises ValueError naming it as ``spell(name)`` does."""
    options = {}
    for name, text in raw.items():
        try:
            options[name] = OPTIONS[name](text)
        except ValueError as e:
            raise ValueError(f"{spell(name)}={text!r} is not valid: {e}") from None
    return options


def options_from_env(environ: dict | None = None) -> dict:
    """apply() keywords from ``DDP_PATCHES_*`` variables; a bad value raises ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    raw = {name: environ[env_name(name)] for name in OPTIONS if env_name(name) in environ}
    try:
        return parse_options(raw, env_name)
    except ValueError as e:
        raise ValueError(f"ddp_patches: {e} (unset it, or see `ddp-patches-run --help`)") from None


# NOTE [Apply when torch is imported]
# sitecustomize runs before the user's code, when nothing is imported yet. Calling apply() there would import
# torch (about 2 s) in every Python process, also in those that never use it, and it is not needed: every
# patch acts on torch, transformers and DDP objects looked up at call time. So the hook waits for the first
# ``import torch`` (a one-shot meta-path finder that wraps the torch loader's ``exec_module``) and calls apply()
# right after torch's own __init__ has run -- before any user line that could build a Trainer or DDP.
class _ApplyAfterTorchImport:
    """A ``sys.meta_path`` finder: run ``callback`` once torch's module body has executed.

    It stays on the path until torch is really imported: ``importlib.util.find_spec("torch")``, which
    transformers, accelerate and TRL call to test availability, asks for a spec without executing it.
    """

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self._finding = False

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec("torch")  # what the finders after this one would return
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, original = spec.loader, spec.loader.exec_module

        def exec_module(module):
            try:
                original(module)
            finally:
                del loader.exec_module  # back to the class's method
            if self in sys.meta_path:
                sys.meta_path.remove(self)
                self.callback()

        loader.exec_module = exec_module
        return spec


def apply_from_env() -> None:
    """What the start-up hook runs once torch is imported: apply() with the options in the environment."""
    level = os.environ.get(LOG_LEVEL)
    if level:
        _show_logs(level)
    import ddp_patches

    ddp_patches.apply(**options_from_env())


def _show_logs(level: str) -> None:
    lib = logging.getLogger("ddp_patches")
    lib.setLevel(level.upper())
    if not lib.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        lib.addHandler(handler)


def bootstrap() -> None:
    """Called from ``_bootstrap/sitecustomize.py`` at interpreter start-up."""
    if os.environ.get(ENABLE) != "1":
        return
    options_from_env()  # a bad value fails here, in every process, with the variable's name
    if "torch" in sys.modules:  # imported by a .pth file before us: apply now
        apply_from_env()
    else:
        sys.meta_path.insert(0, _ApplyAfterTorchImport(apply_from_env))


def chain_user_sitecustomize(this_module) -> None:
    """Import the next ``sitecustomize`` on sys.path after ours (the user's or the environment's), if any."""
    here = os.path.dirname(os.path.abspath(this_module.__file__))
    positions = [i for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == here]
    if not positions:
        return
    saved = [sys.path.pop(i) for i in reversed(positions)]
    del sys.modules["sitecustomize"]
    try:
        import sitecustomize  # noqa: F401 - the next one on the path, if any
    except ImportError as e:
        if e.name != "sitecustomize":
            raise  # the user's sitecustomize itself failed: show it, as Python would
        sys.modules["sitecustomize"] = this_module
    finally:
        for i, p in zip(sorted(positions), reversed(saved)):
            sys.path.insert(i, p)


def environment(options: dict, log_level: str | None, environ: dict | None = None) -> dict:
    """The environment for the command: bootstrap first on PYTHONPATH, the options as variables."""
    env = dict(os.environ if environ is None else environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + path if path else "")
    env[ENABLE] = "1"
    for name, value in options.items():
        env[env_name(name)] = "auto" if value is None else str(value).lower()
    if log_level:
        env[LOG_LEVEL] = log_level
    return env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddp-patches-run",
        description="Run a command with ddp_patches.apply() in every Python process it starts.",
        epilog="example: ddp-patches-run --offload false torchrun --nproc_per_node=2 train.py",
    )
    for name in OPTIONS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE",
                            help=f"apply({name}=...); also {env_name(name)}")
    parser.add_argument("--log-level", help="show ddp_patches log lines from this level (e.g. INFO)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, e.g. torchrun ...")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: expected e.g. `ddp-patches-run torchrun --nproc_per_node=2 train.py`")
    given = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    try:
        options = parse_options(given, lambda name: "--" + name.replace("_", "-"))
    except ValueError as e:
        parser.error(str(e))
    if args.log_level and not isinstance(logging.getLevelName(args.log_level.upper()), int):
        parser.error(f"--log-level {args.log_level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    executable = shutil.which(command[0])
    if executable is None:
        parser.error(f"command not found: {command[0]!r}")
    os.execve(executable, command, environment(options, args.log_level))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
