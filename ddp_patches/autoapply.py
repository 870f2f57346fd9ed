"""``ddp-patches-run [options] <command ...>``: apply() in every Python process a command starts, no code change.

In the style of ``opentelemetry-instrument`` and ``ddtrace-run``: the command runs with ``ddp_patches/_bootstrap``
first on PYTHONPATH, ``DDP_PATCHES_APPLY=1``, and each option (apply()'s keywords, declared in
``ddp_patches/options.py``, plus ``--log-level``) as a ``DDP_PATCHES_*`` variable, which is what the child
processes read (docs/options.md).
The ``sitecustomize`` there runs at start-up in every process (NOTE [A start-up hook in every interpreter]) and
calls ``bootstrap()``, which applies once torch is imported (NOTE [Apply when torch is imported]).
``--print-env [sh|dotenv]`` prints the variables instead (NOTE [One switch for a whole launch]).
Entry points: ``main()`` (the console script), ``bootstrap()``, ``environment()``, ``print_env()``.
"""

from __future__ import annotations

import os
import sys
import types
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at start-up

from . import options as _options
from ._after_import import AfterImport

if TYPE_CHECKING:
    import argparse
    from typing import Callable

# Only os, sys, types and ddp_patches.options (which imports nothing) at module level: this module loads at start-up
# in every process of a launch, also in those that never import torch (NOTE [Apply when torch is imported]);
# argparse, logging, shlex and shutil load where they are used.

ENABLE = "DDP_PATCHES_APPLY"
LOG_LEVEL = "DDP_PATCHES_LOG_LEVEL"
PREFIX = _options.ENV_PREFIX
NAMED = "DDP_PATCHES_UNKNOWN_NAMED"  # set where unknown variables were named: the launch's later processes stay quiet
# Variables with the prefix that something other than an option reads: the validation harness's device choice, and
# what this project's own tests and tools set.
OTHER_VARIABLES = frozenset({ENABLE, LOG_LEVEL, NAMED, "DDP_PATCHES_DEVICE", "DDP_PATCHES_TEST_RUN",
                             "DDP_PATCHES_CI_VENV", "DDP_PATCHES_RECORD_USER_REPORTS"})
# Where a launcher says which rank a process is, in the order they are read (torchrun, Slurm, Open MPI, MPICH).
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


# apply() keyword -> its declaration (ddp_patches/options.py): how its flag and variable are named and parsed.
OPTIONS = _options.BY_NAME


def env_name(option: str) -> str:
    return _options.BY_NAME[option].env


def parse_options(raw: dict[str, str], spell: Callable[[str], str]) -> dict:
    """apply() keywords from their text values; a bad one raises ValueError naming it as ``spell(name)`` does."""
    options = {}
    for name, text in raw.items():
        try:
            options[name] = OPTIONS[name].parse(text)
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
# Invariant: a process started by the runner is patched before any user line can build a Trainer or DDP, and a
# process that never imports torch pays nothing (apply() at start-up would import torch in every process).
# Rule: the start-up hook installs a one-shot meta-path finder that wraps the torch loader's ``exec_module`` and
# calls apply() right after torch's own __init__ has run; every patch looks its targets up at call time, so
# nothing is missed by waiting. This module imports only os, sys and types at module level, for the same reason.
# Test: tests/test_autoapply.py::test_applies_after_torch_is_imported_with_the_options
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §3
class _ApplyAfterTorchImport(AfterImport):
    """A ``sys.meta_path`` finder: run ``callback`` once torch's module body has executed (``_after_import``)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        super().__init__("torch", callback)


def apply_from_env() -> None:
    """apply() with the options in the environment."""
    level = os.environ.get(LOG_LEVEL)
    if level:
        _show_logs(level)
    import ddp_patches

    ddp_patches.apply(**options_from_env())


# NOTE [Import-safe at torch import]
# Invariant: applying at torch's import never re-enters a half-initialised module. torch is often imported inside
# another import: ``import ddp_patches`` (apply() would re-enter ddp_patches.api: "partially initialized module"),
# or ``import transformers`` / ``accelerate`` / ``trl sft`` (apply(tiled_mlp=True) imports transformers).
# Rule: apply at once only when torch is the outermost import still executing; otherwise defer apply() to its
# first use, which always comes after the imports: the creation of the process group (every patch acts only when
# distributed), the construction of a DDP, or the script's own apply(). Until then three thin stand-ins
# (init_process_group, twice, and DDP.__init__) wait; the first one called settles: it puts back the originals and
# applies before it hands the call on (NOTE [A deferred apply() settles first]).
# Test: tests/test_autoapply.py::test_libraries_imported_before_torch_with_tiled_mlp
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §3
def _import_in_progress() -> bool:
    """True while a module other than torch is still executing its body: we are inside someone's import."""
    for name, module in list(sys.modules.items()):
        if name == "torch" or name.startswith("torch."):
            continue
        if getattr(_spec_of(module), "_initializing", False):
            return True
    return False


