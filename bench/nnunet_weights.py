"""nnui's plain U-Net tensors under nnU-Net's names (dynamic_network_architectures'
PlainConvUNet), so both predictors can run the same trained weights in a benchmark.

The two networks are the same graph (conv -> instance norm -> LeakyReLU blocks, transposed
convs, 1x1 heads) with other module paths. nnU-Net's state dict names each conv and norm
twice (`convs.B.conv` and `convs.B.all_modules.0`, the same parameter) and repeats the
encoder under `decoder.encoder`; every one of its keys is mapped here, so a strict
load_state_dict checks that nothing is missing or left over.
"""

from __future__ import annotations

import re

# nnU-Net key -> (nnui key template); groups: stage, block, module, tensor.
_RULES = (
    (re.compile(r"^(?:decoder\.)?encoder\.stages\.(\d+)\.0\.convs\.(\d+)\.(conv|norm|all_modules\.[01])\.(\w+)$"),
     "encoder.{0}.{1}.{2}.{3}"),
    (re.compile(r"^decoder\.stages\.(\d+)\.convs\.(\d+)\.(conv|norm|all_modules\.[01])\.(\w+)$"),
     "decoder.{0}.{1}.{2}.{3}"),
    (re.compile(r"^decoder\.transpconvs\.(\d+)\.(\w+)$"), "upsample.{0}.{1}"),
    (re.compile(r"^decoder\.seg_layers\.(\d+)\.(\w+)$"), "heads.{0}.{1}"),
)  # fmt: skip
_MODULE = {"conv": "0", "norm": "1", "all_modules.0": "0", "all_modules.1": "1"}


def nnui_key(nnunet_key: str) -> str:
    """The nnui tensor behind one of nnU-Net's keys (KeyError: not a plain U-Net key)."""
    for pattern, template in _RULES:
        match = pattern.match(nnunet_key)
        if match is None:
            continue
        parts = list(match.groups())
        if len(parts) == 4:
            parts[2] = _MODULE[parts[2]]
        return template.format(*parts)
    raise KeyError(f"no nnui tensor for nnU-Net's {nnunet_key}")


def to_nnunet(nnui_state: dict, nnunet_keys: list[str]) -> dict:
    """nnU-Net's state dict (its keys, in its order) filled from nnui's tensors."""
    return {key: nnui_state[nnui_key(key)] for key in nnunet_keys}
