"""Readers of the sigma-parameterised (Karras et al. 2022) samplers: ``EulerDiscreteScheduler``,
``EulerAncestralDiscreteScheduler`` and ``HeunDiscreteScheduler``, in the interface of
:mod:`~paraprop.diffusion.readers`.

All three divide the model input by ``(sigma**2 + 1) ** 0.5`` (``scale_model_input``, part of
the step) and read their sigma schedule as set (linear, Karras, exponential, beta sigmas, any
``timestep_spacing``, ``final_sigmas_type``, ``rescale_betas_zero_snr``). Euler and Euler
ancestral compute in float32 (``step()`` upcasts the sample) and return the model's dtype;
Heun computes in the sample's dtype. Euler ancestral draws noise in the model's dtype at every
step. Heun's loop runs ``2N - 1`` iterations for ``N`` steps: even iterations are its first
(Euler) evaluation, odd ones its second (the trapezoidal correction), which reads the first's
derivative and input sample (its record: ``history = 1``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from paraprop.diffusion.readers import Reader, Records, refuse
from paraprop.diffusion.scalars import div, mul, tmul
from paraprop.diffusion.selection import Sel


class _Karras(Reader):
    """What the three share: ``scale_model_input`` (``sample / ((sigma**2 + 1) ** 0.5)`` at
    ``sigmas[k]``), the predicted ``x_0`` of each ``prediction_type``, and its check."""

    PREDICTIONS: ClassVar[tuple[str, ...]] = ()

    def _check_config(self) -> None:
        if self.config.prediction_type not in self.PREDICTIONS:
            raise refuse(self.classname, "prediction_type", self.config.prediction_type,
                         ", ".join(self.PREDICTIONS))

    def _rows(self) -> list[dict[str, torch.Tensor]]:
        s = self.sigmas
        assert s is not None
        return [{"scale": (s[k] ** 2 + 1) ** 0.5} for k in range(self.K)]

    @staticmethod
    def _v(sigma: torch.Tensor) -> dict[str, torch.Tensor]:
        """The coefficients of ``v_prediction``'s ``x_0`` at ``sigma``."""
        return {"v_out": -sigma / (sigma**2 + 1) ** 0.5, "v_x": sigma**2 + 1}

    def scale(self, sel: Sel, x: torch.Tensor) -> torch.Tensor:
        return div(x, self.col("scale", sel, x))

    def _x0(self, sel: Sel, sample: torch.Tensor, out: torch.Tensor,
            sigma: str) -> torch.Tensor:
        """The predicted ``x_0`` (``sigma``: the column epsilon reads)."""
        p = self.config.prediction_type
        if p in ("sample", "original_sample"):
            return out
        if p == "epsilon":
            return sample - mul(self.col(sigma, sel, out), out)
        return tmul(out, self.col("v_out", sel, out)) + div(sample, self.col("v_x", sel, out))

    def output_gains(self) -> torch.Tensor | None:
        """Euler's and Euler ancestral's ``|dt * d derivative / d out|``."""
        if self.history:
            return None
        c = {k: self._cols[k].to(torch.float64) for k in ("sigma_hat", "dt", "v_out")}
        p = self.config.prediction_type
        if p == "epsilon":
            d = torch.ones_like(c["dt"])
        elif p == "v_prediction":
            d = c["v_out"] / c["sigma_hat"]
        else:
            d = 1 / c["sigma_hat"]
        return (c["dt"] * d).abs()

    def _euler(self, sel: Sel, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The Euler step of Euler and Euler ancestral, in float32 (``step()`` upcasts)."""
        sample = x[:, 0].to(torch.float32)
        pred = self._x0(sel, sample, out, "sigma_hat")
        derivative = div(sample - pred, self.col("sigma_hat", sel, sample))
        return sample + tmul(derivative, self.col("dt", sel, sample))


class EulerDiscreteReader(_Karras):
    """``EulerDiscreteScheduler``, ``prediction_type`` ``epsilon``, ``v_prediction``,
    ``sample`` (or ``original_sample``), with ``step()``'s default ``s_churn=0`` (no churn
    noise). Refused: ``s_churn > 0``."""

    classname = "EulerDiscreteScheduler"
    PREDICTIONS = ("epsilon", "v_prediction", "sample", "original_sample")

    def __init__(self, scheduler, num_inference_steps: int, *, mu: float | None = None,
                 device: torch.device | str = "cpu", s_churn: float = 0.0):
        if s_churn != 0.0:
            raise refuse(self.classname, "s_churn", s_churn,
                         "0.0 (the churn noise of step() is not read)")
        super().__init__(scheduler, num_inference_steps, mu=mu, device=device)

    def _read(self) -> None:
        s = self.sigmas
        assert s is not None
        rows = self._rows()
        for k in range(self.K):
            gamma = 0.0   # s_churn == 0
            sigma_hat = s[k] * (gamma + 1)
            rows[k].update(sigma_hat=sigma_hat, dt=s[k + 1] - sigma_hat, **self._v(s[k]))
            self.kinds.append(0)
        self._columns(rows)

    def _apply(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor, rec: Records,
               z: torch.Tensor | None) -> torch.Tensor:
        return self._euler(sel, x, out).to(out.dtype)[:, None]


class EulerAncestralDiscreteReader(_Karras):
    """``EulerAncestralDiscreteScheduler``, ``prediction_type`` ``epsilon`` or
    ``v_prediction`` (diffusers itself raises for ``sample``); noise at every step."""

    classname = "EulerAncestralDiscreteScheduler"
    PREDICTIONS = ("epsilon", "v_prediction")

    def _read(self) -> None:
        s = self.sigmas
        assert s is not None
        rows = self._rows()
        for k in range(self.K):
            sigma_from, sigma_to = s[k], s[k + 1]
            sigma_up = (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5
            sigma_down = (sigma_to**2 - sigma_up**2) ** 0.5
            # (its epsilon and its derivative read sigma itself: "sigma_hat" here)
            rows[k].update(sigma_hat=s[k], dt=sigma_down - s[k], up=sigma_up, **self._v(s[k]))
            self.kinds.append(0)
        self._columns(rows)
        self.noisy = (True,) * self.K

    def _apply(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor, rec: Records,
               z: torch.Tensor | None) -> torch.Tensor:
        assert z is not None, "Euler ancestral steps read their noise"
        prev = self._euler(sel, x, out) + tmul(z, self.col("up", sel, z))
        return prev.to(out.dtype)[:, None]


class HeunDiscreteReader(_Karras):
    """``HeunDiscreteScheduler``, ``prediction_type`` ``epsilon``, ``v_prediction`` or
    ``sample``, with ``clip_sample``. Its ``K = 2N - 1`` iterations alternate the first and
    the second evaluation of a step."""

    classname = "HeunDiscreteScheduler"
    PREDICTIONS = ("epsilon", "v_prediction", "sample")
    history = 1

    def _read(self) -> None:
        s = self.sigmas
        assert s is not None
        rows = self._rows()
        first = True   # state_in_first_order: the scheduler's dt is None
        for k in range(self.K):
            if first:
                sigma, sigma_next = s[k], s[k + 1]
            else:
                sigma, sigma_next = s[k - 1], s[k]
            gamma = 0
            sigma_hat = sigma * (gamma + 1)
            sigma_input = sigma_hat if first else sigma_next
            rows[k].update(sigma_input=sigma_input, div=sigma_hat if first else sigma_next,
                           dt=sigma_next - sigma_hat, **self._v(sigma_input))
            self.kinds.append("first" if first else "second")
            first = not first
        # the second evaluation's dt is the first's (self.dt)
        for k in range(1, self.K, 2):
            rows[k]["dt"] = rows[k - 1]["dt"]
        self._columns(rows)

    def records_like(self, out: torch.Tensor) -> Records:
        return (torch.zeros_like(out), torch.zeros_like(out))

    def _derivative(self, sel: Sel, sample: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        pred = self._x0(sel, sample, out, "sigma_input")
        if cfg.clip_sample:
            pred = pred.clamp(-cfg.clip_sample_range, cfg.clip_sample_range)
        return div(sample - pred, self.col("div", sel, sample))

    def _record(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor) -> Records:
        if kind == "second":   # read by no step
            return (torch.zeros_like(out), torch.zeros_like(out))
        # the first evaluation's derivative and input sample (prev_derivative, self.sample)
        return (self._derivative(sel, x[:, 0], out), x[:, 0])

    def _apply(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor, rec: Records,
               z: torch.Tensor | None) -> torch.Tensor:
        deriv, first_sample = rec
        if kind == "first":
            derivative = sel.take(deriv, 1)
            sample = x[:, 0]
        else:
            derivative = self._derivative(sel, x[:, 0], out)
            derivative = (sel.take(deriv, 0) + derivative) / 2
            sample = sel.take(first_sample, 0)
        prev = sample + tmul(derivative, self.col("dt", sel, sample))
        return prev[:, None]
