"""Steppers: apply many residual steps ``u -> u + s F_k(u)`` at once, forward or adjoint.

The MGRIT solver (:mod:`paraprop.multigrid.mgrit`) only ever asks for steps whose fine indices
form an arithmetic progression ``k = first, first + stride, ...`` (the same position in every
coarse interval). A stepper turns that into one batched computation when the blocks share an
architecture: the parameters of all blocks are stacked once per solve, the progression is a
strided view of the stack, and ``torch.func.vmap`` over ``torch.func.functional_call`` evaluates
all the intervals in one call -- the single-device concurrency that Kirby et al. (2020, §3.2) get
from CUDA streams. Otherwise the blocks are called one by one.

A block class may also define ``batched_forward(params, buffers, x)``, computing ``F`` for
``K`` stacked parameter sets and ``K`` states at once with ordinary batched operators; the
steppers then use it instead of ``vmap`` (and ``torch.func.vjp`` of it for the adjoint), which
saves ``vmap``'s per-call overhead and its generic batching rules on a CPU.

:class:`ForwardStepper` applies ``u + s F_n(u)``. :class:`AdjointStepper` applies the transposed
linearised step ``lam + s J_n(u_n)^T lam`` (a vector-Jacobian product at the stored forward state
``u_n``), with the steps numbered backwards in depth, and computes the parameter gradients
``s (dF_n/dtheta_n)^T lam_{n+1}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from paraprop.multigrid.params import BlockParams

__all__ = ["AdjointStepper", "ForwardStepper", "block_signature", "shares_architecture"]


def block_signature(block: nn.Module) -> tuple:
    """What must agree for blocks to be evaluated by one ``vmap``: class, structure (repr),
    parameter and buffer names, shapes and dtypes."""
    return (type(block), repr(block),
            tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()))


def shares_architecture(blocks: Sequence[nn.Module] | nn.ModuleList) -> bool:
    """Whether ``blocks`` agree in class, structure and parameter and buffer shapes and dtypes,
    so that one ``vmap`` over their stacked parameters evaluates them all (``batched=True`` of
    the steppers).

    Example:
        >>> shares_architecture([nn.Linear(4, 4), nn.Linear(4, 4)])
        True
        >>> shares_architecture([nn.Linear(4, 4), nn.Linear(4, 4, bias=False)])
        False
    """
    first = block_signature(blocks[0])
    return all(block_signature(b) == first for b in blocks[1:])


def _progression(d: dict, first: int, stride: int, count: int):
    """Strided views ``t[first : first + stride * count : stride]`` of every stacked tensor."""
    stop = first + stride * (count - 1) + 1
    return {k: v[first:stop:stride] for k, v in d.items()}


class _Counts:
    def __init__(self):
        self.evaluations = 0  # layer evaluations (hardware-independent work)
        self.calls = 0  # dependent steps (sequential launches, batched or not)

    def add(self, count: int, calls: int = 1) -> None:
        self.evaluations += count
        self.calls += calls


class _Stepper:
    """What the solver calls; subclasses define ``_step`` and may batch ``sweep``."""

    offset: int
    counts: _Counts
    batched: bool
    params: dict
    buffers: dict
    _hook: Callable | None = None   # batched only: the block class's batched_forward, if any

    def step(self, first: int, stride: int, count: int, u: torch.Tensor, scale: float
             ) -> torch.Tensor:
        """``u[k] + scale * F_{first + k*stride}(u[k])`` for ``k < count``; ``u``: (count, *S).
        """
        self.counts.add(count)
        return self._step(first - self.offset, stride, count, u, scale)

    def step_one(self, k: int, u: torch.Tensor, scale: float) -> torch.Tensor:
        """``u + scale * F_k(u)`` for one state ``u`` (no batch of intervals)."""
        return self.step(k, 1, 1, u[None], scale)[0]

    def sweep(self, first: int, stride: int, count: int, length: int, u0: torch.Tensor,
              scale: float, g: torch.Tensor | None, out_f: torch.Tensor,
              out_w: torch.Tensor | None) -> None:
        """Relax ``count`` intervals of ``length`` steps, writing the results in place.

        Interval ``k`` starts from ``u0[k]``; its step ``j`` uses layer
        ``first + (k * length + j) * stride`` and adds ``g[k, j]`` (when given). The states
        after steps ``0 .. length-2`` (the F-points) go to ``out_f`` ``(count, length-1, *S)``,
        the state after the last step (into the next C-point) to ``out_w`` ``(count, *S)``;
        without ``out_w`` the last step is skipped.
        """
        if self.batched and count > 1 and self._hook is None:   # one vmap over the intervals
            steps = length - 1 + (out_w is not None)
            self.counts.add(count * steps, steps)
            i0 = first - self.offset
            p = _intervals(self.params, i0, stride, count, length, steps)
            b = _intervals(self.buffers, i0, stride, count, length, steps)
            self._batched_sweep(first, i0, stride, count, length, steps, p, b, u0, scale, g,
                                out_f, out_w)
            return
        x = u0
        for j in range(length - 1 + (out_w is not None)):
            x = self.step(first + j * stride, length * stride, count, x, scale)
            if g is not None:
                x = x + g[:, j]
            if j < length - 1:
                out_f[:, j].copy_(x)
            elif out_w is not None:
                out_w.copy_(x)

    def _step(self, i0: int, stride: int, count: int, u: torch.Tensor, scale: float
              ) -> torch.Tensor:
        """:meth:`step` with the local index ``i0`` of its first layer."""
        raise NotImplementedError

    def _batched_sweep(self, first: int, i0: int, stride: int, count: int, length: int,
                       steps: int, p: dict, b: dict, u0: torch.Tensor, scale: float,
                       g: torch.Tensor | None, out_f: torch.Tensor,
                       out_w: torch.Tensor | None) -> None:
        """:meth:`sweep` by one ``vmap`` over the intervals (``p``, ``b``: their parameters and
        buffers, ``(count, steps, ...)``; ``i0``: the local index of layer ``first``)."""
        raise NotImplementedError


def _fresh(u: torch.Tensor) -> torch.Tensor:
    """``u`` as the serial loop hands it to a block: a tensor of its own. A row of a larger
    buffer starts at another alignment, and BLAS kernels round differently at other alignments
    (measured: a float32 ``nn.Linear`` differs by one ulp on rows 8 bytes off a 64-byte
    boundary), so a row is copied first: the block-by-block steps are then bitwise the serial
    loop's (``tol=0``)."""
    return u.clone() if u._base is not None or u.storage_offset() else u


