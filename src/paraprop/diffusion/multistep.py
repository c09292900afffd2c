"""Readers of the multistep solvers: ``DPMSolverMultistepScheduler`` (DPM-Solver++, orders 1-3,
``dpmsolver++`` and ``sde-dpmsolver++``) and ``UniPCMultistepScheduler`` (UniP predictor and
UniC corrector, ``bh1``/``bh2``), in the interface of :mod:`~paraprop.diffusion.readers`.

Both convert the model output of step ``k`` (to a predicted ``x_0``, or a noise for UniPC's
``predict_x0=False``) from ``(x_k, model output)``: that converted output is step ``k``'s record,
and step ``k`` reads the records of the ``solver_order - 1`` steps before it (UniPC's corrector
one more). Each step's order (warm-up, ``lower_order_final``, ``euler_at_final``) is read from
the scheduler's rules; steps of one order are applied together. UniPC's states carry the
corrected sample of the step before, which its corrector reads (``parts = 2``).
"""

from __future__ import annotations

from typing import Any

import torch

from paraprop.diffusion.gains import x0_gain
from paraprop.diffusion.readers import Reader, Records, refuse
from paraprop.diffusion.scalars import div, mul
from paraprop.diffusion.selection import Sel

PREDICTIONS = ("epsilon", "sample", "v_prediction", "flow_prediction")


