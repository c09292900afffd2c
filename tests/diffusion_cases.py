"""What the diffusion tests share: the schedulers' short names and settings, the filter for
diffusers' own NumPy warning, and the small fixed denoisers (tests/test_diffusion_core.py,
test_diffusion_readers.py, test_diffusion_schedulers.py)."""

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import (  # noqa: E402
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HeunDiscreteScheduler,
    LCMScheduler,
    UniPCMultistepScheduler,
)

DPM, UNIPC = DPMSolverMultistepScheduler, UniPCMultistepScheduler
EULER, ANCESTRAL, HEUN = EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, \
    HeunDiscreteScheduler
FLOW, LCM = FlowMatchEulerDiscreteScheduler, LCMScheduler
SDE = {"algorithm_type": "sde-dpmsolver++"}
DYNAMIC = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}

# the marks of the readers' test modules: one thread, and diffusers' set_timesteps calling
# np.array on a torch tensor (every scheduler that builds its sigmas with NumPy; nothing
# paraprop can fix at its cause)
READER_MARKS = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings(
        "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]


class Eps(torch.nn.Module):
    """A small fixed MLP on flattened samples and the timestep; per-row or 0-d ``t``."""

    def __init__(self, features=2, seed=0, scale=1.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(features + 1, 16, generator=g) * 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(16, features, generator=g) * 0.5 * scale)
        self.requires_grad_(False)

    def hidden(self, x, t) -> torch.Tensor:
        B = len(x)
        t = torch.as_tensor(t, device=x.device).reshape(-1).expand(B).to(x.dtype) / 1000
        return torch.cat([x.reshape(B, -1), t[:, None]], 1)

    def forward(self, x, t, gain=None):
        h = torch.tanh(self.hidden(x, t) @ self.w1)
        return _gained((h @ self.w2).reshape(x.shape), gain, x)


class RowEps(Eps):
    """:class:`Eps` scaled to contract, its products summed per row (not a matmul, whose
    kernel may round a row by the batch it is in), so its batched calls give the bits of its
    single calls."""

    def __init__(self, features=2, seed=0, scale=0.3):
        super().__init__(features, seed, scale)

    def forward(self, x, t, gain=None):
        inp = self.hidden(x, t)
        h = torch.tanh((inp[:, :, None] * self.w1.to(x.dtype)).sum(1))
        out = (h[:, :, None] * self.w2.to(x.dtype)).sum(1).reshape(x.shape)
        return _gained(out, gain, x)


def _gained(out: torch.Tensor, gain, x: torch.Tensor) -> torch.Tensor:
    return out if gain is None else out * gain.reshape(-1, *([1] * (x.dim() - 1)))


def assert_served_bitwise(handle, steps: int = 5) -> None:
    """An accelerated pipeline's one run: solved and certified bit for bit, every one of its
    ``steps`` denoiser outputs served by paraprop, no denoiser call of its own, no fall through
    (tests/test_diffusion_accelerate.py, test_diffusion_dit.py, test_diffusion_sdxl.py)."""
    c = handle.counters
    assert (c.runs, c.solved, c.certified, c.steps, c.served, c.denoiser_calls) == \
        (1, 1, 1, steps, steps, 0)
    assert handle.solution.stats["certificate"] == "bitwise" and handle.reasons == []


# the refusal of a batch-variant run that needed every model call of its budget: the last
# step could not be compared with the loop's call (docs/diffusion.md, batch variance)
UNCHECKED = "no model call left to compare step"


def within_tol_or_unchecked(x: torch.Tensor, sol, ref: torch.Tensor, tol: float) -> bool:
    """A ``tol > 0`` run of a batch-variant model: certified and within ``tol`` of the loop's
    sample ``ref``, or refused because the run used every call of its budget and the later
    steps' batch variance could not be checked (:data:`UNCHECKED`; the batched calls then
    round apart from the loop's, and the run took as many calls as the loop). Returns whether
    it was certified."""
    if sol.converged:
        assert float((x.double() - ref.double()).abs().max()) <= tol
        return True
    assert sol.stats["loop_bitwise"] is False, sol.stats.get("reason")
    assert UNCHECKED in sol.stats["reason"], sol.stats["reason"]
    return False
