"""apply()'s options declared once (ddp_patches/options.py): the signature, the launcher, the axolotl schema and the
documentation tables all agree with the table."""

from __future__ import annotations

import inspect

import pytest

import ddp_patches
from ddp_patches import autoapply, options
from tools import options_tables


def test_applys_signature_is_the_table():
    """apply() keeps explicit keywords (IDEs and readers see them): their names, order and defaults are the table's."""
    parameters = inspect.signature(ddp_patches.apply).parameters
    assert all(p.kind is p.KEYWORD_ONLY for p in parameters.values())
    assert list(parameters) == [o.name for o in options.OPTIONS]
    assert {name: p.default for name, p in parameters.items()} == options.DEFAULTS


def test_the_modules_defaults_are_the_tables():
    """The constants the patches fall back to when called without apply() (offload's install(), the replica check's
    interval, the guard's choices) are the table's values."""
    from ddp_patches.guard import replica_check, unsynced as guard
    from ddp_patches.offload import offloader

    assert offloader.DEFAULT_MIN_BYTES == options.DEFAULTS["offload_min_bytes"]
    assert offloader.DEFAULT_PREFETCH_DEPTH == options.DEFAULTS["offload_prefetch_depth"]
    assert offloader.DEFAULT_MAX_IN_FLIGHT == options.DEFAULTS["offload_max_in_flight"]
    assert replica_check.DEFAULT_REPLICA_CHECK_EVERY == options.DEFAULTS["replica_check_every"]
    assert guard.ON_UNSYNCED_CHOICES == options.BY_NAME["on_unsynced"].choices


@pytest.mark.parametrize("option", options.OPTIONS, ids=lambda o: o.name)
def test_each_option_round_trips_through_the_launchers_variables(option):
    """The default passes apply()'s check; every value a flag takes comes back equal from the variable the runner
    sets for it (``environment()``, then ``options_from_env()``)."""
    assert option.check(option.default) == option.default
    values = {"bool": (True, False), "choice": (*option.legacy, *option.choices)}.get(option.kind)
    if values is None:
        values = (option.least, option.least + 7) + ((None,) if option.automatic else ())
    for value in values:
        env = autoapply.environment({option.name: value}, None, environ={})
        assert autoapply.options_from_env(env) == {option.name: value}, (value, env[option.env])


@pytest.mark.parametrize("option", options.OPTIONS, ids=lambda o: o.name)
def test_a_bad_value_says_expected_found_and_what_to_do(option):
    bad = "sometimes" if option.kind != "int" else option.least - 1
    with pytest.raises((TypeError, ValueError)) as caught:
        ddp_patches.apply(**{option.name: bad})
    message = str(caught.value)
    assert message.startswith(f"ddp_patches.apply({option.name}=...) expects {option.expects()}, got {bad!r}; "
                              "leave it out for the default"), message
    assert "\n" not in message and not ddp_patches.is_applied()
    with pytest.raises(ValueError, match=f"^ddp_patches: {option.env}='sometimes' is not valid: expected "):
        autoapply.options_from_env({option.env: "sometimes"})


def test_the_documentation_tables_are_rendered_from_the_table():
    """README's options table, docs/options.md's signature and its flag/variable table: regenerate with
    ``python -m tools.options_tables`` after changing ddp_patches/options.py."""
    assert options_tables.differences() == []


def test_a_page_that_differs_from_the_table_is_named(tmp_path, monkeypatch, capsys):
    page = tmp_path / "README.md"
    page.write_text(options_tables.readme_table().replace("| 100 |", "| 50 |"))
    monkeypatch.setitem(options_tables.BLOCKS, "options", (str(page), options_tables.readme_table))
    assert options_tables.main(["--check"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "block options differs from ddp_patches/options.py" in line and "run python -m tools.options_tables" in line


def test_the_axolotl_schema_is_built_from_the_table():
    """The plugin's pydantic model (ddp_patches/integrations/axolotl.py builds it so): one optional key per
    keyword, the table's bounds and choices; the full plugin is tested in axolotl's venv (tests/test_axolotl.py)."""
    pydantic = pytest.importorskip("pydantic")
    model = options.pydantic_model("DDPPatchesArgs", "ddp_patches_", __name__)
    assert list(model.model_fields) == ["ddp_patches_" + o.name for o in options.OPTIONS]
    assert model().model_dump() == {"ddp_patches_" + o.name: None for o in options.OPTIONS}
    good = {"ddp_patches_tiled_mlp_shard_tokens": 1, "ddp_patches_on_unsynced": "raise", "ddp_patches_offload": True,
            "ddp_patches_replica_check_every": 0}
    assert model(**good).ddp_patches_on_unsynced == "raise"
    for key, bad in (("ddp_patches_on_unsynced", "loud"), ("ddp_patches_tiled_mlp_shard_tokens", 0),
                     ("ddp_patches_offload_prefetch_depth", 0), ("ddp_patches_offload_min_bytes", -1),
                     ("ddp_patches_offload", "auto"), ("ddp_patches_replica_check_every", True)):
        with pytest.raises(pydantic.ValidationError, match=key):
            model(**{key: bad})
