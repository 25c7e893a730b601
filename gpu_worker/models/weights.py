"""Copying a checkpoint's HF-named tensors into a model's parameters, fusing the
projections the model keeps as one matrix (q/k/v, gate/up). Every family uses it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from gpu_worker.ops.linear import StackedParams


@torch.no_grad()
def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams,
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy each tensor into the parameter of its name, or into its rows of a fused one
    (`stacked`); tensors `skip` names are dropped. Every parameter, and every row range of
    a fused one, must be written exactly once."""
    params = dict(model.named_parameters())
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, stacked)) + r")\.")
    written: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        match = pattern.search(name) if stacked else None
        if match is None:
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            _copy(params[name], tensor, name)
            written.add(name)
            continue
        part = match.group(1)
        fused, start, end = stacked[part]
        target = name.replace(part, fused)
        _copy(params[target][start:end], tensor, name)
        written.add(f"{target}#{part}")
    missing = sorted(_expected(params, stacked) - written)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


def _expected(params: Iterable[str], stacked: StackedParams) -> set[str]:
    """What a complete checkpoint writes: each plain parameter, each part of a fused one."""
    expected: set[str] = set()
    for pname in params:
        parts = [part for part, (fused, _, _) in stacked.items() if f".{fused}." in pname]
        if parts:
            expected.update(f"{pname}#{part}" for part in parts)
        else:
            expected.add(pname)
    return expected


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)