def _spec_of(module):
    """A module's ``__spec__`` without running it: reading an attribute of a lazily loaded module
    (importlib.util.LazyLoader, the lazy_loader package) executes its body, which may raise."""
    try:
        return types.ModuleType.__getattribute__(module, "__spec__")
    except Exception:  # noqa: BLE001 -- not a module (some libraries put other objects in sys.modules)
        return None


def apply_after_torch_import() -> None:
    """What the start-up hook runs once torch is imported (NOTE [Import-safe at torch import])."""
    if not _import_in_progress():
        apply_from_env()
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.nn.parallel import DistributedDataParallel

    from ._registry import REGISTRY

    targets = ((dist, "init_process_group"), (distributed_c10d, "init_process_group"),
               (DistributedDataParallel, "__init__"))
    for owner, name in targets:
        REGISTRY.install(owner, name, _stand_in(owner, name))
    REGISTRY.defer(apply_from_env, *targets)  # NOTE [A deferred apply() settles first]


def _stand_in(owner, name: str):
    def make(original):
        settled = []

        def first_use(*args, **kwargs):
            if settled:  # reached again through a wrapper someone put around this stand-in: the original is next
                return original(*args, **kwargs)
            settled.append(True)
            from ._registry import REGISTRY

            REGISTRY.settle()
            return getattr(owner, name)(*args, **kwargs)  # the original, or apply()'s patch of it

        first_use.__name__ = getattr(original, "__name__", name)
        first_use.__qualname__ = getattr(original, "__qualname__", name)
        return first_use

    return make


def _show_logs(level: str) -> None:
    import logging

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
    try:  # a bad value stops this process here, naming the variable (an exception would only be printed by
        check_environment()  # site.py as "Error in sitecustomize", and the script would run unpatched)
    except ValueError as e:
        sys.stderr.write(f"{e}\n")
        sys.stderr.flush()
        os._exit(2)
    _name_unknown_variables(os.environ)
    if "torch" in sys.modules:  # imported by a .pth file before us: apply now
        apply_from_env()
    else:
        sys.meta_path.insert(0, _ApplyAfterTorchImport(apply_after_torch_import))


