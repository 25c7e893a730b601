"""Copying a checkpoint's HF-named tensors into a model's parameters, fusing the
projections the model keeps as one matrix (q/k/v, gate/up). Every family uses it.

A tensor-parallel model (`gpu_worker.distributed.parallelize`) carries a `WeightShard`
that picks the rank's part of each tensor; the checkpoint's tensors may then be lazy
(`TensorSource`, e.g. a safetensors slice) so that only that part is ever read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from gpu_worker.ops.linear import StackedParams

WEIGHT_SHARD_ATTR = "weight_shard"
"""The model attribute holding its `WeightShard`, when it is a rank's shard of a model."""


class TensorSource(Protocol):
    """A checkpoint tensor that indexing reads: a tensor, or a lazy safetensors slice
    (`safe_open(...).get_slice(name)`) that reads only the rows or columns indexed."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class WeightShard(Protocol):
    """The per-tensor shard hook: `(parameter name, rows of it when fused, checkpoint
    tensor) -> (the rank's part, where it goes in the rank's parameter; None: all of it)`,
    or None when the rank keeps nothing of the tensor (a row-parallel bias past rank 0)."""

    def __call__(
        self, param: str, rows: tuple[int, int] | None, full: TensorSource
    ) -> tuple[torch.Tensor, slice | None] | None: ...


@torch.no_grad()
def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams,
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy each tensor into the parameter of its name, or into its rows of a fused one
    (`stacked`); tensors `skip` names are dropped. Every parameter, and every row range of
    a fused one, must be written exactly once. A model carrying a `WeightShard` (under
    `WEIGHT_SHARD_ATTR`) gets the rank's part of each tensor instead."""
    params = dict(model.named_parameters())
    shard: WeightShard | None = getattr(model, WEIGHT_SHARD_ATTR, None)
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, stacked)) + r")\.")
    written: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        match = pattern.search(name) if stacked else None
        if shard is not None:
            _copy_shard(params, stacked, shard, name, tensor, match, written)
            continue
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


def _copy_shard(
    params: dict[str, nn.Parameter],
    stacked: StackedParams,
    shard: WeightShard,
    name: str,
    tensor: TensorSource,
    match: re.Match[str] | None,
    written: set[str],
) -> None:
    """`load_stacked_weights`' step for a rank's shard: the hook reads the rank's part."""
    target, rows, key = name, None, name
    if match is not None:
        part = match.group(1)
        fused, start, end = stacked[part]
        target, rows, key = (
            name.replace(part, fused),
            (start, end),
            f"{name.replace(part, fused)}#{part}",
        )
    if target not in params and not name.endswith(".bias"):
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
    local = shard(target, rows, tensor)
    if local is None:
        return  # e.g. a row-parallel bias, added on rank 0 only
    if target not in params:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
    values, where = local
    _copy(params[target] if where is None else params[target][where], values, name)
    written.add(key)


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
