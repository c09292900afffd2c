"""The gains of a chain of steps, observed on its evaluations, and the error bounds they carry.

The gain of step ``s`` is the largest ``|step_s(x) - step_s(x')| / |x - x'|`` seen between two of
its evaluations (per sample; in this dtype, for input changes above the rounding level). An error
``e_{s-1}`` in the input of step ``s`` leaves at most ``g_s e_{s-1}`` in its output, so the
defects of a trajectory under the loop's step map, carried through the gains, bound its distance
to the loop's trajectory (:func:`bounds`). :class:`StepGains` records the gains of one run
(:class:`~paraprop.diffusion.chain.DiffusionChain` reports every evaluation to the observer it is
given); :mod:`paraprop.diffusion.certificate` is the rule that uses them.
"""

from __future__ import annotations

import math

import torch

# units of the dtype's resolution an input change must exceed to measure a step's gain
OBS_ULPS = 2
# units of the dtype's resolution (at the outputs' scale) taken off an observed output change:
# what the rounding of two evaluations may leave between them
NOISE_ULPS = 1
# observations of the steps' gains taken together, at most (StepGains.observe, gain)
OBSERVATIONS_KEPT = 16
# units of the dtype's resolution (at the trajectory's scale) an estimate cannot resolve
FLOOR_ULPS = 4
# a step whose gain was never observed takes the largest of its neighbours' within this many
NEIGHBOURS = 4


