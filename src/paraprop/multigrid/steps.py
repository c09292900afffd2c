"""Steppers: apply many residual steps ``u -> u + s F_k(u)`` at once, forward or adjoint.

The MGRIT solver (:mod:`paraprop.multigrid.mgrit`) only ever asks for steps whose fine indices
form an arithmetic progression ``k = first, first + stride, ...`` (the same position in every
coarse interval). A stepper turns that into one batched computation when the blocks share an
architecture: the parameters of all blocks are stacked once per solve, the progression is a
strided view of the stack, and ``torch.func.vmap`` over ``torch.func.functional_call`` evaluates
all the intervals in one call -- the single-device concurrency that Kirby et al. (2020, §3.2) get
from CUDA streams. Otherwise the blocks are called one by one.

:class:`ForwardStepper` applies ``u + s F_n(u)``. :class:`AdjointStepper` applies the transposed
linearised step ``lam + s J_n(u_n)^T lam`` (a vector-Jacobian product at the stored forward state
``u_n``), with the steps numbered backwards in depth, and computes the parameter gradients
``s (dF_n/dtheta_n)^T lam_{n+1}``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

__all__ = ["AdjointStepper", "ForwardStepper", "block_signature", "shares_architecture",
           "stack_state"]


def block_signature(block: nn.Module) -> tuple:
    """What must agree for blocks to be evaluated by one ``vmap``: class, structure (repr),
    parameter and buffer names, shapes and dtypes."""
    return (type(block), repr(block),
            tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()))


def shares_architecture(blocks: Sequence[nn.Module]) -> bool:
    first = block_signature(blocks[0])
    return all(block_signature(b) == first for b in blocks[1:])


def stack_state(blocks: Sequence[nn.Module]) -> tuple[dict, dict]:
    """Stacked (detached) parameters and buffers of identically shaped blocks: name -> (n, ...)."""
    params = {n: torch.stack([dict(b.named_parameters())[n].detach() for b in blocks])
              for n, _ in blocks[0].named_parameters()}
    bufs = {n: torch.stack([dict(b.named_buffers())[n] for b in blocks])
            for n, _ in blocks[0].named_buffers()}
    return params, bufs


def _progression(d: dict, first: int, stride: int, count: int):
    """Strided views ``t[first : first + stride * count : stride]`` of every stacked tensor."""
    stop = first + stride * (count - 1) + 1
    return {k: v[first:stop:stride] for k, v in d.items()}


class _Counts:
    def __init__(self):
        self.evaluations = 0  # layer evaluations (hardware-independent work)
        self.calls = 0  # batched or single calls (sequential launches)

    def add(self, count: int) -> None:
        self.evaluations += count
        self.calls += 1


class ForwardStepper:
    """``u_k + s F_k(u_k)`` for the local blocks ``blocks[k - offset]``.

    Arguments:
        blocks: this rank's blocks, in depth order.
        offset: the global index of ``blocks[0]``.
        batched: evaluate progressions with one ``vmap`` over stacked parameters (needs blocks
            that share an architecture) or one block at a time.
        stacked: ``(params, buffers)`` stacked by :func:`stack_state` (computed when omitted).
    """

    def __init__(self, blocks: Sequence[nn.Module], offset: int = 0, *, batched: bool = True,
                 stacked: tuple[dict, dict] | None = None):
        self.blocks = list(blocks)
        self.offset = offset
        self.batched = batched
        self.counts = _Counts()
        if batched:
            self.params, self.buffers = stacked if stacked is not None else stack_state(blocks)
            template = self.blocks[0]

            def f(p, b, x):
                return functional_call(template, (p, b), (x,))

            self._vf = vmap(f)

    def _check(self, out: torch.Tensor, u: torch.Tensor, k: int) -> None:
        if out.shape != u.shape:
            raise ValueError(f"block {k} maps a state of shape {tuple(u.shape[1:])} to "
                             f"{tuple(out.shape[1:])}; residual blocks must keep the shape")

    def step(self, first: int, stride: int, count: int, u: torch.Tensor, scale: float
             ) -> torch.Tensor:
        """``u[j] + scale * F_{first + j*stride}(u[j])`` for ``j < count``; ``u``: (count, *S)."""
        self.counts.add(count)
        i0 = first - self.offset
        if count == 1 or not self.batched:
            outs = []
            for j in range(count):
                f = self.blocks[i0 + j * stride](u[j])
                if f.shape != u[j].shape:
                    self._check(f[None], u[j : j + 1], first + j * stride)
                outs.append(f)
            f = outs[0][None] if count == 1 else torch.stack(outs)
        else:
            f = self._vf(_progression(self.params, i0, stride, count),
                         _progression(self.buffers, i0, stride, count), u)
            if f.shape != u.shape:
                self._check(f, u, first)
        return torch.add(u, f, alpha=scale)


class AdjointStepper:
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
    """

    def __init__(self, blocks: Sequence[nn.Module], a: int, n_total: int, states: torch.Tensor,
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
            params, bufs = stacked if stacked is not None else stack_state(self.blocks)
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

            self._vx = vmap(vjp_x)
            self._vp = vmap(vjp_p)

    def _block(self, i: int) -> nn.Module:
        return self.blocks[len(self.blocks) - 1 - i]

    def step(self, first: int, stride: int, count: int, lam: torch.Tensor, scale: float
             ) -> torch.Tensor:
        """``lam[j] + scale * J^T lam[j]`` at solve steps ``first + j*stride``."""
        self.counts.add(count)
        i0 = first - self.offset
        stop = i0 + stride * (count - 1) + 1
        x = self.inputs[i0:stop:stride]
        if count == 1 or not self.batched:
            outs = []
            for j in range(count):
                _, pull = vjp(self._block(i0 + j * stride), x[j])
                outs.append(pull(lam[j])[0])
            g = outs[0][None] if count == 1 else torch.stack(outs)
        else:
            g = self._vx(_progression(self.params, i0, stride, count),
                         _progression(self.buffers, i0, stride, count), x, lam)
        return torch.add(lam, g, alpha=scale)

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
                _, pull = vjp(lambda q, blk=blk, i=i: functional_call(blk, q, (states[i],)), p)
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
