"""A diffusers pipeline's denoiser call as :func:`paraprop.diffusion.accelerate` reads it: its
arguments by name (:func:`read_call`), split into the guidance halves and tiled over a window's
steps (:func:`has_rows`, :func:`half`, :func:`tile`), compared with an earlier call's
(:func:`same_kwargs`), and its output rebuilt around a served tensor (:func:`wrap`); and
:class:`FallThrough`, raised where paraprop does not solve a run.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch


class FallThrough(Exception):
    """Raised inside a run where paraprop does not solve it; the message is the reason."""


@dataclasses.dataclass
class Call:
    """A denoiser call, split into what :class:`~paraprop.diffusion.pipeline_run.Run` reads:
    the input rows, the timestep and the other arguments by name (the input's and the
    timestep's names kept to call it back), and whether it asked for an output object."""

    x: torch.Tensor
    t: torch.Tensor
    kwargs: dict[str, Any]
    x_name: str
    t_name: str
    return_dict: bool = False   # the output wanted as the denoiser's output object


def bind(method, args, kwargs) -> dict[str, Any]:
    """``method``'s arguments by name as a call with ``args`` and ``kwargs`` binds them
    (``{}`` where they do not bind)."""
    try:
        return dict(inspect.signature(method).bind(*args, **kwargs).arguments)
    except TypeError:
        return {}


def read_call(original, args, kwargs) -> Call | None:
    """The denoiser call's input and timestep by name, the rest as keyword arguments."""
    try:
        sig = inspect.signature(original)
        bound = sig.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    ret = sig.parameters.get("return_dict")
    if not params or "timestep" not in bound or ret is None:
        return None
    return_dict = bound.get("return_dict", ret.default)
    if not isinstance(return_dict, bool):
        return None
    x_name = params[0].name
    x, t = bound.get(x_name), bound["timestep"]
    if not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor):
        return None
    rest: dict[str, Any] = {}
    for p in params[1:]:
        if p.name not in bound or p.name in ("timestep", "return_dict"):
            continue
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            if bound[p.name]:
                return None   # extra positional arguments: not passed back by name
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            rest.update(bound[p.name])
        else:
            rest[p.name] = bound[p.name]
    return Call(x, t, rest, x_name, "timestep", return_dict)


def output_type_of(cls: type) -> type:
    """``cls`` where the denoiser's output object can be rebuilt around a tensor (a dataclass
    whose first field is the output, as diffusers' ``ModelOutput`` s are), else
    :class:`FallThrough`."""
    fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
    if not fields or any(f.name != fields[0].name and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING for f in fields):
        raise FallThrough(f"the denoiser's output {cls.__name__} (return_dict=True) cannot be "
                          "rebuilt around a tensor (a dataclass whose first field is the output)")
    return cls


def wrap(call: Call, out: torch.Tensor, output_type: type | None):
    """The denoiser's return value around ``out``, as ``call`` asked for it (``output_type``:
    the output object's class, :func:`output_type_of`, where it asked for one)."""
    if not call.return_dict:
        return (out,)
    assert output_type is not None
    field = dataclasses.fields(output_type)[0].name
    return output_type(**{field: out})


def has_rows(v, rows: int) -> bool:
    """Whether ``v`` (a tensor, or a dict of them) holds ``rows`` rows: per-sample."""
    if isinstance(v, torch.Tensor):
        return v.dim() > 0 and v.shape[0] == rows
    if isinstance(v, dict) and v:
        return all(has_rows(u, rows) for u in v.values())
    return False


def half(v, B: int, which: int):
    """The half ``which`` (0 or 1) of ``v``'s ``2 B`` rows (a tensor, or a dict of them)."""
    if isinstance(v, dict):
        return {k: half(u, B, which) for k, u in v.items()}
    return v[which * B:(which + 1) * B]


def tile(v, B: int, n: int):
    """``v`` repeated for ``n`` steps where it holds ``B`` rows (per sample), else as it is."""
    if n == 1 or not has_rows(v, B):
        return v
    if isinstance(v, dict):
        return {k: tile(u, B, n) for k, u in v.items()}
    return v.repeat((n,) + (1,) * (v.dim() - 1))


def same_kwargs(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    """Whether two calls' other arguments are the same (tensors bit for bit)."""
    if a is None or set(a) != set(b):
        return False
    return all(_same(a[k], b[k]) for k in a)


def _same(u, v) -> bool:
    if u is v:
        return True
    if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor):
        return u.dtype == v.dtype and u.shape == v.shape and bool(torch.equal(u, v))
    if isinstance(u, dict) and isinstance(v, dict):
        return set(u) == set(v) and all(_same(u[k], v[k]) for k in u)
    try:
        return bool(u == v)
    except Exception:   # an object without a plain equality: not the same
        return False


__all__ = ["Call", "FallThrough", "bind", "half", "has_rows", "output_type_of", "read_call",
           "same_kwargs", "tile", "wrap"]