class StepGains:
    """The observed gains of the ``N`` steps of ``B`` samples of ``F`` values each (``dtype``
    the samples', ``work`` the dtype differences are taken in), with each step's last input and
    output.

    Example:
        >>> g = StepGains(1, 2, 1, torch.float64, torch.float64, "cpu")
        >>> g.observe(torch.tensor([[[1.0], [1.0]]]), torch.tensor([[[2.0], [3.0]]]), 0, 2)
        >>> g.observe(torch.tensor([[[2.0], [1.5]]]), torch.tensor([[[4.0], [3.5]]]), 0, 2)
        >>> [round(v, 6) for v in g.gain[0].tolist()]   # step 0 doubled a change, step 1 kept it
        [2.0, 1.0]
    """

    def __init__(self, B: int, N: int, F: int, dtype: torch.dtype, work: torch.dtype, device):
        self.B, self.N, self.F = B, N, F
        self.dtype, self.work = dtype, work
        self.device = torch.device(device)
        self._gain: torch.Tensor | None = None  # (B, N): largest observed gain (NaN: none yet)
        self._seen: torch.Tensor | None = None  # (2, B, N, F): the last input and output per step
        # the observations not yet in _gain: (OBSERVATIONS_KEPT, 4, B, N) float64, each row's
        # steps from column 0 on (NaN elsewhere), and the steps of each row held (see observe,
        # gain)
        self._pending: torch.Tensor | None = None
        self._records: list[tuple[int, int]] = []
        self._units: tuple[torch.dtype, torch.Tensor] | None = None
        # a step with history: the last inputs of the steps it reads the records of
        # (B, N, h F), and its last records (B, N, F)
        self._hist: torch.Tensor | None = None
        self._rec: torch.Tensor | None = None
        self._read: torch.Tensor | None = None

    def observe(self, xin: torch.Tensor, nxt: torch.Tensor, start: int, stop: int,
                hist: torch.Tensor | None = None, records: torch.Tensor | None = None,
                read: torch.Tensor | None = None) -> None:
        """Record each step's gain ``max|step(x) - step(x')| / max|x - x'|`` (per sample, the
        largest seen) between this evaluation and the step's previous one, less what the
        rounding of the two outputs may leave between them (:data:`NOISE_ULPS`); input changes
        within :func:`observe_level` of the rounding are skipped. Keeps each step's last input
        and output (:meth:`stale_from`, :attr:`last_outputs`).

        A step with history (it reads the records of the steps before it) also passes
        ``hist``, the inputs of those steps ``(B, n, h F)``: its input is then the joint
        ``(x, hist)``, and ``|x - x'|`` the largest change of any of them (the gain of the
        two-input recurrence, :func:`bounds`); ``records``, its records ``(B, n, F)``
        (:attr:`last_records`); and ``read``, the records it read ``(B, n, h F)``
        (:attr:`last_read`)."""
        self._start(xin)
        assert self._pending is not None and self._seen is not None
        if len(self._records) == self._pending.shape[0]:
            self._fold()
        now = torch.stack([xin, nxt])
        was = self._seen[:, :, start:stop]   # (the last input and output of each step)
        stats = self._stats(now, was)
        if hist is not None:   # the joint input: the largest change and size of any part
            if self._hist is None:
                self._hist = torch.full((self.B, self.N, hist.shape[2]), float("nan"),
                                        dtype=hist.dtype, device=hist.device)
            old = self._hist[:, start:stop]
            h_now, h_was = (hist, old) if self.work == hist.dtype else \
                (hist.to(self.work), old.to(self.work))
            more = torch.stack([h_now - h_was, h_now]).abs().amax(3)
            stats[0::2] = torch.fmax(stats[0::2], more)
            old.copy_(hist)
            if records is not None:
                if self._rec is None:
                    self._rec = torch.full((self.B, self.N, records.shape[2]), float("nan"),
                                           dtype=records.dtype, device=records.device)
                self._rec[:, start:stop] = records
            if read is not None:
                if self._read is None:
                    self._read = torch.full((self.B, self.N, read.shape[2]), float("nan"),
                                            dtype=read.dtype, device=read.device)
                self._read[:, start:stop] = read
        self._pending[len(self._records), :, :, : stop - start] = stats
        self._records.append((start, stop))
        was.copy_(now)

    def compare(self, x0: torch.Tensor, y0: torch.Tensor, x1: torch.Tensor, y1: torch.Tensor,
                start: int, stop: int) -> None:
        """Raise each step's gain to its ratio between two evaluations the caller made,
        ``x0 -> y0`` and ``x1 -> y1`` ``(B, n, F)`` for the steps ``[start, stop)`` (the ratio
        of :meth:`observe`), leaving the last inputs and outputs as they are (a probe of the
        steps in a chosen direction:
        :func:`~paraprop.diffusion.certificate_stages.probe_batch_variance`). A step never
        observed stays so (unbounded: one direction's secant does not bound it); a non-finite
        ``y1`` makes the step unbounded."""
        self._start(x1)
        gain = self.gain   # (folds what is pending)
        assert gain is not None
        stats = self._stats(torch.stack([x1, y1]), torch.stack([x0, y0]))
        ratio = self._ratios(stats[None])[0]
        bad = ~torch.isfinite(y1).all(2)
        ratio = torch.where(bad, math.inf, ratio)
        now = gain[:, start:stop]
        torch.where(now.isnan(), now, torch.fmax(now, ratio), out=now)

    def _stats(self, now: torch.Tensor, was: torch.Tensor) -> torch.Tensor:
        """``(4, B, n)``: ``|x - x'|``, ``|y - y'|``, ``|x|``, ``|y|`` (largest per sample and
        step) of the evaluations ``now`` and ``was`` (each ``(2, B, n, F)``: inputs, outputs),
        in the work dtype, in one reduction (the ratios are taken when the gains are read,
        :attr:`gain`, many observations at once)."""
        a, b = (now, was) if self.work == now.dtype else (now.to(self.work), was.to(self.work))
        return torch.cat([a - b, a]).abs().amax(3)

    def _start(self, xin: torch.Tensor) -> None:
        """Make the records at the first observation (dtype and device of ``xin``)."""
        if self._seen is None:
            self._seen = torch.full((2, self.B, self.N, self.F), float("nan"), dtype=xin.dtype,
                                    device=xin.device)
            self._gain = torch.full((self.B, self.N), float("nan"), dtype=torch.float64,
                                    device=xin.device)
            # as many observations as fit in the memory the last values take (at least one,
            # at most OBSERVATIONS_KEPT; 4 MB in any case)
            record = 4 * self.B * self.N * 8
            kept = max(self._seen.numel() * self._seen.element_size(), 1 << 22) // record
            self._pending = torch.full((min(max(kept, 1), OBSERVATIONS_KEPT), 4, self.B, self.N),
                                       float("nan"), dtype=torch.float64, device=xin.device)

    @property
    def gain(self) -> torch.Tensor | None:
        """``(B, N)`` float64: each step's largest observed gain (NaN: never observed), or
        ``None`` before the first observation (:meth:`_observe`)."""
        if self._records:
            self._fold()
        return self._gain

    def _fold(self) -> None:
        """The ratios of the pending observations into :attr:`gain`: per observation and step,
        ``(|y - y'| - noise)^+ / |x - x'|`` where ``|x - x'|`` exceeds the observation level,
        ``noise`` being what the rounding of the two outputs may leave between them
        (:data:`NOISE_ULPS`), and the level :func:`observe_level`, both at the values' scale
        (``max(1, |x|)``, ``max(1, |y|)``); the largest ratio is kept (the same values, in any
        order, as observation by observation)."""
        records = self._records
        assert self._pending is not None and self._gain is not None   # (made by observe)
        width = max(stop - start for start, stop in records)
        stats = self._pending[: len(records), :, :, :width]
        ratio = self._ratios(stats)
        if len(records) > 2 and all(r == records[0] for r in records):
            # the same steps in every row (a full window): their largest, at once (ratios are
            # >= 0: -1 marks NaN)
            ratio = ratio.masked_fill(ratio.isnan(), -1.0).amax(0)
            ratio = ratio.masked_fill_(ratio < 0, math.nan)[None]
            records = records[:1]
        for row, (start, stop) in enumerate(records):
            gain = self._gain[:, start:stop]
            torch.fmax(gain, ratio[row, :, : stop - start], out=gain)
        stats.fill_(math.nan)
        self._records = []

    def _ratios(self, stats: torch.Tensor) -> torch.Tensor:
        """``(k, B, n)``: the gains of ``k`` observations' statistics ``(k, 4, B, n)``
        (:meth:`_stats`): ``(|y - y'| - noise)^+ / |x - x'|``, NaN where ``|x - x'|`` is within
        the observation level (:meth:`_fold`). Reads ``stats`` (its sizes are scaled in
        place)."""
        din, dout = stats[:, 0], stats[:, 1]
        level, noise = stats[:, 2:].clamp(min=1).mul_(self._obs_units(self.dtype)).unbind(1)
        # (a non-finite difference, or no observation, gives a NaN ratio: skipped)
        return (dout - noise).clamp_(min=0).div_(din).masked_fill_(din <= level, math.nan)

    def _obs_units(self, dtype: torch.dtype) -> torch.Tensor:
        """``(2, 1, 1)`` float64: :func:`observe_level` and :data:`NOISE_ULPS` units of
        ``dtype``, the factors of :meth:`_observe` (made once)."""
        if self._units is None or self._units[0] != dtype:
            v = torch.tensor([observe_level(dtype), NOISE_ULPS * torch.finfo(dtype).eps],
                             dtype=torch.float64, device=self.device)
            self._units = (dtype, v[:, None, None])
        return self._units[1]

    @property
    def last_records(self) -> torch.Tensor | None:
        """``(B, N, F)``: each step's last observed records (a step with history; NaN where
        never observed), else ``None``."""
        return self._rec

    @property
    def last_read(self) -> torch.Tensor | None:
        """``(B, N, h F)``: the records each step's last observed evaluation read (the ``h``
        steps before it, oldest first), or ``None``."""
        return self._read

    @property
    def last_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Each step's last observed input ``(B, N, F)`` and, with history, the inputs of the
        steps it read ``(B, N, h F)``; ``None`` before the first observation."""
        if self._seen is None:
            return None
        return self._seen[0], self._hist

    @property
    def last_outputs(self) -> torch.Tensor:
        """``(B, N, F)``: each step's last observed output (NaN where never observed)."""
        assert self._seen is not None, "no evaluation observed yet"
        return self._seen[1]

    def stale_from(self, X: torch.Tensor, x_init: torch.Tensor, exact: torch.Tensor,
                   rows: torch.Tensor, hist: torch.Tensor | None = None) -> int:
        """The first step whose last observed evaluation was not at its input in the
        trajectory ``X`` ``(B, N, F)`` (``x_init``: the input of step 0), over the samples
        ``rows`` and the positions not certified (``exact`` ``(B,)``: the certified prefixes);
        ``N`` where every such step is up to date (one host sync). ``hist``: with history,
        the inputs of the steps each step reads the records of ``(B, N, h F)``, compared
        too."""
        if self._seen is None:
            return 0
        xin = torch.cat([x_init[:, None], X[:, :-1]], dim=1)
        last_in, last_out = self._seen
        fresh = (last_in == xin).all(2) & torch.isfinite(last_out).all(2)
        if hist is not None:   # a step with history: the inputs of the steps it reads too
            fresh = fresh & (False if self._hist is None else (self._hist == hist).all(2))
        pos = torch.arange(self.N, device=X.device)[None, :]
        stale = ~fresh & rows[:, None] & (pos >= exact[:, None])
        first = torch.where(stale.any(0), pos[0], self.N).min()
        return int(first)