def _alpha_sigma(flow: bool, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_sigma_to_alpha_sigma_t`` of both schedulers."""
    if flow:
        return 1 - sigma, sigma
    alpha_t = 1 / ((sigma**2 + 1) ** 0.5)
    return alpha_t, sigma * alpha_t


def _check_common(name: str, cfg) -> None:
    if cfg.prediction_type not in PREDICTIONS:
        raise refuse(name, "prediction_type", cfg.prediction_type, ", ".join(PREDICTIONS))
    if cfg.thresholding:
        raise refuse(name, "thresholding", True, "False (dynamic thresholding is not read)")
    if cfg.solver_order not in (1, 2, 3):
        raise refuse(name, "solver_order", cfg.solver_order, "1, 2, 3")


class DPMSolverMultistepReader(Reader):
    """``DPMSolverMultistepScheduler`` with ``algorithm_type`` ``dpmsolver++`` or
    ``sde-dpmsolver++``, ``solver_order`` 1-3, ``solver_type`` ``midpoint`` or ``heun``, any
    sigma schedule (Karras, exponential, beta, Lu lambdas, flow sigmas, ``final_sigmas_type``,
    ``timestep_spacing``), ``lower_order_final`` and ``euler_at_final``; ``prediction_type``
    ``epsilon``, ``sample``, ``v_prediction``, ``flow_prediction``. Refused: the deprecated
    ``dpmsolver``/``sde-dpmsolver``, ``thresholding``, a learned ``variance_type``."""

    classname = "DPMSolverMultistepScheduler"
    ALGORITHMS = ("dpmsolver++", "sde-dpmsolver++")

    def _check_config(self) -> None:
        cfg = self.config
        if cfg.algorithm_type not in self.ALGORITHMS:
            raise refuse(self.classname, "algorithm_type", cfg.algorithm_type,
                         ", ".join(self.ALGORITHMS))
        _check_common(self.classname, cfg)
        if cfg.variance_type is not None:
            raise refuse(self.classname, "variance_type", cfg.variance_type,
                         "None (a learned variance needs the model's extra channels)")
        if cfg.solver_type not in ("midpoint", "heun"):
            raise refuse(self.classname, "solver_type", cfg.solver_type, "midpoint, heun")
        self.sde = cfg.algorithm_type == "sde-dpmsolver++"
        self.history = cfg.solver_order - 1

    def noise_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32   # step() draws its noise in float32

    def _read(self) -> None:
        cfg, K, s = self.config, self.K, self.sigmas
        assert s is not None
        flow = bool(cfg.use_flow_sigmas)
        rows = []
        for k in range(K):
            lower_order_final = k == K - 1 and (
                cfg.euler_at_final or (cfg.lower_order_final and K < 15)
                or cfg.final_sigmas_type == "zero")
            lower_order_second = k == K - 2 and cfg.lower_order_final and K < 15
            lower_order_nums = min(k, cfg.solver_order)
            if cfg.solver_order == 1 or lower_order_nums < 1 or lower_order_final:
                order = 1
            elif cfg.solver_order == 2 or lower_order_nums < 2 or lower_order_second:
                order = 2
            else:
                order = 3
            self.kinds.append(order)
            c: dict[str, torch.Tensor] = {}
            # convert_model_output
            if cfg.prediction_type in ("epsilon", "v_prediction"):
                c["cv_alpha"], c["cv_sigma"] = _alpha_sigma(flow, s[k])
            elif cfg.prediction_type == "flow_prediction":
                c["cv_sigma"] = s[k]
            # the update (the scheduler's expressions, on its 0-d float32 sigmas)
            sigma_t, sigma_s0 = s[k + 1], s[k]
            alpha_t, sigma_t = _alpha_sigma(flow, sigma_t)
            alpha_s0, sigma_s0 = _alpha_sigma(flow, sigma_s0)
            lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
            lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
            h = lambda_t - lambda_s0
            if self.sde:
                c["noise"] = sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h))
            if order >= 2:
                alpha_s1, sigma_s1 = _alpha_sigma(flow, s[k - 1])
                lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
                h_0 = lambda_s0 - lambda_s1
                r0 = h_0 / h
                c["inv_r0"] = 1.0 / r0
            if order == 1:
                if self.sde:
                    c["x"] = sigma_t / sigma_s0 * torch.exp(-h)
                    c["d0"] = alpha_t * (1 - torch.exp(-2.0 * h))
                else:
                    c["x"] = sigma_t / sigma_s0
                    c["d0"] = alpha_t * (torch.exp(-h) - 1.0)
            elif order == 2:
                if self.sde:
                    c["x"] = sigma_t / sigma_s0 * torch.exp(-h)
                    c["d0"] = alpha_t * (1 - torch.exp(-2.0 * h))
                    if cfg.solver_type == "midpoint":
                        c["d1"] = 0.5 * (alpha_t * (1 - torch.exp(-2.0 * h)))
                    else:
                        c["d1"] = alpha_t * ((1.0 - torch.exp(-2.0 * h)) / (-2.0 * h) + 1.0)
                else:
                    c["x"] = sigma_t / sigma_s0
                    c["d0"] = alpha_t * (torch.exp(-h) - 1.0)
                    if cfg.solver_type == "midpoint":
                        c["d1"] = 0.5 * (alpha_t * (torch.exp(-h) - 1.0))
                    else:
                        c["d1"] = alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)
            else:
                alpha_s2, sigma_s2 = _alpha_sigma(flow, s[k - 2])
                lambda_s2 = torch.log(alpha_s2) - torch.log(sigma_s2)
                h_1 = lambda_s1 - lambda_s2
                r1 = h_1 / h
                c["inv_r1"] = 1.0 / r1
                c["r0_r"] = r0 / (r0 + r1)
                c["inv_rr"] = 1.0 / (r0 + r1)
                if self.sde:
                    c["x"] = sigma_t / sigma_s0 * torch.exp(-h)
                    c["d0"] = alpha_t * (1.0 - torch.exp(-2.0 * h))
                    c["d1"] = alpha_t * ((1.0 - torch.exp(-2.0 * h)) / (-2.0 * h) + 1.0)
                    c["d2"] = alpha_t * ((1.0 - torch.exp(-2.0 * h) - 2.0 * h) / (2.0 * h) ** 2
                                         - 0.5)
                else:
                    c["x"] = sigma_t / sigma_s0
                    c["d0"] = alpha_t * (torch.exp(-h) - 1.0)
                    c["d1"] = alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)
                    c["d2"] = alpha_t * ((torch.exp(-h) - 1.0 + h) / h**2 - 0.5)
            rows.append(c)
        self._columns(rows)
        self.noisy = (self.sde,) * K

    def records_like(self, out: torch.Tensor) -> Records:
        return (torch.empty_like(out),)

    def output_gains(self) -> torch.Tensor | None:
        """First order: ``|d0 * d x_0 / d out|``; ``None`` otherwise (``HistoryProgram``'s)."""
        if self.history:
            return None
        p = self.config.prediction_type
        sigma = self._cols["cv_sigma"] if p != "sample" else self._cols["d0"]
        return self._cols["d0"].to(torch.float64).abs() * \
            x0_gain(p, sigma, self._cols.get("cv_alpha"))

    def _record(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor) -> Records:
        # convert_model_output, on the step's input sample (before step() upcasts it)
        sample, p = x[:, 0], self.config.prediction_type
        if p == "epsilon":
            x0 = div(sample - mul(self.col("cv_sigma", sel, out), out),
                     self.col("cv_alpha", sel, out))
        elif p == "sample":
            x0 = out
        elif p == "v_prediction":
            x0 = mul(self.col("cv_alpha", sel, sample), sample) - \
                mul(self.col("cv_sigma", sel, out), out)
        else:
            x0 = sample - mul(self.col("cv_sigma", sel, out), out)
        return (x0,)

    def _apply(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor, rec: Records,
               z: torch.Tensor | None) -> torch.Tensor:
        h = self.history
        (conv,) = rec
        m0 = sel.take(conv, h)
        sample = x[:, 0].to(torch.float32)

        def c(name: str) -> torch.Tensor:
            return self.col(name, sel, sample)

        if kind == 1:
            if self.sde:
                y = mul(c("x"), sample) + mul(c("d0"), m0)
            else:
                y = mul(c("x"), sample) - mul(c("d0"), m0)
        elif kind == 2:
            m1 = sel.take(conv, h - 1)
            D0, D1 = m0, mul(c("inv_r0"), m0 - m1)
            if self.sde:
                y = mul(c("x"), sample) + mul(c("d0"), D0) + mul(c("d1"), D1)
            elif self.config.solver_type == "midpoint":
                y = mul(c("x"), sample) - mul(c("d0"), D0) - mul(c("d1"), D1)
            else:
                y = mul(c("x"), sample) - mul(c("d0"), D0) + mul(c("d1"), D1)
        else:
            m1, m2 = sel.take(conv, h - 1), sel.take(conv, h - 2)
            D0 = m0
            D1_0, D1_1 = mul(c("inv_r0"), m0 - m1), mul(c("inv_r1"), m1 - m2)
            D1 = D1_0 + mul(c("r0_r"), D1_0 - D1_1)
            D2 = mul(c("inv_rr"), D1_0 - D1_1)
            if self.sde:
                y = mul(c("x"), sample) + mul(c("d0"), D0) + mul(c("d1"), D1) + \
                    mul(c("d2"), D2)
            else:
                y = mul(c("x"), sample) - mul(c("d0"), D0) + mul(c("d1"), D1) - \
                    mul(c("d2"), D2)
        if self.sde:
            assert z is not None, "sde-dpmsolver++ steps read their noise"
            y = y + mul(c("noise"), z)
        return y.to(m0.dtype)[:, None]


class UniPCMultistepReader(Reader):
    """``UniPCMultistepScheduler``: the UniP-B(h) predictor and the UniC corrector, orders 1-3,
    ``solver_type`` ``bh1``/``bh2``, ``predict_x0`` either way, ``disable_corrector``,
    ``lower_order_final``, any sigma schedule; ``prediction_type`` ``epsilon``, ``sample``,
    ``v_prediction`` (and ``flow_prediction`` with ``predict_x0``). Refused: ``solver_p``,
    ``thresholding``.

    UniPC moves its sigmas to the sample's device before its coefficient arithmetic (logs,
    ``expm1``, a small ``linalg.solve``), so the reader computes them on ``device``, the device
    the samples will be on, and refuses samples elsewhere. Its ``einsum`` over the history is
    applied per step, with the scheduler's own shapes (a batched one may sum in another order).
    """

    classname = "UniPCMultistepScheduler"
    parts = 2

    def _check_config(self) -> None:
        cfg = self.config
        _check_common(self.classname, cfg)
        if cfg.solver_p is not None:
            raise refuse(self.classname, "solver_p", type(cfg.solver_p).__name__,
                         "None (UniC around another scheduler's predictor is not read)")
        if cfg.solver_type not in ("bh1", "bh2"):
            raise refuse(self.classname, "solver_type", cfg.solver_type, "bh1, bh2")
        if cfg.prediction_type == "flow_prediction" and not cfg.predict_x0:
            raise refuse(self.classname, "prediction_type", cfg.prediction_type,
                         "epsilon, sample, v_prediction with predict_x0=False")
        self.history = cfg.solver_order
        self.predict_x0 = bool(self.scheduler.predict_x0)

    def _bh(self, t_idx: int, s0_idx: int, past: list[int], order: int) -> dict[str, Any]:
        """The B(h) coefficients of ``multistep_uni_p_bh_update``/``..._c_bh_update``, on
        ``device`` (the scheduler's expressions)."""
        s, dev, flow = self.sigmas, self.device, bool(self.config.use_flow_sigmas)
        assert s is not None
        alpha_t, sigma_t = _alpha_sigma(flow, s[t_idx].to(dev))
        alpha_s0, sigma_s0 = _alpha_sigma(flow, s[s0_idx].to(dev))
        lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
        lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
        h = lambda_t - lambda_s0
        rks = []
        for si in past:
            alpha_si, sigma_si = _alpha_sigma(flow, s[si].to(dev))
            lambda_si = torch.log(alpha_si) - torch.log(sigma_si)
            rks.append((lambda_si - lambda_s0) / h)
        c: dict[str, Any] = {f"rk{i + 1}": rk for i, rk in enumerate(rks)}
        rks.append(torch.ones((), device=dev))
        rks_t = torch.stack(rks)
        hh = -h if self.predict_x0 else h
        h_phi_1 = torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        factorial_i = 1
        B_h = hh if self.config.solver_type == "bh1" else torch.expm1(hh)
        R, b = [], []
        for i in range(1, order + 1):
            R.append(torch.pow(rks_t, i - 1))
            b.append(h_phi_k * factorial_i / B_h)
            factorial_i *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial_i
        c["R"], c["b"] = torch.stack(R), torch.stack(b)
        if self.predict_x0:
            c["x"], c["m"], c["res"] = sigma_t / sigma_s0, alpha_t * h_phi_1, alpha_t * B_h
        else:
            c["x"], c["m"], c["res"] = alpha_t / alpha_s0, sigma_t * h_phi_1, sigma_t * B_h
        return c

    def _read(self) -> None:
        cfg, K, s = self.config, self.K, self.sigmas
        assert s is not None
        dev = self.device
        rows: list[dict[str, torch.Tensor]] = []
        prev_order = 0
        for k in range(K):
            row: dict[str, torch.Tensor] = {}
            alpha, sigma = _alpha_sigma(bool(cfg.use_flow_sigmas), s[k])   # convert (CPU)
            row["cv_alpha"], row["cv_sigma"] = alpha, sigma
            row["cv_flow"] = s[k]
            corrector = k > 0 and (k - 1) not in cfg.disable_corrector
            o = prev_order if corrector else 0
            if o:
                c = self._bh(k, k - 1, [k - (i + 1) for i in range(1, o)], o)
                rhos = torch.ones(1, device=dev) * 0.5 if o == 1 else \
                    torch.linalg.solve(c["R"], c["b"]).to(dev)
                row.update({f"c_{n}": v for n, v in c.items() if n not in ("R", "b")})
                row.update({f"c_rho{j}": rhos[j] for j in range(o)})
            order = min(cfg.solver_order, K - k) if cfg.lower_order_final else cfg.solver_order
            p = min(order, min(k, cfg.solver_order) + 1)
            c = self._bh(k + 1, k, [k - i for i in range(1, p)], p)
            row.update({f"p_{n}": v for n, v in c.items() if n not in ("R", "b")})
            if p >= 2:
                rhos = torch.ones(1, device=dev) * 0.5 if p == 2 else \
                    torch.linalg.solve(c["R"][:-1, :-1], c["b"][:-1]).to(dev)
                row.update({f"p_rho{j}": rhos[j] for j in range(p - 1)})
            else:
                row["p_zero"] = c["res"] * 0
            rows.append(row)
            self.kinds.append((p, o))
            prev_order = p
        self._columns(rows)

    def records_like(self, out: torch.Tensor) -> Records:
        return (torch.empty_like(out),)

    def _record(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor) -> Records:
        sample, p = x[:, 0], self.config.prediction_type

        def c(name: str) -> torch.Tensor:
            return self.col(name, sel, out)

        if self.predict_x0:
            if p == "epsilon":
                return (div(sample - mul(c("cv_sigma"), out), c("cv_alpha")),)
            if p == "sample":
                return (out,)
            if p == "v_prediction":
                return (mul(c("cv_alpha"), sample) - mul(c("cv_sigma"), out),)
            return (sample - mul(c("cv_flow"), out),)
        if p == "epsilon":
            return (out,)
        if p == "sample":
            return (div(sample - mul(c("cv_alpha"), out), c("cv_sigma")),)
        return (mul(c("cv_alpha"), out) + mul(c("cv_sigma"), sample),)

    def _einsum(self, sel: Sel, pre: str, order: int, D1s: list[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
        """``einsum("k,bkc...->bc...", rhos, stack(D1s, dim=1))`` step by step."""
        rhos = torch.stack([self.col(f"{pre}_rho{j}", sel, D1s[0]).reshape(-1)
                            for j in range(order)], dim=1).to(dtype)
        return torch.stack([torch.einsum("k,bkc...->bc...", rhos[j],
                                         torch.stack([d[j] for d in D1s], dim=1))
                            for j in range(sel.n)])

    def _apply(self, kind: Any, sel: Sel, x: torch.Tensor, out: torch.Tensor, rec: Records,
               z: torch.Tensor | None) -> torch.Tensor:
        if x.device != self.device:
            raise ValueError(f"UniPCMultistepScheduler: samples on {x.device}, but the reader "
                             f"computed its coefficients on {self.device} (pass "
                             f"device={x.device} to the reader, as the scheduler does its "
                             "arithmetic on the sample's device)")
        p, o = kind
        H = self.history
        (conv,) = rec
        ck = sel.take(conv, H)
        sample = x[:, 0]
        if o:   # the corrector (UniC), from the corrected sample before
            last = x[:, 1]

            def cc(name: str) -> torch.Tensor:
                return self.col(name, sel, last)

            m0 = sel.take(conv, H - 1)
            D1s = [div(sel.take(conv, H - 1 - i) - m0, cc(f"c_rk{i}"), on_device=True)
                   for i in range(1, o)]
            x_t_ = mul(cc("c_x"), last, True) - mul(cc("c_m"), m0, True)
            D1_t = ck - m0
            rho_last = cc(f"c_rho{o - 1}").to(last.dtype)
            if D1s:
                corr_res = self._einsum(sel, "c", o - 1, D1s, last.dtype)
                sample = x_t_ - mul(cc("c_res"), corr_res + rho_last * D1_t, True)
            else:
                sample = x_t_ - mul(cc("c_res"), 0 + rho_last * D1_t, True)
            sample = sample.to(last.dtype)

        def pc(name: str) -> torch.Tensor:
            return self.col(name, sel, sample)

        # the predictor (UniP), from the (corrected) sample
        D1s = [div(sel.take(conv, H - i) - ck, pc(f"p_rk{i}"), on_device=True)
               for i in range(1, p)]
        x_t_ = mul(pc("p_x"), sample, True) - mul(pc("p_m"), ck, True)
        if D1s:
            pred_res = self._einsum(sel, "p", p - 1, D1s, sample.dtype)
            x_t = x_t_ - mul(pc("p_res"), pred_res, True)
        else:
            x_t = x_t_ - pc("p_zero").to(x_t_.dtype)
        return torch.stack([x_t.to(sample.dtype), sample], dim=1)
