"""What the autograd Functions of the recurrent stacks (:mod:`paraprop.nn.rnn`,
:mod:`~paraprop.nn.gru`, :mod:`~paraprop.nn.lstm`, :mod:`~paraprop.nn.para_gru`,
:mod:`~paraprop.nn.para_lstm`) share: a layer's parallel solve, the layers' weights and
gradients in torch's order, what the forward saved, and the first-order-only backward that
records its run.

Every Function takes ``cfg``, the call's settings as the module built them (``"layers"``,
``"bias"``, ``"forward"``, ``"compute"``, ``"backward"``, ``"log"`` (the forward's list of
Solutions), ``"runs"`` (the module's :class:`~paraprop.nn.runs.RunLog`), ...).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from paraprop.first_order import refuse_second_order
from paraprop.nn.options import BACKWARDS, ParallelForward
from paraprop.nn.runs import BackwardRun, record_solve

__all__ = ["biases", "cast", "first_order_only", "layer_weights", "shifted", "solve_layer",
           "store_grads", "unpack_saved"]


def solve_layer(cfg: dict, adapter, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """One layer's outputs ``(T, B, H)`` for time-major inputs ``x`` by ``cfg["forward"]`` (a
    :class:`ParallelForward`): :func:`paraprop.solve` on the layer's
    :class:`paraprop.Recurrence` (no graph), in ``cfg["compute"]`` (``adapter`` holds weights of
    that dtype; float32 for a bf16 / fp16 module: the result is rounded to ``x``'s dtype), its
    Solution appended to ``cfg["log"]`` (:func:`paraprop.nn.runs.record_solve`)."""
    from paraprop.recurrence import Recurrence
    from paraprop.solve import solve

    fwd: ParallelForward = cfg["forward"]
    dtype, cdt = x.dtype, cfg["compute"]
    x, h0 = x.to(cdt), h0.to(cdt)
    rec = Recurrence(adapter, x.transpose(0, 1), h0)
    sol = solve(rec, rec.zeros(), method=fwd.solver, dim=-2, tol=cfg["forward_tol"],
                max_iters=fwd.max_iters, throw=fwd.throw)
    record_solve(cfg["log"], sol, tol=cfg["forward_tol"], compute_dtype=cdt)
    return sol.value.transpose(0, 1).to(dtype)


def layer_weights(weights: Sequence[torch.Tensor], k: int, bias: bool) -> list[torch.Tensor]:
    """Layer ``k``'s parameters in torch's order, ``[w_ih, w_hh]`` plus ``[b_ih, b_hh]`` with
    ``bias``, out of those of the whole stack (the list torch's kernels take)."""
    per = 4 if bias else 2
    return list(weights[k * per:(k + 1) * per])


def biases(w: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(b_ih, b_hh)`` of a layer's :func:`layer_weights` (``None`` without bias)."""
    return (w[2], w[3]) if len(w) == 4 else (None, None)


def store_grads(grads: list, k: int, bias: bool, g_ih: torch.Tensor, g_hh: torch.Tensor,
                g_b_ih: torch.Tensor | None = None, g_b_hh: torch.Tensor | None = None) -> None:
    """Put layer ``k``'s gradients at their parameters' places in ``grads`` (torch's order,
    as :func:`layer_weights`)."""
    per = 4 if bias else 2
    grads[k * per:(k + 1) * per] = (g_ih, g_hh, g_b_ih, g_b_hh)[:per]


def cast(tensors: Sequence[torch.Tensor | None], dtype: torch.dtype) -> list:
    """``tensors`` in ``dtype`` (a ``None`` stays ``None``)."""
    return [None if t is None else t.to(dtype) for t in tensors]


def shifted(first: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Time-major ``states`` one step back: the initial state ``first`` at step 0, then
    ``states[:-1]`` (each step's previous state)."""
    return torch.cat([first.unsqueeze(0), states[:-1]], 0)


def unpack_saved(ctx, lead: int = 0):
    """What a layer stack's scan Function saved, for its ``backward``: ``(cfg, layers,
    leading, weights, rest)``, where ``leading`` are the first ``lead`` saved tensors (e.g.
    ``h0``), ``weights`` the parameters of every layer in torch's order (:func:`layer_weights`)
    and ``rest`` what the layers saved. ``leading`` and ``weights`` come in ``cfg["compute"]``
    (float32 for a bf16 / fp16 module); the layers save the rest in it."""
    cfg = ctx.cfg
    nl = cfg["layers"]
    count = nl * (4 if cfg["bias"] else 2)
    saved = ctx.saved_tensors
    lead_t, weights = saved[:lead], saved[lead:lead + count]
    cdt = cfg.get("compute")
    if cdt is not None and weights and weights[0].dtype != cdt:
        lead_t = tuple(t.to(cdt) for t in lead_t)
        weights = tuple(w.to(cdt) for w in weights)
    return cfg, nl, lead_t, weights, saved[lead + count:]


def first_order_only(backward):
    """Decorate the ``backward`` of the scan Functions: gradients are computed without a graph,
    in ``cfg["compute"]`` and returned in the dtypes of the inputs, and when a graph is wanted
    (``create_graph=True``) they carry a node that refuses the second differentiation with a
    message naming the alternative, instead of torch's generic error. The layers' reverse
    recurrences (:func:`paraprop.nn.rnn.solve_hidden`) append their Solutions to
    ``cfg["backward_layers"]``, top layer first; the run becomes the module's
    ``last_backward``."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        cfg = ctx.cfg
        cdt, dtypes = cfg.get("compute"), cfg.get("input_dtypes")
        layers: list = []
        cfg["backward_layers"] = layers
        with torch.no_grad():
            if cdt is not None:
                grad_outputs = tuple(g.to(cdt) for g in grad_outputs)
            grads = backward(ctx, *grad_outputs)
            if dtypes is not None:   # computed in cdt: each gradient in its input's dtype
                grads = tuple(g.to(dt) if isinstance(g, torch.Tensor) and dt is not None else g
                              for g, dt in zip(grads, dtypes, strict=True))
        # the kind's name ("scan", "jacobi"), whatever settings the option object carries
        kind = next(k for k, c in BACKWARDS.items() if type(cfg["backward"]) is c)
        cfg["runs"].backward = BackwardRun(kind, tuple(reversed(layers)),
                                           grad_outputs[0].dtype)
        if not torch.is_grad_enabled():
            return grads
        message = (f"paraprop.nn.{cfg['name']}(backward={cfg['backward_name']}) computes "
                   "first-order gradients only (its backward pass is not itself "
                   "differentiable), so double backward / create_graph=True / hessians are not "
                   "supported; use backward='autograd' (with forward='sequential') for them")
        idx = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
        # the node hangs from the saved inputs and the incoming gradients, so that a second
        # differentiation with respect to the weights reaches it (not a silent None)
        anchors = tuple(t for t in (*ctx.saved_tensors, *grad_outputs)
                        if isinstance(t, torch.Tensor))
        carried = refuse_second_order(message, *(grads[i] for i in idx), anchors=anchors)
        out = list(grads)
        for i, g in zip(idx, carried, strict=True):
            out[i] = g
        return tuple(out)

    return wrapper
