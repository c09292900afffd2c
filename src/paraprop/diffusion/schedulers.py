"""A diffusers scheduler's update rule, read once into per-step coefficients and applied to many
steps at once, with the same operations in the same precision as ``scheduler.step``.

``scheduler.step(model_output, t, x)`` maps one sample at one timestep. Parallel sampling needs
the same map for a whole window of timesteps in one batched call. :func:`step_table` runs the
scheduler's own coefficient arithmetic (the same float32 tensor expressions, in the same order)
once per timestep and stacks the results; :meth:`StepTable.apply` then evaluates the step with
those coefficients broadcast over the steps.

**Bitwise, in every dtype.** ``scheduler.step`` applies float32 0-d coefficient tensors (CPU
tensors: the pipelines' ``set_timesteps()`` leaves the scheduler there) to a sample of the
model's dtype. PyTorch computes each such operation in the sample dtype's "opmath" type (float32
for bfloat16 and float16, the dtype itself otherwise) and rounds the result to the sample dtype
after every operation. How it reads the coefficient depends on the operation and the device
(measured on the CPU, and read from PyTorch's kernels for CUDA):

* on the CPU, ``c * t`` (diffusers writes every product coefficient first) rounds ``c`` to the
  sample dtype first, while ``t / c`` reads it at full float32 precision;
* on CUDA (and XPU), a CPU scalar is read at full precision in both, and ``t / c`` is computed as
  ``t * (1 / c)``.

:meth:`StepTable.apply` performs exactly these operations, one by one, with per-step coefficient
columns, e.g. ``(c.to(bfloat16).float() * t.float()).to(bfloat16)`` where diffusers writes
``c * t`` on the CPU. So
``method="sequential"`` reproduces the diffusers loop bit for bit in float64, float32, bfloat16
and float16, wherever the model itself does (``tests/test_diffusion_core.py``). Where the
scheduler's ``alphas_cumprod`` has been moved to the sample's GPU (``scheduler.add_noise`` does
that), its coefficients are GPU tensors, which PyTorch first rounds to the sample dtype; the table
then does the same (``scalars="device"``).

Supported: ``DDPMScheduler`` (variance types ``fixed_small``, ``fixed_small_log``,
``fixed_large``) and ``DDIMScheduler`` (any ``eta``, ``use_clipped_model_output``), each with
``prediction_type`` ``epsilon``, ``sample`` or ``v_prediction``, ``clip_sample`` and
``thresholding``. Their ``*Parallel*`` variants subclass them and are read the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

SUPPORTED = ("DDPMScheduler", "DDIMScheduler")
PREDICTIONS = ("epsilon", "sample", "v_prediction")
DDPM_VARIANCES = ("fixed_small", "fixed_small_log", "fixed_large")
# devices on which PyTorch divides by a CPU scalar through its reciprocal (BinaryDivTrueKernel)
RECIPROCAL_DIVISION = ("cuda", "xpu")
# slices of steps whose columns StepTable.apply keeps ready (a solve asks for at most ~N of them)
WINDOWS_KEPT = 4096
_COLUMNS = ("sqrt_alpha", "sqrt_beta", "coef_x0", "coef_x", "coef_eps", "sigma")


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The precision PyTorch computes an elementwise operation of ``dtype`` in: float32 for
    bfloat16 and float16, the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@dataclass
class StepTable:
    """Per-step coefficients of one sampling run (``N`` steps, index ``s = 0 .. N-1`` in
    sampling order; step ``s`` maps ``x_s`` to ``x_{s+1}`` at timestep ``timesteps[s]``).

    The 1-D float32 tensors hold the scheduler's own values: ``sqrt_alpha`` and ``sqrt_beta``
    (``alpha_prod_t ** 0.5``, ``beta_prod_t ** 0.5``: the predicted-``x_0`` formula), and for
    DDPM ``coef_x0``, ``coef_x`` (formula 7 of Ho et al.), for DDIM ``coef_x0``
    (``alpha_prod_t_prev ** 0.5``) and ``coef_eps`` (the direction pointing to ``x_t``);
    ``sigma`` scales the step's noise, and ``noisy`` says which steps draw noise at all.
    ``scalars`` says where ``scheduler.step`` finds its 0-d coefficients: ``"cpu"`` (CPU
    scalars, read at full float32 precision) or ``"device"`` (tensors on the sample's device,
    rounded to the sample dtype first). :meth:`to` moves the table to the sample's device.
    """

    kind: str  # "ddpm" or "ddim"
    timesteps: torch.Tensor  # (N,) long
    prediction: str
    sqrt_alpha: torch.Tensor
    sqrt_beta: torch.Tensor
    coef_x0: torch.Tensor
    coef_x: torch.Tensor | None
    coef_eps: torch.Tensor | None
    sigma: torch.Tensor
    noisy: torch.Tensor  # (N,) bool
    clip: float | None = None
    threshold: tuple[float, float] | None = None  # (ratio, sample_max_value)
    clipped_eps: bool = False
    scalars: str = "cpu"

    # the model reads the samples as they are (no scale_model_input): see model_input
    scales_input: ClassVar[bool] = False

    def __post_init__(self):
        # which steps add noise, on the host: read in the hot loop without a device sync
        self.noisy_steps = tuple(bool(v) for v in self.noisy.cpu().tolist())
        self._noise_counts = [0]   # noisy steps before each step (prefix counts)
        for v in self.noisy_steps:
            self._noise_counts.append(self._noise_counts[-1] + v)
        self._columns = {}   # (device, dtype) -> the coefficient columns as apply reads them
        self._windows = {}   # a slice of steps, the samples' device, dtype and dim -> _window
        self._tall = {}      # the samples' device, dtype and dim -> the columns shaped for them

    @property
    def N(self) -> int:
        return int(self.timesteps.numel())

    def to(self, device) -> StepTable:
        """The same table with its tensors on ``device`` (no copy where they are already)."""
        device = torch.device(device)
        moved: dict[str, Any] = {
            k: (None if getattr(self, k) is None else getattr(self, k).to(device))
            for k in (*_COLUMNS, "timesteps", "noisy")}
        return dataclasses.replace(self, **moved)

    def linear_part(self, split: str) -> torch.Tensor:
        """``a_s`` of the split ``x_{s+1} = a_s x_s + g_s(x_s)`` (float32, ``(N,)``).

        ``"identity"``: ``a = 1``, the drift form of ParaDiGMS. ``"eps"``: the derivative of
        the step in ``x`` with the model output held fixed (for ``epsilon`` prediction and no
        clipping; ``1`` otherwise). Any split gives the same fixed point; it only changes how
        fast Picard iteration gets there.
        """
        if split == "identity" or self.prediction != "epsilon":
            return torch.ones_like(self.sqrt_alpha)
        if self.kind == "ddpm":
            assert self.coef_x is not None   # (DDPM's column)
            return self.coef_x0 / self.sqrt_alpha + self.coef_x
        return self.coef_x0 / self.sqrt_alpha

    def model_input(self, start: int, stop: int, x: torch.Tensor) -> torch.Tensor:
        """The model's rows for the steps ``[start, stop)``: the samples ``x`` themselves
        (DDPM and DDIM have no ``scale_model_input``; :attr:`scales_input` is false)."""
        return x

    def apply(self, index, x: torch.Tensor, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x_{s+1}`` for the steps ``index`` (a ``slice`` of steps, or a 1-D long tensor):
        ``x``, ``out`` (the model output) and ``z`` (the step noise) are ``(n, ...)``, one
        leading row per step, all of the sample dtype. Each operation is ``scheduler.step``'s,
        in its precision (see the module doc)."""
        dt, om = x.dtype, opmath(x.dtype)
        reciprocal, cols, noisy = self._window(index, x)

        if om == dt:   # (no conversions)
            def mul(name: str, t: torch.Tensor) -> torch.Tensor:  # diffusers' `c * t`
                return cols[name, 0] * t

            def div(t: torch.Tensor, name: str) -> torch.Tensor:  # diffusers' `t / c`
                # (where reciprocal, the column holds 1 / c already)
                return t * cols[name, 1] if reciprocal else t / cols[name, 1]
        else:
            def mul(name: str, t: torch.Tensor) -> torch.Tensor:
                return (cols[name, 0] * t.to(om)).to(dt)

            def div(t: torch.Tensor, name: str) -> torch.Tensor:
                if reciprocal:
                    return (t.to(om) * cols[name, 1]).to(dt)
                return (t.to(om) / cols[name, 1]).to(dt)

        eps: torch.Tensor | None
        if self.prediction == "epsilon":
            x0 = div(x - mul("sqrt_beta", out), "sqrt_alpha")
            eps = out
        elif self.prediction == "sample":
            x0 = out
            eps = div(x - mul("sqrt_alpha", x0), "sqrt_beta") if self.kind == "ddim" else None
        else:  # v_prediction
            x0 = mul("sqrt_alpha", x) - mul("sqrt_beta", out)
            eps = mul("sqrt_alpha", out) + mul("sqrt_beta", x) if self.kind == "ddim" else None
        if self.threshold is not None:
            x0 = _threshold(x0, *self.threshold)
        elif self.clip is not None:
            x0 = x0.clamp(-self.clip, self.clip)
        if self.kind == "ddpm":
            prev = mul("coef_x0", x0) + mul("coef_x", x)
        else:
            if self.clipped_eps:
                eps = div(x - mul("sqrt_alpha", x0), "sqrt_beta")
            assert eps is not None   # (DDIM computes it for every prediction type)
            prev = mul("coef_x0", x0) + mul("coef_eps", eps)
        if noisy is False:
            return prev
        with_noise = prev + mul("sigma", z)
        if noisy is True:
            return with_noise
        return torch.where(noisy, with_noise, prev)

    def _window(self, index, x: torch.Tensor):
        """What :meth:`apply` reads for the steps ``index`` and samples like ``x``: whether it
        divides through the reciprocal, the coefficient columns (per name ``(for c * t, for
        t / c)``, shaped to broadcast over ``x``), and which steps add noise (``False``: none,
        ``True``: all, else a mask shaped like the columns). Kept per slice of steps (the
        solvers ask for the same windows again and again)."""
        on_cpu = x.device.type == "cpu"
        # how PyTorch reads the 0-d float32 coefficient of `c * t` and `t / c` (module doc)
        mul_rounds = on_cpu or self.scalars == "device"
        div_rounds = self.scalars == "device"
        reciprocal = not on_cpu and self.scalars == "cpu" and \
            x.device.type in RECIPROCAL_DIVISION
        sliced = isinstance(index, slice)
        key = None
        if sliced:
            key = (x.device, x.dtype, x.dim(), index.start, index.stop, index.step)
            hit = self._windows.get(key)
            if hit is not None:
                return hit
        n = x.shape[0]
        shape = (n,) + (1,) * (x.dim() - 1)
        prepared = self._prepared(x.device, x.dtype, mul_rounds, div_rounds, reciprocal)
        # each column when apply first reads it: (name, 0) for `c * t`, (name, 1) for `t / c`,
        # of the columns shaped to broadcast over samples of x.dim() dims (kept)
        tall = self._tall.get((x.device, x.dtype, x.dim()))
        if tall is None:
            tall = self._tall[x.device, x.dtype, x.dim()] = _Lazy(
                lambda key: prepared[key[0]][key[1]].reshape((-1,) + shape[1:]))
        if sliced:
            steps = range(self.N)[index]
            cols = _Lazy(lambda key: tall[key][index])
            # how many of these steps add noise (from the prefix counts)
            noises = self._noise_counts[steps.stop] - self._noise_counts[steps.start] \
                if steps.step == 1 else sum(self.noisy_steps[s] for s in steps)
        else:
            steps = [int(i) for i in index.tolist()]
            i = index.to(x.device)
            cols = _Lazy(lambda key: tall[key].index_select(0, i))
            noises = sum(self.noisy_steps[s] for s in steps)
        noisy: bool | torch.Tensor
        if noises == len(steps) and noises:
            noisy = True
        elif not noises:
            noisy = False
        else:
            keep = self.noisy[index] if sliced else \
                self.noisy.index_select(0, index.to(self.noisy.device))
            noisy = keep.to(x.device).reshape(shape)
        out = (reciprocal, cols, noisy)
        if sliced:
            if len(self._windows) >= WINDOWS_KEPT:
                self._windows.clear()
            self._windows[key] = out
        return out

    def _prepared(self, device, dtype, mul_rounds: bool, div_rounds: bool, reciprocal: bool):
        """The coefficient columns as :meth:`apply` reads them on ``device`` for samples of
        ``dtype``, per coefficient ``(for c * t, for t / c)``: rounded to ``dtype`` first where
        PyTorch does, in the operation's precision, the division's as its reciprocal where
        PyTorch divides so. Made once per device and dtype."""
        key = (torch.device(device), dtype)
        if key not in self._columns:
            om = opmath(dtype)

            def column(name: str) -> tuple[torch.Tensor, torch.Tensor]:
                v = getattr(self, name)
                m = (v.to(dtype) if mul_rounds else v).to(device, om)
                d = (v.to(dtype) if div_rounds else v).to(device, om)
                return m, 1 / d if reciprocal else d

            self._columns[key] = _Lazy(column)   # (each coefficient when first read)
        return self._columns[key]


