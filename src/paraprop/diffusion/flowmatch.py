"""Readers of the one-evaluation samplers beyond DDPM/DDIM: ``FlowMatchEulerDiscreteScheduler``
(rectified flow / flow matching: SD3, Flux; ``shift``, dynamic shifting with ``mu``,
``stochastic_sampling``) and ``LCMScheduler`` (latent consistency models), in the interface of
:mod:`~paraprop.diffusion.readers`.

Flow matching is an Euler step of an ODE in float32 (``step()`` upcasts the sample), returned in
the model's dtype; with ``stochastic_sampling`` it re-noises the predicted ``x_0`` at every step
with float32 noise. LCM maps each input to its consistency estimate and re-noises it to the next
timestep with noise of the model's dtype, at every step but the last. Neither reads history.
"""

from __future__ import annotations

from typing import Any

import torch

from paraprop.diffusion.gains import x0_gain
from paraprop.diffusion.readers import Reader, Records, refuse
from paraprop.diffusion.scalars import div, mul
from paraprop.diffusion.selection import Sel


class FlowMatchEulerDiscreteReader(Reader):
    """``FlowMatchEulerDiscreteScheduler`` with any sigma schedule it sets (``shift``,
    ``use_dynamic_shifting`` with ``mu``, ``shift_terminal``, ``invert_sigmas``, Karras /
    exponential / beta sigmas, ``time_shift_type``) and ``stochastic_sampling``. ``step()``'s
    ``per_token_timesteps`` is not read (the pipelines do not pass it)."""

    classname = "FlowMatchEulerDiscreteScheduler"

    def _read(self) -> None:
        s = self.sigmas
        assert s is not None
        rows = []
        for k in range(self.K):
            sigma, sigma_next = s[k], s[k + 1]
            rows.append({"sigma": sigma, "dt": sigma_next - sigma,
                         "keep": 1.0 - sigma_next, "next": sigma_next})
            self.kinds.append(0)
        self._columns(rows)
        # set_timesteps(device=...) leaves the sigmas on the device: not CPU scalars
        self.on_device = self.scheduler.sigmas.device.type != "cpu"
        self.stochastic = bool(self.config.stochastic_sampling)
        self.noisy = (self.stochastic,) * self.K

    def noise_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32   # drawn like the upcast sample

    def output_gains(self) -> torch.Tensor | None:
        """``|dt|``, or with ``stochastic_sampling`` ``|(1 - sigma_next) sigma|``."""
        c = {k: v.to(torch.float64) for k, v in self._cols.items()}
        return (c["keep"] * c["sigma"] if self.stochastic else c["dt"]).abs()

    def _apply(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor, rec: Records,
               z: torch.Tensor | None) -> torch.Tensor:
        sample = x[:, 0].to(torch.float32)
        if self.stochastic:
            assert z is not None, "stochastic_sampling steps read their noise"
            x0 = sample - mul(self.col("sigma", sel, out), out, self.on_device)
            prev = mul(self.col("keep", sel, x0), x0, self.on_device) + \
                mul(self.col("next", sel, z), z, self.on_device)
        else:
            prev = sample + mul(self.col("dt", sel, out), out, self.on_device)
        return prev.to(out.dtype)[:, None]


class LCMReader(Reader):
    """``LCMScheduler``, ``prediction_type`` ``epsilon``, ``sample`` or ``v_prediction``, with
    ``clip_sample``; any ``timestep_spacing``/``original_inference_steps``. Refused:
    ``thresholding``."""

    classname = "LCMScheduler"
    PREDICTIONS = ("epsilon", "sample", "v_prediction")

    def _check_config(self) -> None:
        cfg = self.config
        if cfg.prediction_type not in self.PREDICTIONS:
            raise refuse(self.classname, "prediction_type", cfg.prediction_type,
                         ", ".join(self.PREDICTIONS))
        if cfg.thresholding:
            raise refuse(self.classname, "thresholding", True,
                         "False (dynamic thresholding is not read)")

    def output_gains(self) -> torch.Tensor | None:
        """``|c_out d x_0 / d out|``, times ``sqrt(alpha_prev)`` where the step re-noises."""
        c = {k: v.to(torch.float64) for k, v in self._cols.items()}
        g = c["out"].abs() * x0_gain(self.config.prediction_type, c["sb"], c["sa"])
        noisy = torch.tensor(self.noisy, dtype=torch.bool)
        return torch.where(noisy, g * c["sa_prev"].abs(), g)

    def _read(self) -> None:
        s = self.scheduler
        ts = self.timesteps.cpu()
        ac = s.alphas_cumprod.cpu()
        rows, noisy = [], []
        for k in range(self.K):
            timestep = ts[k]
            prev_timestep = ts[k + 1] if k + 1 < self.K else timestep
            alpha_prod_t = ac[timestep]
            alpha_prod_t_prev = ac[prev_timestep] if prev_timestep >= 0 else \
                torch.as_tensor(s.final_alpha_cumprod).cpu()
            beta_prod_t = 1 - alpha_prod_t
            beta_prod_t_prev = 1 - alpha_prod_t_prev
            c_skip, c_out = s.get_scalings_for_boundary_condition_discrete(timestep)
            rows.append({"sa": alpha_prod_t.sqrt(), "sb": beta_prod_t.sqrt(), "skip": c_skip,
                         "out": c_out, "sa_prev": alpha_prod_t_prev.sqrt(),
                         "sb_prev": beta_prod_t_prev.sqrt()})
            noisy.append(k != s.num_inference_steps - 1)
            self.kinds.append(noisy[-1])
        self._columns(rows)
        self.noisy = tuple(noisy)
        # c_skip and c_out are computed from the timestep, on the timesteps' device
        self.on_device = self.scheduler.timesteps.device.type != "cpu"

    def _apply(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor, rec: Records,
               z: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        sample = x[:, 0]

        def c(name: str) -> torch.Tensor:
            return self.col(name, sel, sample)

        if cfg.prediction_type == "epsilon":
            pred = div(sample - mul(c("sb"), out), c("sa"))
        elif cfg.prediction_type == "sample":
            pred = out
        else:
            pred = mul(c("sa"), sample) - mul(c("sb"), out)
        if cfg.clip_sample:
            pred = pred.clamp(-cfg.clip_sample_range, cfg.clip_sample_range)
        denoised = mul(c("out"), pred, self.on_device) + mul(c("skip"), sample, self.on_device)
        if not kind:   # the last step adds no noise
            return denoised[:, None]
        assert z is not None, "LCM steps but the last read their noise"
        return (mul(c("sa_prev"), denoised) + mul(c("sb_prev"), z))[:, None]