def observe_level(dtype: torch.dtype) -> float:
    """The least input change (per unit of ``|x| + 1``) whose effect on a step is read as the
    step's gain: below it the ratio measures the dtype's rounding, not the map. :data:`OBS_ULPS`
    units of ``dtype``'s resolution."""
    return OBS_ULPS * torch.finfo(dtype).eps


def output_gain(table) -> float:
    """The largest ``|d step_s / d model_output|`` over the steps (no clipping): how much a
    rounding difference of the model's output moves one step."""
    return float(output_gains(table).max())


def output_gains(table) -> torch.Tensor:
    """``(N,)`` float64: ``|d step_s / d model_output|`` per step (no clipping, which only
    lowers it; with thresholding, divided by its least scale, 1)."""
    own = getattr(table, "output_gains", None)
    if own is not None:   # a step program that derives its own (programs.MarkovProgram)
        return own()
    sa, sb, c0 = (v.to(torch.float64) for v in (table.sqrt_alpha, table.sqrt_beta,
                                                table.coef_x0))
    if table.kind == "ddpm":
        k = {"epsilon": c0 * sb / sa, "sample": c0, "v_prediction": c0 * sb}[table.prediction]
    else:
        ce = table.coef_eps.to(torch.float64)
        k = {"epsilon": ce - c0 * sb / sa, "sample": c0 - ce * sa / sb,
             "v_prediction": ce * sa - c0 * sb}[table.prediction]
    return k.abs()