class ForwardStepper(_Stepper):
    """``u_k + s F_k(u_k)`` for the local blocks ``blocks[k - offset]``.

    Arguments:
        blocks: this rank's blocks, in depth order.
        offset: the global index of ``blocks[0]``.
        batched: evaluate many blocks with one ``vmap`` over stacked parameters (needs blocks
            that share an architecture) or one block at a time.
        stacked: ``(params, buffers)`` stacked by
            :meth:`paraprop.multigrid.params.BlockParams.stack` (computed when omitted).

    Example:
        >>> blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(6)]
        >>> stepper = ForwardStepper(blocks)
        >>> u = torch.randn(3, 2, 4)                     # 3 states of a batch of 2
        >>> out = stepper.step(0, 2, 3, u, 0.5)          # layers 0, 2, 4: one vmap call
        >>> ref = torch.stack([u[k] + 0.5 * blocks[2 * k](u[k]) for k in range(3)])
        >>> torch.allclose(out, ref, atol=1e-6)
        True
    """

    def __init__(self, blocks: Iterable[nn.Module], offset: int = 0, *, batched: bool = True,
                 stacked: tuple[dict, dict] | None = None):
        self.blocks = list(blocks)
        self.offset = offset
        self.batched = batched
        self.counts = _Counts()
        if batched:
            self.params, self.buffers = stacked if stacked is not None else \
                BlockParams(self.blocks).stack()
            template = self.blocks[0]

            def f(p, b, x):
                return functional_call(template, (p, b), (x,))

            self._f = f
            self._hook = getattr(template, "batched_forward", None)
            self._vf = self._hook if self._hook is not None else vmap(f)
            self._sweeps: dict = {}

    def _check(self, out: torch.Tensor, u: torch.Tensor, k: int) -> None:
        if out.shape != u.shape:
            raise ValueError(f"block {k} maps a state of shape {tuple(u.shape)} to "
                             f"{tuple(out.shape)}; residual blocks must keep the shape")

    def step_one(self, k: int, u: torch.Tensor, scale: float) -> torch.Tensor:
        self.counts.add(1)
        f = self.blocks[k - self.offset](_fresh(u))
        self._check(f, u, k)
        return u + scale * f      # as the serial loop writes it (not fused: bitwise its steps)

    def _step(self, i0, stride, count, u, scale):
        if count == 1 or not self.batched:
            outs = []
            for j in range(count):
                f = self.blocks[i0 + j * stride](_fresh(u[j]))
                self._check(f, u[j], i0 + j * stride + self.offset)
                outs.append(f)
            f = outs[0][None] if count == 1 else torch.stack(outs)
            return u + scale * f  # as the serial loop writes it (not fused: bitwise its steps)
        # batched kernels round differently from the loop anyway (run_batched keeps them away
        # from tol=0 and bf16/fp16): the fused update, one operation fewer
        f = self._vf(_progression(self.params, i0, stride, count),
                     _progression(self.buffers, i0, stride, count), u)
        self._check(f[0], u[0], i0 + self.offset)
        return torch.add(u, f, alpha=scale)

    def _sweep_fn(self, length: int, with_g: bool, with_w: bool):
        key = (length, with_g, with_w)
        if key not in self._sweeps:
            f = self._f

            def one(p, b, x, g, out_f, out_w, scale):
                # One interval: dependent residual steps with this interval's layers, each
                # result written in place (F-points to out_f, the last step to out_w).
                for j in range(length - 1 + with_w):
                    pj = {k: v[j] for k, v in p.items()}
                    bj = {k: v[j] for k, v in b.items()}
                    fx = f(pj, bj, x)
                    if fx.shape != x.shape:
                        raise _ShapeError(j, tuple(x.shape), tuple(fx.shape))
                    x = torch.add(x, fx, alpha=scale)
                    if g is not None:
                        x = x + g[j]
                    (out_f[j] if j < length - 1 else out_w).copy_(x)
                return x  # vmap needs an output; the results are already in place

            self._sweeps[key] = vmap(one, in_dims=(0, 0, 0, 0 if with_g else None, 0,
                                                   0 if with_w else None, None))
        return self._sweeps[key]

    def _batched_sweep(self, first, i0, stride, count, length, steps, p, b, u0, scale, g,
                       out_f, out_w):
        try:
            self._sweep_fn(length, g is not None, out_w is not None)(p, b, u0, g, out_f, out_w,
                                                                     scale)
        except _ShapeError as e:
            j, shape_in, shape_out = e.args
            raise ValueError(f"block {first + j * stride} maps a state of shape {shape_in} to "
                             f"{shape_out}; residual blocks must keep the shape") from None


