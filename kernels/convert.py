"""``to_mxfp8_training``: make a whole model train in MXFP8, in place (the trainer's hook).

It swaps layers for their MXFP8 forms from both ``mx`` (``MXLinear`` for ``nn.Linear``)
and ``moe`` (``GroupedExperts`` for a mixture-of-experts expert bank), so it sits above
both: ``moe`` builds on ``mx``, and neither needs this module.

    from opencomposer.kernels.convert import to_mxfp8_training
    model = to_mxfp8_training(model)  # optimizer and state_dict keep working
"""

from __future__ import annotations

from collections.abc import Callable

from opencomposer.kernels import moe
from opencomposer.kernels.mx import BLOCK, Elem, MXLinear, MXTrainingConfig
from torch import nn

SKIPPED_NAMES = frozenset({"lm_head", "gate", "router", "score", "embed_out"})


def default_skip(name: str, module: nn.Module) -> bool:
    """Keep output heads and MoE routers in high precision, as the recipes do."""
    return name.rsplit(".", 1)[-1] in SKIPPED_NAMES


def to_mxfp8_training(
    model: nn.Module,
    *,
    elem: Elem = "e4m3",
    skip: Callable[[str, nn.Module], bool] | None = None,
    config: MXTrainingConfig | None = None,
) -> nn.Module:
    """Make ``model`` train in MXFP8, in place, and return it.

    Swaps every ``nn.Linear`` whose ``in_features`` is a multiple of 32 for an
    ``MXLinear`` that shares its parameters, and every mixture-of-experts expert bank
    (``moe.GroupedExperts`` or transformers' ``MixtralExperts``-style module with
    ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F]) for the MXFP8 grouped
    path. Parameter objects, names and dtypes are unchanged, so an optimizer built
    before the call keeps working and ``state_dict()``/``save_pretrained`` write an
    ordinary checkpoint. ``skip(name, module) -> True`` keeps a module as it is; by
    default ``lm_head`` and routers (``gate``/``router``) are kept, and embeddings are
    never ``nn.Linear``. ``elem`` is the element format of activations and weights;
    ``config`` overrides the whole recipe.
    """
    cfg = config or MXTrainingConfig(elem=elem)
    skip = skip or default_skip
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or skip(name, module):
            continue
        if isinstance(module, MXLinear):
            continue
        if type(module) is nn.Linear and module.in_features % BLOCK == 0:
            swaps.append((name, MXLinear.from_linear(module, cfg)))
        elif moe.GroupedExperts.can_wrap(module):
            swaps.append((name, moe.GroupedExperts.wrap(module, mx=cfg)))
    for name, new in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


def mx_modules(model: nn.Module) -> list[str]:
    """Names of the modules ``to_mxfp8_training`` swapped in (for logs and tests)."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, MXLinear) or (isinstance(m, moe.GroupedExperts) and m.mx is not None)
    ]