def x0_gain(prediction: str, sigma: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """``|d x_0 / d model output|`` (float64) of the predicted ``x_0`` of ``prediction`` with
    the coefficients ``sigma``, ``alpha`` (columns): ``(x - sigma out) / alpha`` for
    ``epsilon``, ``out`` for ``sample``, ``alpha x - sigma out`` (or ``x - sigma out``) for
    ``v_prediction`` and ``flow_prediction``."""
    sigma = sigma.to(torch.float64)
    if prediction == "epsilon":
        assert alpha is not None, "epsilon's x_0 divides by alpha"
        return (sigma / alpha.to(torch.float64)).abs()
    if prediction == "sample":
        return torch.ones_like(sigma)
    return sigma.abs()


def bounds(X: torch.Tensor, y: torch.Tensor, p: torch.Tensor, gain, dtype: torch.dtype,
            extra: torch.Tensor | None = None, loop: bool = True):
    """The bounds of the final check (:mod:`paraprop.diffusion.certificate`) from the
    trajectory ``X`` and the direct steps ``y`` ``(B, N, F)``, the first defect ``p`` ``(B,)``
    and the observed gains ``(B, N)`` (NaN: not observed, :func:`carried_gains`).

    Per position ``s > p``: ``E_s = g_s E_{s-1} + r_s`` carries the defects (every one at its
    worst), and ``R_s = max(g_s R_{s-1}, rho_s)`` the rounding floor: ``rho_s`` is
    :data:`FLOOR_ULPS` units of the dtype at the position's scale (``max(1, |X_s|)``), what the
    rounding of two computations from nearby inputs leaves between them, carried through the
    growth after it (an expanding chain expands rounding differences too). The bound of a
    position is ``E_s + R_s``.

    Returns ``(E, F, rho)``: ``E`` ``(B,)`` the largest bound over the trajectory; ``F``
    ``(B, N + 1)`` the same where the loop recomputes the positions ``>= q`` from position
    ``q - 1`` (``F[:, N] = E``; ``0`` for ``q <= p``: the loop from an exact input); ``rho``
    ``(B,)`` the largest ``R_s``; ``F`` is ``None`` where ``loop`` is false. In log space:
    ``E_s = exp(L_s) sum_{k <= s} r_k exp(-L_k)`` (a stable cumulative log-sum-exp) and
    ``R_s = exp(L_s) max_{k <= s} rho_k exp(-L_k)``, ``L`` the cumulative log gains.
    """
    B, N = X.shape[:2]
    f64 = torch.float64
    pos = torch.arange(N, device=X.device)[None, :]
    r = (y.to(f64) - X.to(f64)).abs().amax(2).nan_to_num(nan=math.inf, posinf=math.inf)
    r = torch.where(pos < p[:, None], 0.0, r)
    if extra is not None:   # a defect of every step but the loop's own first one
        r = r + torch.where(pos > 0, extra.to(f64)[None, :], 0.0)
        p = torch.zeros_like(p)
    scale = X.to(f64).abs().amax(2).nan_to_num(nan=math.inf, posinf=math.inf).clamp(min=1.0)
    after = pos > p[:, None]
    rho = torch.where(after, FLOOR_ULPS * torch.finfo(dtype).eps * scale, 0.0)
    lg = torch.where(gain.isnan(), math.inf, gain.clamp(min=1e-30).log())
    L = torch.where(after, lg, 0.0).cumsum(1)
    Es = _nan_inf((L + torch.logcumsumexp(r.log() - L, dim=1)).exp())
    Rs = _nan_inf((L + (rho.log() - L).cummax(1).values).exp())
    total = Es + Rs
    E = total.amax(1)
    if not loop:
        return E, None, Rs.amax(1)
    # the loop from q: positions < q keep their bounds; at s >= q the defect part of position
    # q - 1 grows through the gains after it, and the rounding floor is at most R_s
    before = total.cummax(1).values                                  # max_{s <= i}
    top_L = L.flip(1).cummax(1).values.flip(1)                       # max_{s >= i} L_s
    top_R = Rs.flip(1).cummax(1).values.flip(1)                      # max_{s >= i} R_s
    grown = _nan_inf(Es[:, :-1] * (top_L[:, 1:] - L[:, :-1]).exp())
    F = torch.cat([torch.zeros_like(E[:, None]),
                   torch.maximum(before[:, :-1], grown + top_R[:, 1:]), E[:, None]], dim=1)
    q = torch.arange(N + 1, device=X.device)[None, :]
    F = torch.where(q <= p[:, None], 0.0, F)
    return E, F, Rs.amax(1)


def _nan_inf(v: torch.Tensor) -> torch.Tensor:
    """``v`` with NaN (from ``inf - inf`` or ``0 * inf``: an unbounded quantity) as ``inf``."""
    return torch.where(v.isnan(), math.inf, v)


def carried_gains(gain, B: int, N: int, device, history: int = 0) -> torch.Tensor:
    """``(B, N)``: the observed gain of each step, a step never observed taking the largest
    gain observed among its :data:`NEIGHBOURS` neighbours on each side (the coefficients and
    the model vary smoothly with the timestep); NaN (unbounded) where none of them was.

    ``history > 0``: step ``s`` reads the ``history`` positions before its input too, and its
    gain was observed against the largest change of all of them (:meth:`StepGains.observe`):
    ``|e_s| <= g_s max(|e_{s-1}|, ..., |e_{s-1-history}|) + r_s``. Then
    ``M_s = max(|e_s|, ..., |e_{s-history}|)`` obeys ``M_s <= max(g_s, 1) M_{s-1} + r_s``, the
    one-input recurrence of :func:`bounds` with every gain taken at least 1 (an error is not
    forgotten while a later step still reads it): the gains returned are ``max(g_s, 1)``."""
    if gain is None:
        return torch.full((B, N), math.nan, dtype=torch.float64, device=device)
    k = NEIGHBOURS
    padded = torch.nn.functional.pad(torch.where(gain.isnan(), -math.inf, gain), (k, k),
                                     value=-math.inf)
    near = padded.unfold(1, 2 * k + 1, 1).amax(2)
    out = torch.where(gain.isnan(), torch.where(near == -math.inf, math.nan, near), gain)
    if history:
        out = torch.where(out.isnan(), out, out.clamp(min=1.0))
    return out