def check_environment(environ: dict | None = None) -> dict:
    """The options in the environment, and its log level; a bad value raises ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    level = environ.get(LOG_LEVEL)
    if level and not _is_level(level):
        raise ValueError(f"ddp_patches: {LOG_LEVEL}={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    return options_from_env(environ)


def unknown_variables(environ: dict) -> list[str]:
    """A line for each ``DDP_PATCHES_*`` variable that nothing reads: a misspelt option is not silently ignored."""
    import difflib

    known = sorted({env_name(name) for name in OPTIONS} | OTHER_VARIABLES)
    lines = []
    for name in sorted(k for k in environ if k.startswith(PREFIX) and k not in known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        hint = f"did you mean {close[0]}?" if close else "the variables are listed in docs/options.md"
        lines.append(f"ddp_patches: {name} is not a variable ddp_patches reads, so it changes nothing ({hint})")
    return lines


def _name_unknown_variables(environ) -> None:
    """One WARNING line per unknown variable, once per launch: in its first process (a launcher's agent, or rank 0
    where no launcher process ran this), not again in the processes it starts (they inherit ``NAMED``)."""
    rank = next((environ[v] for v in RANK_VARIABLES if v in environ), None)
    if environ.get(NAMED) or rank not in (None, "0"):
        return
    lines = unknown_variables(environ)
    if not lines:
        return
    level = environ.get(LOG_LEVEL)
    if not (level and _is_level(level) and _level_number(level) > 30):  # 30: WARNING; quieter levels hide it
        for line in lines:
            sys.stderr.write(f"WARNING {line}\n")
    environ[NAMED] = "1"


def _level_number(text: str) -> int:
    import logging

    return logging.getLevelName(text.strip().upper())


def _is_level(text: str) -> bool:
    import logging

    return isinstance(logging.getLevelName(text.strip().upper()), int)


def environment(options: dict, log_level: str | None, environ: dict | None = None) -> dict:
    """The environment for the command: bootstrap first on PYTHONPATH, the options as variables."""
    env = dict(os.environ if environ is None else environ)
    path = env.get("PYTHONPATH", "")
    if path.split(os.pathsep)[0] != BOOTSTRAP_DIR:  # already first (a nested run, an exported --print-env): keep
        env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + path if path else "")
    env[ENABLE] = "1"
    for name, value in options.items():
        env[env_name(name)] = "auto" if value is None else str(value).lower()
    if log_level:
        env[LOG_LEVEL] = log_level
    return env


# NOTE [One switch for a whole launch]
# Invariant: what ddp-patches-run gives its command is only environment (``environment()``), so a launch that no
# command prefix reaches (an sbatch script whose ``srun`` starts the ranks, a tool that calls torchrun itself on
# every node, DeepSpeed's pdsh launcher) is switched by exporting the same variables once for the whole job.
# Rule: ``--print-env`` prints every one of them (``eval "$(ddp-patches-run --print-env)"``); unset, nothing runs at
# start-up (no .pth file, nothing written into site-packages). DeepSpeed's pdsh runner forwards only variables
# named in ``.deepspeed_env`` (or prefixed PYTHON, MV2, UCX...), where PYTHONPATH alone would leave the hook
# silent, so ``--print-env dotenv`` writes that file's KEY=VALUE form.
# Test: tests/test_autoapply.py::test_print_env_switches_every_process_of_a_launch
# Design: DDP_GRADIENT_CHECKPOINTING_FIX.md §3
def print_env(options: dict, log_level: str | None, form: str, environ: dict | None = None) -> str:
    """Every variable the switched processes read -- PYTHONPATH and each ``DDP_PATCHES_*``, also those already set
    here (a file for other nodes must hold them all) -- as shell exports (``sh``) or KEY=VALUE lines (``dotenv``)."""
    import shlex

    after = environment(options, log_level, dict(os.environ if environ is None else environ))
    first = ("PYTHONPATH", ENABLE)
    wanted = [(k, after[k]) for k in first] + sorted((k, v) for k, v in after.items()
                                                     if k.startswith(PREFIX) and k not in first)
    if form == "dotenv":
        return "".join(f"{k}={v}\n" for k, v in wanted)
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in wanted)


def _parser() -> argparse.ArgumentParser:
    import argparse

    parser = argparse.ArgumentParser(
        prog="ddp-patches-run",
        description="Run a command with ddp_patches.apply() in every Python process it starts.",
        epilog="example: ddp-patches-run --offload false torchrun --nproc_per_node=2 train.py",
    )
    for name in OPTIONS:
        option = OPTIONS[name]
        parser.add_argument(option.flag, dest=name, metavar="VALUE",
                            help=f"apply({name}=...): {option.values().replace('`', '')}; also {option.env}")
    parser.add_argument("--log-level", help="show ddp_patches log lines from this level (e.g. INFO)")
    parser.add_argument("--print-env", nargs="?", const="sh", choices=("sh", "dotenv"),
                        help="print the variables instead of running a command: `export K=V` lines for "
                             "eval \"$(ddp-patches-run --print-env)\" (sh), or K=V lines for .deepspeed_env (dotenv)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, e.g. torchrun ...")
    return parser


def _not_a_command(name: str) -> str:
    if os.path.isdir(name):
        return "a directory"
    if os.path.exists(name):
        return "a file that is not executable"
    return "no such command on PATH"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.print_env and command:
        parser.error(f"--print-env prints the variables and runs nothing; found a command too: {command[0]!r}")
    if not command and not args.print_env:
        parser.error("no command given: expected e.g. `ddp-patches-run torchrun --nproc_per_node=2 train.py`")
    given = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    try:
        options = parse_options(given, lambda name: OPTIONS[name].flag)
    except ValueError as e:
        parser.error(str(e))
    if args.log_level and not _is_level(args.log_level):
        parser.error(f"--log-level {args.log_level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    # What the command line does not set, the environment does, in every child: check it before launching.
    inherited = {k: v for k, v in os.environ.items()
                 if k.startswith(PREFIX) and k[len(PREFIX):].lower() not in given and not (k == LOG_LEVEL and args.log_level)}
    try:
        check_environment(inherited)
    except ValueError as e:
        parser.error(str(e))
    if args.print_env:
        sys.stdout.write(print_env(options, args.log_level, args.print_env))
        return 0
    import shutil

    executable = shutil.which(command[0])
    if executable is None:
        parser.error(f"expected a command to run (e.g. torchrun); found {_not_a_command(command[0])}: "
                     f"{command[0]!r}")
    os.execve(executable, command, environment(options, args.log_level))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
