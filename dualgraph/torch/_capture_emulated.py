"""The ``"emulate"`` backend's capture: static buffers and an :class:`EmulatedReplay`, no graph.

Each callable is warmed up (``_warmup.py``), run once more to lay out its static outputs and
grad buffers, and given an :class:`EmulatedReplay` that re-runs it on those buffers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ._capture_failure import Progress
from ._capture_state import _Capture, grad_output_buffers
from ._layouts import empty_laid_out_like
from ._probe import raise_on_lint_errors
from ._replay_backends import EmulatedReplay
from ._warmup import module_tensors_kept, warmup, watches_held

if TYPE_CHECKING:
    from ._capture import CaptureOptions

__all__ = ["capture_emulated"]


def _saved_own_outputs(item: _Capture) -> tuple[int, ...]:
    """The outputs the backward reads that a replay hands out as its own static outputs (not
    those handed out as an input, a module tensor or a view of another output)."""
    aliases = item.output_aliases
    handed = aliases.handed_out if aliases is not None else frozenset()
    return tuple(i for i in item.saved_outputs if i not in handed)


def capture_emulated(
    captures: Sequence[_Capture], options: CaptureOptions, progress: Progress
) -> None:
    for item in captures:
        progress.name = item.name
        start = time.perf_counter()
        if item.like is None:
            progress.phase = "warmup"
            grads: tuple[torch.Tensor | None, ...] = ()
            with watches_held(), module_tensors_kept(item):
                for i in range(max(1, options.num_warmup_iters)):
                    with item.probe:  # issue 19 hook: observes the first iteration only
                        grads = warmup(item, options.allow_unused_input, inspect=i == 0)
            raise_on_lint_errors([item.probe])  # issue 19 hook
            item.warmup_grads = tuple(None if g is None else g.detach() for g in grads)
        else:
            item.learn_from(item.like)
        progress.phase = "capture"
        with torch.enable_grad(), item.request.hooks.around("forward"):
            flat = item.record_outputs(item.run())
        donor = item.buffers_from
        item.static_outputs = (
            donor.static_outputs if donor is not None else tuple(map(empty_laid_out_like, flat))
        )
        item.grad_outputs = grad_output_buffers(item, flat)
        del flat
        # the outputs handed out as another tensor are left out, as in a CUDA capture
        taken = item.backward_outputs
        diff_inputs = item.diff_inputs()
        if item.grad_outputs and diff_inputs:
            item.place_grads(item.grad_buffers(item.warmup_grads))
        n = len(item.grad_input_indices)
        targets = tuple(item.input_grads[i] for i in item.grad_input_indices)
        targets += item.param_grads or (None,) * len(item.params)
        accumulators = (None,) * n + (item.fused_accumulators or (None,) * len(item.params))
        assert item.out_spec is not None
        replay = EmulatedReplay(
            fn=item.request.hooks.wrap(item.request.fn),
            static_args=item.static_args,
            static_kwargs=item.static_kwargs,
            out_spec=item.out_spec,
            static_outputs=item.static_outputs,
            diff_outputs=tuple(item.diff_outputs[k] for k in taken),
            diff_inputs=diff_inputs,
            grad_outputs=tuple(item.grad_outputs[k] for k in taken),
            grad_targets=targets,
            accumulators=accumulators,
            allow_unused=options.allow_unused_input or len(taken) < len(item.diff_outputs),
            hooked_params=item.params if options.param_grads != "in_graph" else (),
            saved_outputs=_saved_own_outputs(item),
        )
        item.replay_forward = replay.forward
        item.replay_backward = replay.backward
        item.seconds = time.perf_counter() - start
