"""A diffusion sampler with its noise drawn up front, as a triangular system over the steps.

Step ``s`` maps ``x_s`` to ``x_{s+1} = step_s(x_s, model(x_s, t_s), z_s)`` (``x_0`` is the
initial noise, ``x_N`` the sample). With every ``z_s`` fixed, the trajectory ``X = (x_1 .. x_N)``
is the unique solution of ``X = F(X)`` for the *Picard map* ``F`` below, and ``F`` is strictly
triangular: position ``s`` of ``F(X)`` reads only positions ``< s`` of ``X``. So every solver of
:func:`paraprop.solve` samples it, and all of them return the sequential trajectory.

The Picard map (ParaDiGMS, Shih et al. 2023): split each step as
``x_{s+1} = a_s x_s + g_s(x_s)`` with a scalar ``a_s``, evaluate every step at the current
iterate in one batched model call, then solve the linear recurrence ``X_{s+1} = a_s X_s + g_s``
exactly by a scan. One iteration is one model call over the window plus one scan; information
travels the whole window in one iteration instead of one step.

**Its fixed point is the sequential trajectory bit for bit, in every dtype.** Written as above,
the scan recomputes ``x_{s+1} = x_s + (step_s(x_s) - x_s)`` in the sample dtype, which rounds
away from ``step_s(x_s)``: in bfloat16 its fixed point differs from the loop's by about 0.1.
This map computes the same iterate in *residual form*: with ``y_s = step_s(X_s)`` (the
scheduler's own step, :meth:`StepTable.apply`, bitwise ``scheduler.step``) and the residuals
``r_s = y_s - X_{s+1}``, the change of the input of step ``s``, ``D_s``, follows
``D_{s+1} = a_s D_s + r_s`` (``D = 0`` at the window's final input), and the new value is
``y_s + a_s D_s``, taken as ``y_s`` itself where ``D_s == 0``. In exact arithmetic this is the
iterate above; in floating point a fixed point has every ``r_s == 0``, so every position is
bitwise the direct step from its predecessor: the sequential trajectory. The correction ``D`` is
accumulated in float32 for bfloat16/float16 samples (it only steers the iteration).

Along the way the chain certifies what it has seen: a position whose input is exact and whose
value equals the direct step computed from it is exact (:attr:`DiffusionChain.exact`), and the
direct step after an exact prefix is the exact next value. Non-finite values at positions that are
not certified (Picard iterates far from the answer may overflow in float16) are replaced by a
finite guess, so they cannot poison the positions after them; a non-finite direct step from
certified inputs is real, and is returned as it is (the solver reports it).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from paraprop.diffusion.chain_checks import BatchVarianceChecks, check_steps_finite
from paraprop.diffusion.chain_history import HistoryInputs
from paraprop.diffusion.chain_prefix import CertifiedPrefix
from paraprop.diffusion.gains import StepGains
from paraprop.diffusion.programs import StepProgram
from paraprop.diffusion.readers import model_output
from paraprop.diffusion.schedulers import StepTable
from paraprop.scan import linear_recurrence


class DiffusionChain(CertifiedPrefix, HistoryInputs, BatchVarianceChecks):
    """The Picard map of one sampling run, in the layout ``(B, N, F)`` (``B`` samples, ``N``
    steps, ``F`` values per sample), with the cached-prefix protocol of
    :func:`paraprop.solve` (``window``) and single-step updates (``update``, the sequential
    reference, computed exactly as ``scheduler.step`` computes it).

    Arguments:
        model: ``model(x, t, **model_kwargs)`` -> the model output shaped like ``x`` (a tensor,
            or an object with ``.sample`` such as diffusers' ``UNet2DOutput``); ``t`` is a 1-D
            long tensor, one timestep per row of ``x``.
        table: the step program: the scheduler's step coefficients
            (:func:`~paraprop.diffusion.schedulers.step_table`), or a Markov reader's
            (:class:`~paraprop.diffusion.programs.MarkovProgram`, whose ``model_input``
            scales the rows before the model call).
        x_init: ``(B, *sample_shape)``, the initial noise ``x_0``.
        z: ``(N, B, *sample_shape)``, the noise of every step (zeros where none is added).
        model_kwargs: extra model arguments; tensors whose first dim is ``B`` are repeated for
            every step of a window, the rest are passed as they are.
        split: the linear part of the Picard split (see
            :meth:`~paraprop.diffusion.schedulers.StepTable.linear_part`).
        evaluate: how the batched model rows are computed: ``evaluate(fn, x, t)``, where
            ``fn(x_rows, t_rows, rows)`` evaluates the rows ``rows`` (a slice); the default calls
            ``fn(x, t)`` once (:mod:`paraprop.diffusion.distributed` shards it).

    The solver sees the steps ``[lo, N)`` (:meth:`restart` moves ``lo`` past a certified prefix;
    ``0`` at first). Counters: ``model_calls`` (batched model calls: sequential steps),
    ``model_rows``, ``max_rows`` (the most rows one call held).

    Its parts: the certified prefix (:mod:`~paraprop.diffusion.chain_prefix`: ``exact``,
    ``has_next``, :meth:`certified`, :meth:`commit`, :meth:`learn_exact`), the batch-variance
    and determinism checks (:mod:`~paraprop.diffusion.chain_checks`: ``irreproducible``,
    ``loop_gap``, :meth:`diagnose`) and the inputs of steps that read history
    (:mod:`~paraprop.diffusion.chain_history`). Every evaluation of a step is reported to
    :attr:`observer` where one is set (:class:`~paraprop.diffusion.gains.StepGains`).
    :meth:`sequential` is the diffusers loop itself, from a certified prefix.
    """

    def __init__(self, model, table: StepProgram, x_init: torch.Tensor,
                 z: torch.Tensor, model_kwargs: dict | None = None, split: str = "identity",
                 evaluate=None):
        self.model = model
        self.sample_shape = tuple(x_init.shape)
        self.B = x_init.shape[0]
        self.N = table.N
        self.F = x_init[0].numel()
        # states of several parts (UniPC; x_init (B, parts, ...)): the model reads part 0 (R)
        self.parts = int(getattr(table, "parts", 1))
        self.model_shape = self.sample_shape if self.parts == 1 else \
            (self.B, *self.sample_shape[2:])
        self.R = self.F // self.parts
        self.dtype = x_init.dtype
        self.device = x_init.device
        # the corrections D steer the iteration only: float32 where the samples are narrower
        self.work = torch.float32 if self.dtype in (torch.bfloat16, torch.float16) else \
            self.dtype
        self.table = table.to(self.device)
        self.x_init = x_init.reshape(self.B, self.F)
        self.z = z.reshape(self.N, self.B, -1)
        self.kwargs = dict(model_kwargs or {})
        self.timesteps = self.table.timesteps
        self.a = self.table.linear_part(split).to(self.device, self.work)
        self.identity_split = bool((self.a == 1).all())   # the scan is then a cumulative sum
        # a step program that scales the model input (scale_model_input), programs.py
        self.scaled = table.scales_input
        self._evaluate = evaluate
        self.model_calls = 0   # batched model calls
        self.model_rows = 0    # model evaluations (rows of x per call, in samples)
        self.max_rows = 0
        # the gains record every evaluation of a step is reported to (None: none)
        self.observer: StepGains | None = None
        # the steps [lo, N) are the system the solver sees; x_lo is the input of step lo
        self.lo = 0
        self.x_lo = self.x_init
        # certified on the way (absolute steps): positions < exact hold bitwise exact values in
        # the solver's iterate; where has_next, next_value is the exact value of position exact
        dev = self.device
        self.exact = torch.zeros(self.B, dtype=torch.long, device=dev)
        self.has_next = torch.zeros(self.B, dtype=torch.bool, device=dev)
        self.next_value = torch.zeros(self.B, self.F, dtype=self.dtype, device=dev)
        self.exact_values = torch.zeros(self.B, self.N, self.F, dtype=self.dtype, device=dev)
        # with history (HistoryProgram): the records of the steps < certified() (exact_records)
        # and the inputs of the steps [lo - history, lo) (x_hist, as far as they exist)
        self.history = int(getattr(table, "history", 0))
        # values per sample in a step's records (Heun's: two tensors shaped like the sample)
        self.RW = self.R * int(getattr(table, "record_parts", 1))
        self.exact_records = self.exact_values.new_zeros((self.B, self.N, self.RW)) \
            if self.history else None
        self.records_out: torch.Tensor | None = None
        self.x_hist = self.x_init[:, None][:, :0]
        # a step recomputed from the same exact input gave other bits (another batch of rows)
        self.irreproducible = torch.zeros((), dtype=torch.bool, device=dev)
        self.irreproducible_seen = False   # its value at the start of the last window call
        self._last: tuple | None = None   # (key, X, values) of the last window call
        # (B,) or None: samples a pass leaves as they are (settled in an earlier pass; their
        # inputs may not be exact, so recomputing them in other rows could change them)
        self.frozen: torch.Tensor | None = None
        # per sample, the first step found non-finite from exact inputs (-1: none)
        self.nonfinite_step = torch.full((self.B,), -1, dtype=torch.long, device=dev)
        # step 0's model output on the loop's rows, its largest difference from the first
        # batched call's (None: not compared yet)
        self.loop_out: torch.Tensor | None = None
        self.loop_gap: torch.Tensor | None = None
        # (B rows of the model's output shape): the batched call's step-0 output less the
        # loop's, where they were compared (the direction the batch variance probe takes)
        self.loop_diff: torch.Tensor | None = None
        self._step0_input: torch.Tensor | None = None
        # the determinism check (:meth:`diagnose`): made once, when a difference is first seen
        self.diagnosed = False
        self._recompute_gap = torch.zeros((), dtype=torch.float64, device=dev)
        # the differences of certified steps computed again, not yet in recompute_gap
        self._gaps: list[torch.Tensor] = []
        self.cap: int | None = None   # model calls the check may not push the run beyond
        # on the host a value read costs no synchronisation: window reads one sum per call
        self.host = self.device.type == "cpu"
        self._aranges: dict[int, torch.Tensor] = {}   # n -> arange(n) (the positions of a window)
        self._samples = torch.arange(self.B, device=dev)

    # -- the model -----------------------------------------------------------------------------
    def _kwargs(self, n: int) -> tuple[dict, set]:
        out, per_row = {}, set()
        for k, v in self.kwargs.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == self.B:
                out[k] = v.repeat(n, *([1] * (v.dim() - 1))) if n > 1 else v
                per_row.add(k)
            else:
                out[k] = v
        return out, per_row

    def call_model(self, x: torch.Tensor, t: torch.Tensor, n: int) -> torch.Tensor:
        """The model output for the rows ``x`` (``(n * B, *sample_shape[1:])``, step-major)."""
        kwargs, per_row = self._kwargs(n)

        def fn(xx, tt, rows=slice(None)):
            kw = {k: (v[rows] if k in per_row else v) for k, v in kwargs.items()}
            return model_output(self.model(xx, tt, **kw), xx)

        out = fn(x, t) if self._evaluate is None else self._evaluate(fn, x, t)
        self.model_calls += 1
        self.model_rows += x.shape[0]
        self.max_rows = max(self.max_rows, x.shape[0])
        return out

    def steps(self, xin: torch.Tensor, start: int, stop: int, hist: torch.Tensor | None = None,
              past: torch.Tensor | None = None) -> torch.Tensor:
        """``x_{s+1}`` for the absolute steps ``s`` in ``[start, stop)`` from the inputs ``xin``
        ``(B, n, F)`` (``x_s``), in one batched model call; returns ``(B, n, F)``: the direct
        steps, bitwise ``scheduler.step``'s arithmetic.

        With history (:class:`~paraprop.diffusion.programs.HistoryProgram`): ``hist``, the
        inputs of the ``h = min(history, start)`` steps before ``start`` ``(B, h, F)``, and
        ``past``, their records ``(B, h, RW)``, or ``None``: those steps are evaluated in the
        same call. The window's records are left in :attr:`records_out` ``(B, n, RW)``."""
        n, B = stop - start, self.B
        h = min(self.history, start)
        if self.history and (hist is None or hist.shape[1] != h or
                             (past is not None and past.shape[1] != h)):
            raise ValueError(f"chain: steps [{start}, {stop}) read the records of the {h} "
                             "steps before them: pass their inputs (hist) and records (past)")
        extra = h if past is None else 0
        if start == 0:
            self._step0_input = xin[:, 0]
        ext = torch.cat([hist, xin], dim=1) if hist is not None and extra else xin   # (B, m, F)
        e0, m = start - extra, n + extra
        # every other batched call holds the steps in reverse order: a step computed again
        # sits at other rows, so a kernel that rounds a row by its place in the batch shows
        # as a certified step computed with other bits (batch variance), not only at step 0
        flip = m > 1 and self.model_calls % 2 == 1
        states = ext.transpose(0, 1)
        # the model reads scale_model_input of the states where the program scales them
        model_in = self.table.model_input(e0, stop, states) if self.scaled else states
        order = model_in.flip(0) if flip else model_in
        rows = order.reshape(m * B, *self.model_shape[1:])
        t = self.timesteps[e0:stop]
        t = (t.flip(0) if flip else t).repeat_interleave(B)
        out = self.call_model(rows, t, m)
        shape = (m, B, self.R)
        if flip:   # back in the steps' order
            out = out.reshape(shape).flip(0)
            rows = rows.reshape(shape).flip(0)
        if start == 0 and self.loop_gap is None:   # (no extra rows before step 0)
            self._compare_step0(out.reshape(m * B, *self.model_shape[1:])[:B], n)
        out = out.reshape(shape)
        if self.history:
            table: Any = self.table
            if extra:   # the records of the steps before the window, from this call
                before = table.records(e0, start, states[:extra], out[:extra])
            else:
                before = past.transpose(0, 1)   # type: ignore[union-attr]
            y, rec = table.apply_history(slice(start, stop), states[extra:], out[extra:],
                                         self.z[start:stop], before)
            prev = y.transpose(0, 1)
            self.records_out = rec.transpose(0, 1)
        else:
            prev = self.table.apply(slice(start, stop), states if self.scaled else
                                    rows.reshape(shape), out, self.z[start:stop]).transpose(0, 1)
        if self.observer is not None:
            if self.history:
                # the records each step read (chronological; zeros before step 0)
                H = self.history
                full = torch.cat([before.new_zeros((H - h,) + before.shape[1:]), before, rec])
                read = torch.stack([full[j: j + n] for j in range(H)], dim=2)
                self.observer.observe(xin, prev, start, stop, self._joint(hist, xin),
                                      self.records_out,
                                      read.transpose(0, 1).reshape(B, n, H * self.RW))
            else:
                self.observer.observe(xin, prev, start, stop)
        return prev

    # -- the triangular system -----------------------------------------------------------------
    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        return self.window(X, 0, X.shape[1], None)[0]

    def window(self, X: torch.Tensor, start: int, stop: int, cache=None):
        """Positions ``[start, stop)`` of the Picard map of the steps ``[lo, N)``, given final
        positions ``< start``, in residual form (see the module doc).

        The same request on an unmodified ``X`` (a solver's verification of the iterate it is
        about to evaluate anyway) is answered from the last call, without a model call."""
        # (an inference tensor has no version counter: no answer from the last call then)
        key = None if X.is_inference() else \
            (X.data_ptr(), X._version, tuple(X.shape), tuple(X.stride()), start, stop, self.lo)
        if key is not None and self._last is not None and self._last[0] == key:
            return self._last[2].clone(), None
        # the one host sync of a call: is every position certified, has a certified step been
        # computed with other bits (read by the driver), how far do the certificates reach?
        lo_t, hi_t = torch.aminmax(self.certified())
        if self.host:   # (reading a host tensor is no synchronisation)
            least, seen, reach = int(lo_t), bool(self.irreproducible), int(hi_t)
        else:
            least, seen, reach = torch.stack([lo_t, self.irreproducible.long(), hi_t]).tolist()
        done = least >= self.N
        self.irreproducible_seen = bool(seen)
        if seen and not self.diagnosed:
            self.diagnose()
        if done and torch.equal(X, self.exact_values[:, self.lo:]):
            # every position is certified and X holds the certified values: X is the fixed
            # point (a solver's last verification), no model call needed
            return X[:, start:stop].clone(), None
        xin = self.inputs(X, start, stop)
        lo = self.lo
        y = self.steps(xin, lo + start, lo + stop, *self.past_of(X, start, least)) \
            if self.history else self.steps(xin, lo + start, lo + stop)
        old = X[:, start:stop]
        narrow = self.work != self.dtype
        r = y.to(self.work) - old.to(self.work) if narrow else y - old
        # positions certified already keep their certified values (their step computed again
        # in another batch of rows may round apart: the batch-variance check)
        if lo + start <= reach:
            known, exact = self._certify(X, r, y, lo + start)
            r.masked_fill_(known[:, :, None], 0)
        else:   # the window starts past every certificate (a sliding window's freezes)
            known = exact = None
        if self.parts > 1:
            # every part follows the sample part of the state before it (UniPC's corrected
            # sample is about its input): that change moves every part (same fixed point)
            acc = r[:, :, : self.R].cumsum(dim=1).repeat(1, 1, self.parts)
        elif self.identity_split:
            acc = r.cumsum(dim=1)
        else:
            n = stop - start
            A = self.a[lo + start : lo + stop][None, :, None].expand(1, n, self.F)
            acc = linear_recurrence(A, r, torch.zeros_like(r[:, 0]))
        D = torch.cat([torch.zeros_like(r[:, :1]), acc[:, :-1]], dim=1)  # input changes
        if not self.identity_split:
            D = self.a[lo + start : lo + stop][None, :, None] * D
        vals = torch.where(D == 0, y, (y.to(self.work) + D).to(self.dtype) if narrow else y + D)
        if known is not None:
            vals = torch.where(known[:, :, None], self.exact_values[:, lo + start : lo + stop],
                               vals)
        # a non-finite value at a position not computed from certified inputs comes from an
        # iterate that is not final yet: replace it by a finite guess (the direct step, else
        # the old value, zero for what is still not finite); from certified inputs it is the
        # loop's own value: keep it (on the host, a finite sum of the values says at once that
        # there is none)
        if not (self.host and math.isfinite(float(vals.sum()))):
            bad = ~torch.isfinite(vals)
            if exact is not None:
                bad = bad & ~exact()[:, :, None]
            vals = torch.where(bad, torch.where(torch.isfinite(y), y, old).nan_to_num(0, 0, 0),
                               vals)
        if self.frozen is not None:   # samples settled already keep their values
            vals = torch.where(self.frozen[:, None, None], old, vals)
        self._last = (key, X, vals)   # X held: its memory cannot be reused while cached
        return vals.clone(), None

    def restart(self, X: torch.Tensor, lo: int) -> None:
        """:meth:`commit`, then make the system the steps ``[lo, N)`` (``lo`` at most
        :meth:`certified`)."""
        self.commit(X)
        self.lo = lo
        self.x_lo = self.x_init if lo == 0 else X[:, lo - 1].clone()
        if self.history:   # the inputs of the steps [lo - h, lo), read by the first windows
            self.x_hist = self.full_inputs(X, lo - min(self.history, lo), lo).clone()
        self._last = None

    def sequential(self, X: torch.Tensor, start: int, records: torch.Tensor | None = None,
                   ignore: torch.Tensor | None = None) -> None:
        """The diffusers loop from step ``start`` to the end, one model call of ``B`` rows per
        step, writing ``X`` ``(B, N, F)`` in place. From the certified prefix, or, with
        ``records`` (a program with history: the records ``(B, h, RW)`` of the ``h`` steps
        before ``start`` computed from their inputs in ``X``, read by the samples whose
        certified prefix does not reach ``start``), from a later position whose error the
        caller bounds. ``ignore`` ``(B,)``: samples whose values the caller discards (their
        records are not asked for).

        Raises:
            NonFiniteError: a step produced NaN or inf (the loop gives it too).
            ValueError: a program with history, a sample not certified up to ``start``, and
                no ``records`` (the certified records would be read where there are none).
        """
        x = self.x_init if start == 0 else X[:, start - 1]
        H = self.history
        # exact where the input was: the samples whose certified prefix reached `start` (not
        # the ignored ones: their values are the caller's, not these)
        ok = self.exact >= start
        if ignore is not None:
            ok = ok & ~ignore
        # the records of the steps before `start`: certified where the prefix is (the samples
        # continued here), else the given ones; then the loop's own
        past = None if self.exact_records is None else \
            self.exact_records[:, start - min(H, start): start]
        need = ~ok if ignore is None else ~ok & ~ignore
        if past is not None and past.shape[1] and bool(need.any()):
            if records is None or records.shape != past.shape:
                raise ValueError(
                    f"chain.sequential: the loop from step {start} reads the records of the "
                    f"{past.shape[1]} steps before it, and some sample is certified only to "
                    f"step {int(self.exact[need].min())}: pass their records computed from "
                    f"the trajectory (shape {tuple(past.shape)})")
            past = torch.where(need[:, None, None], records.to(past.dtype), past)
        for s in range(start, self.N):
            hist = self.full_inputs(X, s - min(H, s), s) if H else None
            x = self.steps(x[:, None], s, s + 1, hist, past)[:, 0]
            X[:, s] = x
            if self.exact_records is not None and self.records_out is not None:
                rec = self.records_out
                past = torch.cat([past, rec], dim=1)[:, -min(H, s + 1):] \
                    if past is not None else rec
                self.exact_records[:, s] = torch.where(ok[:, None], rec[:, 0],
                                                       self.exact_records[:, s])
        self.exact_values[:, start:] = torch.where(ok[:, None, None], X[:, start:],
                                                   self.exact_values[:, start:])
        self.exact = torch.where(ok, self.N, self.exact)
        self.has_next = self.has_next & ~ok
        if start < self.N:
            check_steps_finite(X, start)

    def update(self, X: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Positions ``index`` computed step by step from ``X`` (the sequential reference)."""
        outs = []
        for s in index.tolist():
            xin = self.inputs(X, s, s + 1)
            past = self.past_of(X, s) if self.history else ()
            outs.append(self.steps(xin, self.lo + s, self.lo + s + 1, *past))
        return torch.cat(outs, dim=1)


def draw_noise(table: StepTable, shape: tuple[int, ...], *, generator=None, dtype=torch.float32,
               device=None) -> torch.Tensor:
    """All the noise of one run, drawn in the order of the diffusers loop: the initial sample
    ``x_0``, then the noise of each step that adds some (``randn`` of ``shape`` each, as
    ``diffusers.utils.torch_utils.randn_tensor`` draws it with one generator). Returns
    ``(N + 1, *shape)``: row ``0`` is ``x_0``, row ``1 + s`` the noise of step ``s`` (zeros where
    the step adds none)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    gen_device = generator.device if generator is not None else device

    def randn():
        return torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)

    rows = [randn()]
    zero = torch.zeros(shape, dtype=dtype, device=device)
    for noisy in table.noisy.tolist():
        rows.append(randn() if noisy else zero)
    return torch.stack(rows)
