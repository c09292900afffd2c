"""The batch-variance and determinism checks of
:class:`~paraprop.diffusion.chain.DiffusionChain` (a part of it), and the errors they raise.

A parallel method evaluates the model on ``n * B`` rows where the loop has ``B``: a kernel that
rounds a row by the batch around it gives other bits (batch variance), and a model that is not a
fixed function of its input (train-mode dropout) gives other values. The chain compares step 0's
model output on the loop's rows with the first batched call's (:meth:`_compare_step0`), and
:meth:`BatchVarianceChecks.diagnose` tells the two apart by the size of a difference.
"""

from __future__ import annotations

from typing import Any

import torch

from paraprop.errors import NonFiniteError, StochasticModelError

# batch variance explains differences of at most this many units of the dtype's resolution,
# and of this share of the outputs' size (:func:`stochastic_level`)
STOCHASTIC_ULPS = 64
STOCHASTIC_REL = 1 / 64
# a difference above this many units (relative) is checked by evaluating the same rows again
AMBIGUOUS_ULPS = 16


class BatchVarianceChecks:
    """The checks part of :class:`~paraprop.diffusion.chain.DiffusionChain` (a mixin: the
    attributes below are the chain's)."""

    B: int
    dtype: torch.dtype
    sample_shape: tuple[int, ...]
    model_shape: tuple[int, ...]
    x_init: torch.Tensor
    exact_values: torch.Tensor
    irreproducible: torch.Tensor
    diagnosed: bool
    loop_out: torch.Tensor | None
    loop_gap: torch.Tensor | None
    loop_diff: torch.Tensor | None
    cap: int | None
    model_calls: int
    scaled: bool
    table: Any
    timesteps: torch.Tensor
    _step0_input: torch.Tensor | None
    _gaps: list[torch.Tensor]
    _recompute_gap: torch.Tensor

    def call_model(self, x: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
        raise NotImplementedError   # (the chain's)

    def _compare_step0(self, out: torch.Tensor, n: int) -> None:
        """Step 0's model output on the loop's ``B`` rows (the first call of a parallel solve)
        is kept; the first batched call that computes step 0 again from the same input is
        compared with it: a difference is the model's batch variance (``loop_gap``)."""
        if n == 1:
            if self.loop_out is None:
                self.loop_out = out.clone()
            return
        if self.loop_out is None or self.loop_gap is not None:
            return
        assert self._step0_input is not None   # (steps() keeps it before any call of step 0)
        same_input = torch.eq(self._step0_input, self.x_init).all()
        diff = out.to(torch.float64) - self.loop_out.to(torch.float64)
        gap = diff.abs().max()
        self.loop_gap = torch.where(same_input, gap, 0.0)
        self.loop_diff = torch.where(same_input, diff, 0.0)
        self.irreproducible = self.irreproducible | (self.loop_gap != 0)

    def diagnose(self) -> None:
        """A step computed again gave other bits (:attr:`irreproducible`): batch variance of
        the model's kernels, or a model that is not a fixed function of its input. Tell them
        apart by the size of the difference (relative to the values' size: step 0's model
        output between the loop's call and a batched one, and any certified step computed
        again): beyond :func:`stochastic_level` no rounding explains it; above
        :data:`AMBIGUOUS_ULPS` units of the dtype, the loop's first call (the initial noise at
        the first timestep, ``B`` rows) is evaluated once more, one model call, counted
        (where the budget has it), and any difference from the first evaluation of the same
        rows in the same batch shape settles it. Raises
        :class:`~paraprop.StochasticModelError` naming the likely cause."""
        self.diagnosed = True
        gap = 0.0 if self.loop_gap is None else float(self.loop_gap)
        scale = 1e-30 if self.loop_out is None else \
            float(self.loop_out.abs().max().nan_to_num(0, 0, 0).clamp(min=1e-30))
        size = float(self.exact_values.abs().max().nan_to_num(0, 0, 0).clamp(min=1.0))
        rel = max(gap / scale, float(self.recompute_gap) / size)
        eps = torch.finfo(self.dtype).eps
        if rel > stochastic_level(self.dtype):
            raise _stochastic(
                f"a step computed again (in a batch of other rows) differs by {rel:.3g} of "
                f"the values' size, far beyond the rounding differences of batch-variant "
                f"kernels in {self.dtype} (at most {stochastic_level(self.dtype):.3g})")
        if self.loop_out is None or rel <= AMBIGUOUS_ULPS * eps or \
                (self.cap is not None and self.model_calls >= self.cap):
            return
        rows = self.x_init[None]
        if self.scaled:
            rows = self.table.model_input(0, 1, rows)
        rows = rows.reshape(self.model_shape)
        again = self.call_model(rows, self.timesteps[:1].repeat_interleave(self.B), 1)
        ref = self.loop_out
        same = (again == ref) | (again.isnan() & ref.isnan())
        if not bool(same.all()):
            diff = float((again.to(torch.float64) - ref.to(torch.float64)).abs()
                         .nan_to_num(nan=torch.inf, posinf=torch.inf).max())
            raise _stochastic(f"evaluating the loop's first step again on the same {self.B} "
                              f"rows gave other values (largest difference {diff:.3g}, "
                              f"outputs of size {scale:.3g})")

    @property
    def recompute_gap(self) -> torch.Tensor:
        """0-d float64: the largest difference of a certified step computed again (NaN
        propagating; :meth:`diagnose`)."""
        if self._gaps:
            gaps = torch.stack(self._gaps).to(torch.float64).max()
            self._recompute_gap = torch.maximum(self._recompute_gap, gaps)
            self._gaps = []
        return self._recompute_gap



def nonfinite_error(step: int, sample: int) -> NonFiniteError:
    return NonFiniteError(
        f"diffusion.sample: step {step} of sample {sample} is not finite (NaN or inf), computed "
        "by the scheduler's step from an exact input: the diffusers loop gives the same value; "
        "check the model and the dtype's range (float16 overflows above 65504)")


def check_steps_finite(X: torch.Tensor, start: int = 0) -> None:
    """Raise :class:`NonFiniteError` naming the first step ``>= start`` of ``X`` ``(B, N, F)``
    with a non-finite value."""
    tail = X[:, start:]
    if bool(torch.isfinite(tail).all()):
        return
    bad = (~torch.isfinite(tail)).any(2)
    step = start + int(bad.any(0).nonzero()[0])
    b = int(bad[:, step - start].nonzero()[0])
    raise nonfinite_error(step, b)


def stochastic_level(dtype: torch.dtype) -> float:
    """The largest difference (per unit of the outputs' size) between a model's output for
    the same rows in batches of different sizes that batch-variant kernels can explain in
    ``dtype``: :data:`STOCHASTIC_ULPS` units of its resolution, and at least
    :data:`STOCHASTIC_REL`."""
    return max(STOCHASTIC_ULPS * torch.finfo(dtype).eps, STOCHASTIC_REL)


def _stochastic(what: str) -> StochasticModelError:
    return StochasticModelError(
        f"diffusion.sample: the model is not a fixed function of its input: {what}. The likely "
        "cause is a module in train mode (dropout or other random layers, such as "
        "torch.randn_like in its forward): call model.eval() first (for a module wrapped in a "
        "lambda or functools.partial, on the module itself); nondeterministic kernels of a "
        "model in eval mode are the other one (torch.use_deterministic_algorithms(True)). "
        "Two evaluations of the same input differ, so there is no sequential result to "
        "reproduce")




__all__ = ["AMBIGUOUS_ULPS", "STOCHASTIC_REL", "STOCHASTIC_ULPS", "BatchVarianceChecks",
           "check_steps_finite", "nonfinite_error", "stochastic_level"]
