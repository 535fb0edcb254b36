"""The streams between blocks: one batch of one stream (`StreamBatch`), every task's student,
expert and merged-as-given batches entering the next block (`Streams`), and the capture of a
stream's input to a block (layer maps enter a stack with it).

Three streams per task flow between blocks: the *student* (the merged model with the blocks
calibrated so far), the *expert* (the task's expert) and, for the drift report, the merged model
*as given*, which coincides with the student (the same batch objects) until a block is calibrated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class StreamBatch:
    """One batch of one stream between blocks.

    `hidden` is the hidden state entering the next block; `args` / `kwargs` are the other inputs the
    stream's own model passes to its blocks (masks, position biases, ...); `weights` (B, N) are the
    per-token weights of `hidden`'s positions (0 for padding). `extras` is free for layer maps.
    """

    hidden: Tensor
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    weights: Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def with_hidden(self, hidden: Tensor) -> StreamBatch:
        return replace(self, hidden=hidden)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StreamBatch:
        """Every tensor of the batch (also inside args, kwargs and extras) on `device`."""
        from accelerate.utils import send_to_device

        move = lambda obj: send_to_device(obj, device, non_blocking=non_blocking)  # noqa: E731
        return StreamBatch(
            hidden=move(self.hidden),
            args=tuple(move(a) for a in self.args),
            kwargs={k: move(v) for k, v in self.kwargs.items()},
            weights=None if self.weights is None else move(self.weights),
            extras={k: move(v) for k, v in self.extras.items()},
        )

    def pin_memory(self) -> StreamBatch:
        """The batch with every CPU tensor in page-locked memory (faster, asynchronous copies to a GPU)."""
        pin = lambda t: t.pin_memory() if isinstance(t, Tensor) and t.device.type == "cpu" else t  # noqa: E731
        return StreamBatch(
            hidden=pin(self.hidden),
            args=tuple(pin(a) for a in self.args),
            kwargs={k: pin(v) for k, v in self.kwargs.items()},
            weights=pin(self.weights),
            extras={k: pin(v) for k, v in self.extras.items()},
        )


#: task → that task's batches of one stream
TaskStreams = dict[str, list[StreamBatch]]


@dataclass
class Streams:
    """The streams entering the next block (`given` is None without a drift report).

    With held-out examples (`FeatCalConfig.heldout_fraction`) the same three streams flow for them
    beside the calibration streams: `heldout_student`, `heldout_expert` and, with the drift report,
    `heldout_given` (None without held-out examples). They never enter the statistics."""

    student: TaskStreams | None = None
    expert: TaskStreams | None = None
    given: TaskStreams | None = None
    heldout_student: TaskStreams | None = None
    heldout_expert: TaskStreams | None = None
    heldout_given: TaskStreams | None = None

    def add(self, other: Streams) -> None:
        """Take `other`'s tasks into these streams (`given` and the held-out ones: where both have one)."""
        for mine, theirs in ((self.student, other.student), (self.expert, other.expert), (self.given, other.given),
                             (self.heldout_student, other.heldout_student), (self.heldout_expert, other.heldout_expert),
                             (self.heldout_given, other.heldout_given)):
            if mine is not None and theirs is not None:
                mine.update(theirs)


def let_go(batches: list[StreamBatch]) -> Iterator[StreamBatch]:
    """`batches` in order, each taken out of the list as it is handed over (the list ends empty): the
    caller's reference is then a batch's last one, so a batch that has been through a block can go
    before the next one is read."""
    batches.reverse()
    while batches:
        yield batches.pop()


class StopForward(Exception):
    """Raised by a capture hook to end a forward pass once the wanted inputs are stored."""


def capture_first_block_inputs(run_forward: Callable[[], Any], block: nn.Module) -> tuple[tuple, dict]:
    """Run `run_forward()` until `block` is called; return the positional and keyword inputs it got.

    The forward is cut short right there (nothing after the block's input runs).
    """
    captured: dict[str, Any] = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["args"], captured["kwargs"] = args, dict(kwargs)
        raise StopForward

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            run_forward()
    except StopForward:
        pass
    finally:
        handle.remove()
    if "args" not in captured:
        raise RuntimeError(f"the forward pass never reached {type(block).__name__}")
    return captured["args"], captured["kwargs"]


def module_input(args: tuple, kwargs: dict) -> Tensor:
    """The hidden-state input of a module call: its first positional argument or `hidden_states`/`input`."""
    if args:
        return args[0]
    for key in ("hidden_states", "input", "x"):
        if key in kwargs:
            return kwargs[key]
    raise ValueError("cannot find the input tensor of a module call")
