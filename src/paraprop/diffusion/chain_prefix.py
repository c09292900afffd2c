"""The certified prefix of :class:`~paraprop.diffusion.chain.DiffusionChain` (a part of it):
what the chain has seen to be the loop's bits on the way.

Positions ``< exact`` (per sample, absolute steps) hold their exact values (``exact_values``) in
the solver's iterate; where ``has_next``, ``next_value`` is the exact value of position
``exact``. A position whose input is exact and whose value equals the direct step from it is
exact, and the direct step after an exact prefix is the next exact value. With history, the
records of the certified steps are kept too (``exact_records``), from the same evaluation.
"""

from __future__ import annotations

import math

import torch


class CertifiedPrefix:
    """The certified-prefix part of :class:`~paraprop.diffusion.chain.DiffusionChain` (a mixin:
    the attributes below are the chain's)."""

    N: int
    B: int
    F: int
    lo: int
    host: bool
    exact: torch.Tensor
    has_next: torch.Tensor
    next_value: torch.Tensor
    exact_values: torch.Tensor
    exact_records: torch.Tensor | None
    records_out: torch.Tensor | None
    irreproducible: torch.Tensor
    nonfinite_step: torch.Tensor
    _gaps: list[torch.Tensor]
    _samples: torch.Tensor
    _aranges: dict[int, torch.Tensor]

    def _certify(self, X: torch.Tensor, r: torch.Tensor, y: torch.Tensor, a0: int):
        """Advance :attr:`exact` from one evaluation of the steps ``[a0, a0 + n)`` (absolute;
        ``r`` the residuals ``y - X`` there), without a host sync (on the host, one read).
        Returns the ``(B, n)`` mask of the positions certified before this evaluation, and a
        function that makes the mask of those whose value this evaluation computed from
        certified inputs (read only where a value is not finite)."""
        lo, n = self.lo, r.shape[1]
        T = X.shape[1]
        exact, has_next = self.exact, self.has_next
        # the pending next value, if the solver has written it (at a position of X)
        rel = exact - lo
        at = rel.clamp(0, T - 1)
        cur = X[self._samples, at]
        written = has_next & (at == rel) & (cur == self.next_value).all(1)
        exact = exact + written
        has_next = has_next ^ written   # (written only where has_next)
        pos = self._positions(n, y.device)
        known = pos < (exact - a0)[:, None]
        # a certified step computed again with other bits: the model's batch variance (or
        # randomness: diagnose() tells them apart by the relative size)
        rmax = r.abs().amax(2)
        off = rmax.masked_fill(~known, 0).max()
        if not self.host:
            self.irreproducible = self.irreproducible | (off != 0)
        elif float(off) != 0:   # (NaN too; on the host a read, no synchronisation)
            self.irreproducible = torch.ones_like(self.irreproducible)
        self._gaps.append(off)   # (recompute_gap: read by diagnose() only)
        # the inputs of step a0 are exact: a leading run of certified positions and of zero
        # residuals is exact, and the direct step after it is the next exact value
        eligible = exact >= a0
        run = (known | (rmax == 0)).cumprod(1).sum(1)
        reach = a0 + run
        grow = eligible & (reach >= exact)
        more = grow & (run < n)
        nxt = y[self._samples, run.clamp(max=n - 1)]
        upto = pos <= run[:, None]   # (known ones among them: run counts them)
        # the certified values: the direct steps y of the run and of the next position
        window = self.exact_values[:, a0 : a0 + n]
        new = (grow[:, None] & (upto ^ known))[:, :, None]
        torch.where(new, y, window, out=window)
        if self.exact_records is not None:   # (the records of the same steps: exact inputs)
            assert self.records_out is not None
            kept = self.exact_records[:, a0 : a0 + n]
            torch.where(new, self.records_out, kept, out=kept)
        self.exact = torch.where(grow, reach, exact)
        self.has_next = torch.where(grow, more, has_next)
        self.next_value = torch.where(more[:, None], nxt, self.next_value)
        # a non-finite direct step from exact inputs is the loop's own value: the first one
        # (on the host, a finite sum says at once that there is none)
        if not (self.host and math.isfinite(float(nxt.sum()))):
            real = more & ~torch.isfinite(nxt).all(1) & (self.nonfinite_step < 0)
            self.nonfinite_step = torch.where(real, reach, self.nonfinite_step)
        return known, lambda: eligible[:, None] & upto

    def _positions(self, n: int, device) -> torch.Tensor:
        """``(1, n)``: ``0 .. n - 1`` on ``device`` (made once per ``n``)."""
        pos = self._aranges.get(n)
        if pos is None:
            pos = self._aranges[n] = torch.arange(n, device=device)[None, :]
        return pos

    def certified(self) -> torch.Tensor:
        """``(B,)``: positions certified exact, the known next value included."""
        return self.exact + self.has_next

    def commit(self, X: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Write the known exact next values into the full trajectory ``X`` ``(B, N, F)``
        (of the samples ``rows``, a ``(B,)`` mask; default all)."""
        take = self.has_next if rows is None else self.has_next & rows
        if self.host and not bool(take.any()):   # (nothing to write: on the host, a read)
            return
        idx = self.exact.clamp(max=self.N - 1)[:, None, None].expand(self.B, 1, self.F)
        cur = X.gather(1, idx)
        X.scatter_(1, idx, torch.where(take[:, None, None], self.next_value[:, None], cur))
        self.exact = self.exact + take.long()
        self.has_next = self.has_next & ~take


    def learn_exact(self, X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                    records: torch.Tensor | None = None) -> torch.Tensor:
        """From the direct steps ``y`` of every position of ``X`` (and, with history, their
        records ``records``, kept as the certified ones): the
        leading positions whose value is their direct step from an exact input are exact, and
        the direct step after them is the next exact value. Advances :attr:`exact` for the
        samples ``rows``; returns ``(B,)``: the first position of each sample whose value is
        not its direct step (``N``: none; certified positions count as exact)."""
        pos = torch.arange(self.N, device=X.device)[None, :]
        before = self.exact
        same = (y == X).all(2) | (pos < self.exact[:, None])
        p = same.long().cumprod(1).sum(1)
        grow = rows & (p >= self.exact)
        newly = grow[:, None, None] & (pos[:, :, None] < p[:, None, None])
        self.exact_values.copy_(torch.where(newly, X, self.exact_values))
        self.exact = torch.where(grow, p, self.exact)
        more = grow & (p < self.N)
        nxt = y.gather(1, p.clamp(max=self.N - 1)[:, None, None].expand(self.B, 1, self.F))[:, 0]
        self.has_next = torch.where(grow, more, self.has_next)
        self.next_value = torch.where(more[:, None], nxt, self.next_value)
        at = pos[:, :, None] == p[:, None, None]
        self.exact_values.copy_(torch.where(more[:, None, None] & at, y, self.exact_values))
        if self.exact_records is not None:
            assert records is not None, "a program with history: pass the steps' records"
            # (the records of the positions certified before stay: a step's last evaluation
            # may have been at another input since)
            taken = (newly & (pos >= before[:, None])[:, :, None]) | (more[:, None, None] & at)
            self.exact_records.copy_(torch.where(taken, records, self.exact_records))
        return p



__all__ = ["CertifiedPrefix"]