class _ShapeError(Exception):
    """Raised inside ``vmap`` (which cannot name the block); re-raised as ``ValueError``."""


def _intervals(d: dict, i0: int, stride: int, count: int, length: int, steps: int) -> dict:
    """Views ``(count, steps, ...)``: ``[k, j]`` is stacked row ``i0 + (k*length + j)*stride``."""
    stop = i0 + stride * (count * length - 1) + 1
    return {k: v[i0:stop:stride].view(count, length, *v.shape[1:])[:, :steps]
            for k, v in d.items()}


class AdjointStepper(_Stepper):
    """The adjoint of a residual stack, stepped backwards in depth.

    Solve step ``k`` is fine layer ``n = N - 1 - k``: ``lam_k + s J_n(u_n)^T lam_k``, the
    transposed linearisation of ``u_n -> u_n + s F_n(u_n)`` (Kirby et al. 2020, §2.2: the
    backward pass is the adjoint initial value problem, solved by the same MGRIT).

    Arguments:
        blocks: this rank's blocks ``[a, b)`` in depth order.
        a: the global index of ``blocks[0]``.
        n_total: ``N``, the number of layers of the whole stack.
        states: the forward states ``u_a .. u_b``, shape ``(b - a + 1, *S)`` (only
            ``u_a .. u_{b-1}``, the inputs of the local layers, are used).
        batched, stacked: as for :class:`ForwardStepper`.

    Example:
        >>> blocks = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)]
        >>> u = [torch.randn(2, 4)]
        >>> with torch.no_grad():                        # the forward states u_0 .. u_3
        ...     for block in blocks:
        ...         u.append(u[-1] + 0.5 * block(u[-1]))
        >>> adjoint = AdjointStepper(blocks, 0, 3, torch.stack(u))
        >>> lam, x = torch.randn(2, 4), u[2].requires_grad_()
        >>> (ref,) = torch.autograd.grad(x + 0.5 * blocks[2](x), x, lam)   # layer 2's VJP
        >>> torch.allclose(adjoint.step_one(0, lam, 0.5), ref, atol=1e-6)  # solve step 0
        True
    """

    def __init__(self, blocks: Iterable[nn.Module], a: int, n_total: int, states: torch.Tensor,
                 *, batched: bool = True, stacked: tuple[dict, dict] | None = None):
        self.blocks = list(blocks)
        n = len(self.blocks)
        self.a, self.n_total = a, n_total
        self.offset = n_total - (a + n)  # solve index of the last local layer
        self.counts = _Counts()
        self.batched = batched
        # Reversed layout: local solve index i <-> local layer n - 1 - i.
        self.inputs = states[:n].flip(0)
        if batched:
            params, bufs = stacked if stacked is not None else \
                BlockParams(self.blocks).stack()
            self.params_fwd, self.buffers_fwd = params, bufs
            self.params = {k: v.flip(0) for k, v in params.items()}
            self.buffers = {k: v.flip(0) for k, v in bufs.items()}
            template = self.blocks[0]

            def vjp_x(p, b, x, lam):
                _, pull = vjp(lambda y: functional_call(template, (p, b), (y,)), x)
                return pull(lam)[0]

            def vjp_p(p, b, x, lam):
                _, pull = vjp(lambda q: functional_call(template, (q, b), (x,)), p)
                return pull(lam)[0]

            def vjp_xp(p, b, x, lam):
                _, pull = vjp(lambda y, q: functional_call(template, (q, b), (y,)), x, p)
                return pull(lam)

            self._vjp_x, self._vjp_xp = vjp_x, vjp_xp
            self._hook = getattr(template, "batched_forward", None)
            if self._hook is None:
                self._vx, self._vp, self._vxp = vmap(vjp_x), vmap(vjp_p), vmap(vjp_xp)
            else:  # intervals are independent: one VJP of the batched function does them all
                hook = self._hook

                def vx(p, b, x, lam):
                    return vjp(lambda y: hook(p, b, y), x)[1](lam)[0]

                def vp(p, b, x, lam):
                    return vjp(lambda q: hook(q, b, x), p)[1](lam)[0]

                def vxp(p, b, x, lam):
                    return vjp(lambda y, q: hook(q, b, y), x, p)[1](lam)

                self._vx, self._vp, self._vxp = vx, vp, vxp
            self._sweeps: dict = {}
        self._collect: dict | list | None = None

    # -- parameter gradients accumulated during the final relaxation -------------------------
    def begin_collect(self) -> None:
        """From now on every step also stores ``s (dF_n/dtheta_n)^T lam`` for its layer (one
        VJP with respect to state and parameters instead of the state alone)."""
        n = len(self.blocks)
        if self.batched:
            self._collect = {k: torch.zeros_like(v) for k, v in self.params.items()}
        else:
            self._collect = [None] * n

    def end_collect(self) -> list[dict[str, torch.Tensor]]:
        """The collected gradients, one dict per local block in depth order."""
        got, self._collect = self._collect, None
        if got is None:
            raise RuntimeError("AdjointStepper.end_collect: nothing is being collected; call "
                               "begin_collect() before the final relaxation")
        n = len(self.blocks)
        if isinstance(got, dict):
            fwd = {k: v.flip(0) for k, v in got.items()}
            return [{k: v[i] for k, v in fwd.items()} for i in range(n)]
        if any(g is None for g in got):
            raise RuntimeError("the final relaxation did not visit every layer")
        return list(reversed(got))

    def _store(self, i0: int, stride: int, count: int, grads, scale: float) -> None:
        collect = self._collect
        if isinstance(collect, dict):
            for k, v in grads.items():
                _progression({k: collect[k]}, i0, stride, count)[k].copy_(v).mul_(scale)
        elif collect is not None:
            for j in range(count):
                collect[i0 + j * stride] = {k: v[j] * scale for k, v in grads.items()}

    def _block_vjp(self, i: int, x: torch.Tensor, lam: torch.Tensor):
        """``(J^T lam, (dF/dtheta)^T lam or None)`` of local solve index ``i`` at ``x``."""
        blk = self._block(i)
        if self._collect is None:
            return vjp(blk, x)[1](lam)[0], None
        p = {k: v.detach() for k, v in blk.named_parameters()}
        gx, gp = vjp(lambda y, q: functional_call(blk, q, (y,)), x, p)[1](lam)
        return gx, gp

    def _block(self, i: int) -> nn.Module:
        return self.blocks[len(self.blocks) - 1 - i]

    def step_one(self, k: int, lam: torch.Tensor, scale: float) -> torch.Tensor:
        return self.step(k, 1, 1, lam[None], scale)[0]

    def _step(self, i0, stride, count, lam, scale):
        stop = i0 + stride * (count - 1) + 1
        x = self.inputs[i0:stop:stride]
        if count == 1 or not self.batched:
            outs, grads = [], []
            for j in range(count):
                gx, gp = self._block_vjp(i0 + j * stride, x[j], lam[j])
                outs.append(gx)
                grads.append(gp)
            g = torch.stack(outs)
            if self._collect is not None:
                self._store(i0, stride, count, {k: torch.stack([d[k] for d in grads])
                                                for k in grads[0]}, scale)
        else:
            p = _progression(self.params, i0, stride, count)
            b = _progression(self.buffers, i0, stride, count)
            if self._collect is None:
                g = self._vx(p, b, x, lam)
            else:
                g, gp = self._vxp(p, b, x, lam)
                self._store(i0, stride, count, gp, scale)
        return torch.add(lam, g, alpha=scale)

    def _sweep_fn(self, length: int, with_g: bool, with_w: bool, collect: bool):
        key = (length, with_g, with_w, collect)
        if key not in self._sweeps:
            vjp_x, vjp_xp = self._vjp_x, self._vjp_xp

            def one(p, b, xs, lam, g, out_f, out_w, out_p, scale):
                # One interval of the adjoint: dependent transposed steps, written in place;
                # when collecting, the parameter cotangent of each step goes to out_p.
                for j in range(length - 1 + with_w):
                    pj = {k: v[j] for k, v in p.items()}
                    bj = {k: v[j] for k, v in b.items()}
                    if collect:
                        gx, gp = vjp_xp(pj, bj, xs[j], lam)
                        for k, v in gp.items():
                            out_p[k][j].copy_(v * scale)
                    else:
                        gx = vjp_x(pj, bj, xs[j], lam)
                    lam = torch.add(lam, gx, alpha=scale)
                    if g is not None:
                        lam = lam + g[j]
                    (out_f[j] if j < length - 1 else out_w).copy_(lam)
                return lam  # vmap needs an output; the results are already in place

            self._sweeps[key] = vmap(one, in_dims=(0, 0, 0, 0, 0 if with_g else None, 0,
                                                   0 if with_w else None,
                                                   0 if collect else None, None))
        return self._sweeps[key]

    def _batched_sweep(self, first, i0, stride, count, length, steps, p, b, u0, scale, g,
                       out_f, out_w):
        xs = _intervals({"x": self.inputs}, i0, stride, count, length, steps)["x"]
        out_p = None if self._collect is None else \
            _intervals(self._collect, i0, stride, count, length, steps)
        self._sweep_fn(length, g is not None, out_w is not None, out_p is not None)(
            p, b, xs, u0, g, out_f, out_w, out_p, scale)

    def parameter_grads(self, lam_next: torch.Tensor, scale: float, chunk: int = 256
                        ) -> list[dict[str, torch.Tensor]]:
        """``scale * (dF_n/dtheta_n)^T lam_{n+1}`` for every local layer, in depth order.

        Arguments:
            lam_next: ``lam_{a+1} .. lam_b`` (the adjoint at each local layer's output), shape
                ``(b - a, *S)``.
            scale: the step size ``h``.
            chunk: layers per batched call (bounds the memory of ``vmap``).

        Returns:
            One dict ``name -> gradient`` per local block (views of stacked tensors when batched).
        """
        n = len(self.blocks)
        states = self.inputs.flip(0)
        if not self.batched:
            out = []
            for i, blk in enumerate(self.blocks):
                names = [k for k, _ in blk.named_parameters()]
                p = {k: v.detach() for k, v in blk.named_parameters()}
                pull = vjp(lambda q, blk=blk, i=i: functional_call(blk, q, (states[i],)), p)[1]
                g = pull(lam_next[i])[0]
                out.append({k: g[k] * scale for k in names})
                self.counts.add(1)
            return out
        grads: dict[str, list[torch.Tensor]] = {k: [] for k in self.params_fwd}
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            g = self._vp({k: v[s:e] for k, v in self.params_fwd.items()},
                         {k: v[s:e] for k, v in self.buffers_fwd.items()},
                         states[s:e], lam_next[s:e])
            self.counts.add(e - s)
            for k in grads:
                grads[k].append(g[k])
        stacked = {k: torch.cat(v).mul_(scale) for k, v in grads.items()}
        return [{k: v[i] for k, v in stacked.items()} for i in range(n)]
