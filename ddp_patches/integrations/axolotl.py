"""The axolotl plugin: one line in the YAML turns the library on in every rank.

    plugins:
      - ddp_patches.integrations.axolotl.DDPPatchesPlugin
    ddp_patches_tiled_mlp: true        # optional: any apply() keyword, prefixed with ddp_patches_

axolotl imports this module by that dotted path (``axolotl.integrations.base.load_plugin``), merges
``DDPPatchesArgs`` into its own config schema (so a wrong value is a validation error naming the key), and calls
``pre_model_load`` in every rank before the model is built: that is where ``ddp_patches.apply()`` runs, with the
options the config gives. Only axolotl imports this module; it needs axolotl and pydantic.
"""

from __future__ import annotations

import logging
import os

from axolotl.integrations.base import BasePlugin

import ddp_patches
from ddp_patches import options as _options

logger = logging.getLogger("ddp_patches")

PREFIX = "ddp_patches_"


# apply()'s keywords as axolotl config keys, with the bounds and choices they are declared with
# (ddp_patches/options.py): a wrong value is axolotl's validation error naming the key.
DDPPatchesArgs = _options.pydantic_model("DDPPatchesArgs", PREFIX, __name__)


def options(cfg) -> dict:
    """The apply() keywords ``cfg`` sets (axolotl's validated config, a dict-like)."""
    return {name[len(PREFIX):]: cfg.get(name) for name in DDPPatchesArgs.model_fields if cfg.get(name) is not None}


class DDPPatchesPlugin(BasePlugin):
    """Calls ``ddp_patches.apply()`` before the model is built, in every process axolotl starts."""

    def get_input_args(self) -> str:
        return f"{__name__}.DDPPatchesArgs"

    def pre_model_load(self, cfg) -> None:
        report = ddp_patches.apply(**options(cfg))
        # every rank says it (INFO; axolotl shows it with LOG_LEVEL=INFO): a rank that did not apply is visible
        logger.info("ddp_patches: applied from axolotl's plugins list (rank %s): %s", os.environ.get("RANK", "0"),
                    report)
