"""Replace a model's ``nn.Linear`` layers by faster equivalents, each checked on a probe first.

Used by the loader's weight packings (``packed_linear``: bf16, and fp32 on non-Intel AVX-512
CPUs, for oneDNN; ``panel_linear``: fp32 panels for a C kernel). A layer is swapped only when the
new module's product on a few random rows matches the plain one within the packing's own
tolerance; the first refusal or mismatch stops the swap there, the layers not yet swapped
staying plain.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn


def matches(plain: nn.Linear, swapped: nn.Module, tolerance: float) -> bool:
    """``swapped`` gives ``plain``'s product on 7 random rows within ``tolerance`` of the largest
    value."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, plain.in_features, generator=g).to(plain.weight.dtype)
    with torch.inference_mode():
        want = nn.functional.linear(x, plain.weight, plain.bias).float()
        got = swapped(x).float()
    scale = want.abs().max().clamp_min(1e-6)
    return got.shape == want.shape and bool(((got - want).abs().max() / scale) <= tolerance)


def swap_linears(
    model: nn.Module,
    make: Callable[[nn.Linear], nn.Module],
    tolerance: float,
    what: str,
    logger: logging.Logger,
) -> int:
    """Replace every ``nn.Linear`` of ``model`` by ``make(layer)``, one at a time (never two
    copies of every weight); returns how many were replaced. ``what`` names the packing in the
    warnings."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    replaced = 0
    for parent, name, child in targets:
        try:
            swapped = make(child)
            ok = matches(child, swapped, tolerance)
        except Exception as exc:  # noqa: BLE001 - any refusal (oneDNN, the kernel): keep it plain
            logger.warning("linear weights not %s (%s): plain linear runs", what, exc)
            return replaced
        if not ok:
            logger.warning(
                "linear weights not %s: the product differs from the plain one on %s.%s; "
                "plain linear runs",
                what,
                type(parent).__name__,
                name,
            )
            return replaced
        setattr(parent, name, swapped)
        replaced += 1
    return replaced
