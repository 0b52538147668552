"""The small models of the step benchmark: one per family of tiny ``torch.nn`` model.

Each is a few thousand parameters with a batch of small inputs, so that a data-parallel step's
fixed cost (scatter, the kept replicas re-bound and handed back, gather) is a visible share of
the step: a conv net with BatchNorm (whose buffers every replica but the first gets copies of,
each step), an MLP with LayerNorm and Dropout, and a one-layer LSTM read at its last step.
Adding a family is one entry of :data:`SMALL` (its builder and its batch). The loss of each is
``out.pow(2).mean()``.

>>> import torch
>>> from treegather.benchmarks.small import SMALL
>>> model = SMALL["convbn"].build()
>>> x = SMALL["convbn"].batch(torch.Generator().manual_seed(0), 4)
>>> tuple(model(x).shape), sum(p.numel() for p in model.parameters())
((4, 10), 1610)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["SMALL", "Small"]


@dataclasses.dataclass(frozen=True)
class Small:
    """How to build one small model and a batch of ``rows`` samples for it."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], torch.Tensor]


def _convbn() -> nn.Module:
    """Conv2d-BatchNorm-ReLU twice, global average pooling, a linear head (1,610 parameters)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _images(g: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randn(rows, 3, 16, 16, generator=g)


def _mlp_ln() -> nn.Module:
    """Linear-LayerNorm-ReLU-Dropout twice and a linear head (2,666 parameters)."""
    return nn.Sequential(
        nn.Linear(32, 48),
        nn.LayerNorm(48),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(48, 16),
        nn.LayerNorm(16),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(16, 10),
    )


def _vectors(g: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randn(rows, 32, generator=g)


class _LastStep(nn.Module):
    """A one-layer LSTM over the sequence, a linear head on its last step (1,834 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _sequences(g: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randn(rows, 12, 8, generator=g)


SMALL: dict[str, Small] = {
    "convbn": Small(_convbn, _images),
    "mlp_ln": Small(_mlp_ln, _vectors),
    "lstm": Small(_LastStep, _sequences),
}