class _Lazy(dict):
    """A dict whose missing keys are made by ``make(key)`` on first use, and kept."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        value = self[key] = self._make(key)
        return value


def _threshold(x0: torch.Tensor, ratio: float, max_value: float) -> torch.Tensor:
    """Dynamic thresholding (Saharia et al. 2022) per image, as diffusers applies it: each leading
    row of ``x0`` is ``(n_images, C, ...)``."""
    n, b = x0.shape[:2]
    dtype = x0.dtype
    flat = x0.reshape(n * b, -1)
    if dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    s = torch.quantile(flat.abs(), ratio, dim=1).clamp(min=1, max=max_value).unsqueeze(1)
    return (torch.clamp(flat, -s, s) / s).reshape(x0.shape).to(dtype)


def scheduler_kind(scheduler) -> str:
    """``"ddpm"`` or ``"ddim"``; ``NotImplementedError`` naming the supported schedulers."""
    for cls in type(scheduler).__mro__:
        if cls.__name__ == "DDPMScheduler" or cls.__name__ == "DDPMParallelScheduler":
            return "ddpm"
        if cls.__name__ == "DDIMScheduler" or cls.__name__ == "DDIMParallelScheduler":
            return "ddim"
    raise NotImplementedError(
        f"scheduler: {type(scheduler).__name__} is not supported; paraprop.diffusion samples "
        f"with {', '.join(SUPPORTED)} (and their parallel variants), and through its readers "
        "with EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, "
        "FlowMatchEulerDiscreteScheduler, LCMScheduler, DPMSolverMultistepScheduler, "
        "UniPCMultistepScheduler and HeunDiscreteScheduler")


def step_table(scheduler, num_inference_steps: int, *, eta: float = 0.0,
               use_clipped_model_output: bool = False) -> StepTable:
    """Set ``num_inference_steps`` on ``scheduler`` (as a pipeline does) and read its update rule.

    Raises:
        NotImplementedError: a scheduler, ``prediction_type`` or ``variance_type`` that is not
            supported (the message names the supported ones).
    """
    kind = scheduler_kind(scheduler)
    cfg = scheduler.config
    prediction = cfg.prediction_type
    if prediction not in PREDICTIONS:
        raise NotImplementedError(f"scheduler: prediction_type={prediction!r} is not supported; "
                                  f"choose one of {', '.join(PREDICTIONS)}")
    if kind == "ddpm":
        variance = cfg.variance_type
        if variance not in DDPM_VARIANCES:
            raise NotImplementedError(
                f"DDPMScheduler: variance_type={variance!r} is not supported (a learned variance "
                f"needs a second model output); choose one of {', '.join(DDPM_VARIANCES)}")
    scheduler.set_timesteps(num_inference_steps)
    timesteps = scheduler.timesteps.detach().to("cpu", torch.long)
    n_train = scheduler.alphas_cumprod.shape[0]
    if int(timesteps.max()) >= n_train or int(timesteps.min()) < 0:
        raise ValueError(f"scheduler: timesteps {int(timesteps.min())} .. {int(timesteps.max())} "
                         f"fall outside its {n_train} training timesteps for "
                         f"num_inference_steps={num_inference_steps} (scheduler.step would fail "
                         "too); lower num_inference_steps or steps_offset")
    # where scheduler.step finds its coefficients: CPU scalars (as set_timesteps() leaves the
    # scheduler), or tensors on the device that scheduler.add_noise moved alphas_cumprod to
    where = scheduler.alphas_cumprod.device
    scalars = "cpu" if where.type == "cpu" else "device"
    cols = _ddpm_columns(scheduler, timesteps) if kind == "ddpm" else \
        _ddim_columns(scheduler, timesteps, eta,
                      reciprocal=scalars == "device" and where.type in RECIPROCAL_DIVISION)
    sigma, noisy = cols["sig"], cols["noisy"]
    if not bool(torch.isfinite(sigma[noisy]).all()):
        raise NotImplementedError(f"scheduler: {type(scheduler).__name__} gives a non-finite "
                                  "noise scale for this configuration (in diffusers too)")
    sigma = torch.where(noisy, sigma, torch.zeros_like(sigma))
    threshold = None
    if cfg.get("thresholding", False):
        threshold = (float(cfg.dynamic_thresholding_ratio), float(cfg.sample_max_value))
    clip = float(cfg.clip_sample_range) if cfg.get("clip_sample", False) else None
    return StepTable(kind=kind, timesteps=timesteps, prediction=prediction,
                     sqrt_alpha=cols["sa"], sqrt_beta=cols["sb"], coef_x0=cols["c0"],
                     coef_x=cols["cx"], coef_eps=cols["ce"], sigma=sigma, noisy=noisy,
                     clip=clip, threshold=threshold,
                     clipped_eps=bool(use_clipped_model_output) and kind == "ddim",
                     scalars=scalars)


# The coefficient arithmetic of the schedulers' step(), on float32 tensors of all the steps at
# once: the same elementwise operations in the same order as on their 0-d tensors (correctly
# rounded +, -, *, / and sqrt, so the values are the same bit for bit; tests/test_diffusion.py
# checks the sequential sampler against scheduler.step).

def _ddpm_columns(s, ts: torch.Tensor) -> dict:
    ac = s.alphas_cumprod.detach().cpu()
    prev = torch.cat([ts[1:], torch.tensor([-1])])  # previous_timestep() after set_timesteps
    alpha_prod_t = ac[ts]
    alpha_prod_t_prev = torch.where(prev >= 0, ac[prev.clamp(min=0)], s.one.cpu())
    beta_prod_t = 1 - alpha_prod_t
    beta_prod_t_prev = 1 - alpha_prod_t_prev
    current_alpha_t = alpha_prod_t / alpha_prod_t_prev
    current_beta_t = 1 - current_alpha_t
    noisy = ts > 0
    variance = s.config.variance_type
    if variance == "fixed_small":
        v = (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
        sig = torch.clamp(v, min=1e-20) ** 0.5
    elif variance == "fixed_large":
        sig = (1 - alpha_prod_t / alpha_prod_t_prev) ** 0.5
    else:  # log and exp: the scheduler's own, step by step (vectorised ones may round apart)
        sig = torch.stack([s._get_variance(t).reshape(()).float().cpu() if t > 0
                           else torch.tensor(0.0) for t in ts])
    return {"sa": alpha_prod_t ** (0.5), "sb": beta_prod_t ** (0.5),
            "c0": (alpha_prod_t_prev ** (0.5) * current_beta_t) / beta_prod_t,
            "cx": current_alpha_t ** (0.5) * beta_prod_t_prev / beta_prod_t,
            "ce": None, "sig": torch.where(noisy, sig, torch.zeros_like(sig)), "noisy": noisy}


def _ddim_columns(s, ts: torch.Tensor, eta: float, reciprocal: bool = False) -> dict:
    ac = s.alphas_cumprod.detach().cpu()
    prev = ts - s.config.num_train_timesteps // s.num_inference_steps
    final = torch.as_tensor(s.final_alpha_cumprod).cpu()
    alpha_prod_t = ac[ts]
    alpha_prod_t_prev = torch.where(prev >= 0, ac[prev.clamp(min=0)], final)
    beta_prod_t = 1 - alpha_prod_t
    beta_prod_t_prev = 1 - alpha_prod_t_prev
    ratio = alpha_prod_t / alpha_prod_t_prev
    if reciprocal:  # alphas_cumprod on a GPU divided by the CPU scalar final_alpha_cumprod
        ratio = torch.where(prev >= 0, ratio, alpha_prod_t * (1 / final))
    variance = (beta_prod_t_prev / beta_prod_t) * (1 - ratio)
    std_dev_t = eta * variance ** (0.5)
    noisy = torch.full_like(ts, eta > 0, dtype=torch.bool)
    return {"sa": alpha_prod_t ** (0.5), "sb": beta_prod_t ** (0.5),
            "c0": alpha_prod_t_prev ** (0.5), "cx": None,
            "ce": (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5),
            "sig": torch.where(noisy, std_dev_t, torch.zeros_like(std_dev_t)), "noisy": noisy}
