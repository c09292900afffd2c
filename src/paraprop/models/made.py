"""MADE (Germain et al. 2015) with logistic, Gaussian and Bernoulli conditionals, as a sampler.

Ancestral sampling draws ``x_d ~ p(x_d | x_<d)`` for ``d = 1 .. D``: ``D`` dependent network
evaluations. With the noise drawn up front, sampling is the triangular system
``x = g(x, noise)`` (Song et al. 2021, §5.3.1, eq. 9): position ``d`` of ``g`` is the inverse CDF
of the ``d``-th conditional at its noise. :meth:`MADE.sampling_map` builds that system for
:func:`paraprop.sampling.sample`.

The system computes its output layer in fixed chunks of positions
(:func:`paraprop.models.masked.chunk_positions`: at most 16, of at least 32 positions), and its
``update`` (one position of the ancestral sampler, a few of Jacobi-GS) computes the chunks that
hold the positions asked for with the same products: a product over a subset of the output rows
is another kernel call, which BLAS may round differently from the full product (it does on this
project's AVX-512 machines, in float32 and float64), so the ancestral sampler would not be
bitwise the fixed point of the full map that Jacobi returns. With the chunks it is, in every
dtype and on every device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from paraprop import checks
from paraprop.models.checkpoint import Checkpointed
from paraprop.models.masked import MaskedLinear, chunk_positions, made_masks

CONDITIONALS = {"logistic": 2, "gaussian": 2, "bernoulli": 1}
_LOG_SCALE_MID, _LOG_SCALE_HALF = -2.0, 4.0  # log-scales are squashed into [-6, 2]
# attributes fixed at construction (assigning one afterwards is refused by name)
FIXED = ("features", "hidden", "conditional", "order", "seed", "k", "perm", "natural", "config")


class MADE(Checkpointed, nn.Module):
    """A masked autoencoder for distribution estimation.

    Arguments:
        features: dimension ``D`` of the data.
        hidden: widths of the hidden layers (ReLU).
        conditional: ``"logistic"`` (continuous pixels, as in Song et al.), ``"gaussian"`` or
            ``"bernoulli"`` (binary data).
        order: a permutation of ``0 .. D-1``; feature ``i`` is generated at step ``order[i]``
            (``None``: natural order).
        seed: seed of the weight initialisation.

    The constructor's settings are fixed once built (the masks encode ``order``, the layers'
    shapes ``features``, ``hidden`` and ``conditional``): assigning one of them (or ``k``,
    ``perm``, ``natural``, ``config``) afterwards raises ``AttributeError`` naming it. An
    ``order`` buffer changed in place is checked at the next call: honoured when the masks and
    ``perm`` agree with it (``load_state_dict`` of another MADE's weights), refused otherwise.

    Raises:
        ValueError: bad ``features``, ``hidden``, ``conditional``, ``order`` or ``seed``; (at a
            call) an ``order`` changed in place that the masks or ``perm`` do not encode.
        AttributeError: (after construction) a constructor setting assigned.

    Example:
        >>> m = MADE(64, hidden=(128, 128))
        >>> m.log_prob(torch.rand(5, 64)).shape
        torch.Size([5])
    """

    order: torch.Tensor  # registered buffers
    perm: torch.Tensor

    def __init__(self, features: int, hidden: tuple[int, ...] = (512, 512),
                 conditional: str = "logistic", order=None, seed: int = 0):
        super().__init__()
        checks.positive_int("features", features)
        if not isinstance(hidden, tuple | list) or not hidden or not all(
                checks.is_int(h) and h >= 1 for h in hidden):
            raise ValueError(f"hidden must be a non-empty tuple of positive ints, got {hidden!r}")
        hidden = tuple(hidden)
        checks.one_of("conditional", conditional, CONDITIONALS)
        checks.nonneg_int("seed", seed)
        if order is None:
            order_t = torch.arange(features)
        else:
            order_t = _as_order(order, features)
        self.config: dict[str, Any] = {"features": features, "hidden": list(hidden),
                       "conditional": conditional, "order": order_t.tolist(), "seed": seed}
        self.features, self.conditional = features, conditional
        self.k = CONDITIONALS[conditional]
        g = torch.Generator().manual_seed(seed)
        masks = made_masks(features, hidden, order=order_t + 1)
        sizes = [features, *hidden]
        self.hidden = nn.ModuleList(MaskedLinear(i, o, m)
                                    for i, o, m in zip(sizes, sizes[1:], masks, strict=False))
        self.out = MaskedLinear(sizes[-1], self.k * features, masks[-1].repeat(self.k, 1))
        with torch.no_grad():
            for layer in [*self.hidden, self.out]:
                bound = 1.0 / math.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=g)
                layer.bias.uniform_(-bound, bound, generator=g)
        self.register_buffer("order", order_t)
        self.register_buffer("perm", torch.argsort(order_t))  # perm[k]: feature of step k
        self.natural = bool(torch.equal(order_t, torch.arange(features)))
        self.__dict__["_order_key"] = self._order_version()
        self.__dict__["_built"] = True

    def __setattr__(self, name: str, value) -> None:
        if name in FIXED and self.__dict__.get("_built", False):
            what = (f"build a new MADE({name}=...) instead (and load weights that fit it)"
                    if name in FIXED[:5] else
                    f"{name} follows from them; build a new MADE with the settings you need")
            raise AttributeError(
                f"MADE.{name} cannot be assigned after construction: the masks and layer shapes "
                "were built from the constructor's features, hidden, conditional and order "
                f"(seed: the initial weights), so a new value would be ignored; {what}")
        super().__setattr__(name, value)

    def _order_version(self) -> tuple:
        return (self.order._version, self.order.data_ptr(), self.perm._version,
                self.perm.data_ptr())

    def _check_order(self) -> None:
        """At every call (a few integer reads): an ``order`` / ``perm`` buffer changed in place
        since the last check (or moved: ``.to``) must still be a permutation that ``perm`` and
        the masks encode; ``natural`` and ``config`` then follow it."""
        key = self._order_version()
        if key == self.__dict__.get("_order_key"):
            return
        D = self.features
        order = self.order.detach().cpu()
        if order.shape != (D,) or not torch.equal(order.sort().values, torch.arange(D)):
            raise ValueError(f"MADE.order must be a permutation of 0..{D - 1} (changed in place "
                             f"since construction), got {order.tolist()}")
        if not torch.equal(self.perm.detach().cpu(), torch.argsort(order)):
            raise ValueError("MADE.perm must be argsort(MADE.order) (one of them was changed in "
                             f"place): order {order.tolist()}, perm "
                             f"{self.perm.detach().cpu().tolist()}")
        masks = made_masks(D, tuple(self.config["hidden"]), order=order + 1)
        layers = [*self.hidden, self.out]
        masks[-1] = masks[-1].repeat(self.k, 1)
        if any(not torch.equal(layer.mask.detach().cpu(), m) for layer, m in
               zip(layers, masks, strict=True)):
            raise ValueError(
                f"MADE.order was changed in place to {order.tolist()}, but the network's masks "
                f"encode the order it was built with; the order of a MADE is fixed at "
                "construction: build MADE(order=...) (or load_state_dict a MADE's weights, "
                "which carry their order and masks together)")
        d = self.__dict__
        d["natural"] = bool(torch.equal(order, torch.arange(D)))
        d["config"] = {**self.config, "order": order.tolist()}
        d["_order_key"] = key

    # -- density ------------------------------------------------------------------------------
    def _features(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return h

    def _params(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.conditional == "bernoulli":
            return {"logits": raw}
        loc, s = raw.chunk(2, dim=-1)
        return {"loc": loc, "log_scale": _squash(s)}

    def conditional_params(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameters of every conditional ``p(x_d | x_<d)``, each ``(N, D)``: ``loc`` and
        ``log_scale`` (logistic, Gaussian) or ``logits`` (Bernoulli)."""
        self._check_order()
        self._check_x(x)
        return self._params(self.out(self._features(x)))

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """``log p(x)`` per sample, shape ``(N,)`` (a density for the continuous conditionals)."""
        p = self.conditional_params(x)
        if self.conditional == "bernoulli":
            return -F.binary_cross_entropy_with_logits(p["logits"], x, reduction="none").sum(-1)
        z = (x - p["loc"]) * torch.exp(-p["log_scale"])
        if self.conditional == "logistic":
            lp = -z - 2 * F.softplus(-z) - p["log_scale"]
        else:
            lp = -0.5 * z * z - 0.5 * math.log(2 * math.pi) - p["log_scale"]
        return lp.sum(-1)

    def _check_x(self, x):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (N, {self.features}), got {shape}")

    # -- sampling as a triangular system ------------------------------------------------------
    def noise_shape(self, n: int) -> tuple[int, ...]:
        return (n, self.features)

    def draw_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """The noise of ``n`` samples: standard logistic, standard normal, or uniform (the
        inverse-CDF noise of a Bernoulli). Drawn on the generator's device (CPU without one) in
        the model's dtype, then moved to the model's device: the same seed gives the same
        sample on every device."""
        p = self.out.weight
        shape = self.noise_shape(n)
        where = generator.device if generator is not None else torch.device("cpu")
        if self.conditional == "gaussian":
            return torch.randn(shape, generator=generator, dtype=p.dtype,
                               device=where).to(p.device)
        u = torch.rand(shape, generator=generator, dtype=p.dtype, device=where).to(p.device)
        if self.conditional == "bernoulli":
            return u
        eps = torch.finfo(p.dtype).eps
        return torch.logit(u.clamp(eps, 1 - eps))

    def sampling_map(self, noise: torch.Tensor) -> _MADESampler:
        """The triangular system whose solution is the ancestral sample for ``noise``."""
        self._check_order()
        return _MADESampler(self, noise)



def _squash(s: torch.Tensor) -> torch.Tensor:
    """Raw log-scales squashed into ``[-6, 2]``."""
    return _LOG_SCALE_MID + _LOG_SCALE_HALF * torch.tanh((s - _LOG_SCALE_MID) / _LOG_SCALE_HALF)


def _as_order(order, features: int) -> torch.Tensor:
    """``order`` as a long tensor, checked to be a permutation of ``0 .. features-1``."""
    if isinstance(order, torch.Tensor):
        ok = not order.is_floating_point() and not order.is_complex() \
            and order.dtype != torch.bool
    else:
        try:
            items = list(order)
        except TypeError:
            items = None
        ok = items is not None and all(checks.is_int(i) for i in items)
    if not ok:
        raise ValueError(f"order must be a permutation of 0..{features - 1} (ints), got "
                         f"{order!r}")
    order_t = torch.as_tensor(order if isinstance(order, torch.Tensor) else items,
                              dtype=torch.long)
    if order_t.shape != (features,) or not torch.equal(order_t.sort().values,
                                                       torch.arange(features)):
        raise ValueError(f"order must be a permutation of 0..{features - 1}, got "
                         f"{order_t.tolist()}")
    return order_t


class _MADESampler:
    """``x = g(x, noise)`` in sampling order (position ``k`` is feature ``perm[k]``).

    The output layer's rows are taken once in sampling order, position-major (the ``k``
    parameters of a position side by side), and multiplied in chunks of ``step`` positions
    (:func:`paraprop.models.masked.chunk_positions`): the full map computes every chunk,
    ``update`` the chunks holding its positions, with the same products on the same slices
    (see the module doc).
    """

    def __init__(self, model: MADE, noise: torch.Tensor):
        m = model
        self.m, self.noise = m, noise
        self.x0 = torch.zeros_like(noise)
        self.dim = -1
        D, k = m.features, m.k
        self.step = chunk_positions(D)   # positions per chunk
        rows = (m.perm[:, None] + D * torch.arange(k, device=m.perm.device)[None]).reshape(-1)
        self.w = m.out.masked_weight().index_select(0, rows)   # (D k, hidden)
        self.b = m.out.bias.index_select(0, rows)
        self.noise_s = noise if m.natural else noise.index_select(-1, m.perm)

    def to_data(self, xo: torch.Tensor) -> torch.Tensor:
        """From sampling order to feature order."""
        return xo if self.m.natural else xo.index_select(-1, self.m.order)

    def _chunk(self, h: torch.Tensor, c: int) -> torch.Tensor:
        """The raw outputs of the positions of chunk ``c``: ``(B, n, k)``."""
        k, lo = self.m.k, c * self.step
        hi = min(lo + self.step, self.m.features)
        return F.linear(h, self.w[lo * k : hi * k], self.b[lo * k : hi * k]).view(
            h.shape[0], hi - lo, k)

    def _transform(self, raw: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The inverse CDF at ``noise`` of the conditionals with raw parameters ``raw``
        ``(B, n, k)``."""
        if self.m.conditional == "bernoulli":
            return (noise < torch.sigmoid(raw[..., 0])).to(noise.dtype)
        return raw[..., 0] + torch.exp(_squash(raw[..., 1])) * noise

    def __call__(self, xo: torch.Tensor) -> torch.Tensor:
        h = self.m._features(self.to_data(xo))
        chunks = -(-self.m.features // self.step)
        raw = torch.cat([self._chunk(h, c) for c in range(chunks)], dim=1)
        return self._transform(raw, self.noise_s)

    def update(self, xo: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        h = self.m._features(self.to_data(xo))
        positions = index.tolist()   # one host read per call: which chunks to compute
        chunks = sorted({p // self.step for p in positions})
        first = {c: i * self.step for i, c in enumerate(chunks)}   # offset in `raw`
        raw = torch.cat([self._chunk(h, c) for c in chunks], dim=1)
        local = [first[p // self.step] + p % self.step for p in positions]
        pick = torch.tensor(local, device=raw.device)
        return self._transform(raw.index_select(1, pick), self.noise_s.index_select(-1, index))
