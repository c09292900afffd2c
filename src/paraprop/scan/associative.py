"""``associative_scan``: prefix combinations under any associative operator."""

from __future__ import annotations

from collections.abc import Callable

import torch

from paraprop import checks
from paraprop.scan import blelloch, chunked, hillis_steele, sequential
from paraprop.scan.linear import KERNELS, METHODS

# The methods of paraprop.scan.METHODS that take any operator (not the recurrence kernels).
ASSOCIATIVE_METHODS = tuple(m for m in METHODS if m not in KERNELS)


def associative_scan(elems, combine: Callable, *, dim: int = 0, exclusive: bool = False,
                     reverse: bool = False, identity=None, method: str = "auto",
                     levels: int | None = None, chunk_size: int | None = None):
    """Prefix combinations ``y_i = x_0 ⊕ x_1 ⊕ ... ⊕ x_i`` along ``dim``.

    ``⊕`` must be associative; it need not be commutative (matrix products are the typical
    case: back-propagation is the exclusive scan of the transposed Jacobians under
    ``A ⋄ B = B A``, BPPSA). Every method returns the sequential result up to
    floating-point reassociation.

    Arguments:
        elems: a tensor, or a tuple/list of tensors, all of the same length ``T >= 1`` along
            ``dim``: element ``i`` is the slice ``i`` of every tensor.
        combine: ``combine(a, b)`` returns ``a ⊕ b`` (``a`` comes first in scan order), with
            ``a`` and ``b`` structured like ``elems``. It must work on many pairs at once: the
            scan passes slices with any length along ``dim`` (all other dims as in ``elems``),
            and must return new tensors of ``b``'s shapes.
        dim: the scan dimension.
        exclusive: ``y_0 = identity`` and ``y_i = x_0 ⊕ ... ⊕ x_{i-1}``.
        reverse: scan from the end: ``y_i = x_{T-1} ⊕ ... ⊕ x_i`` (flip, scan, flip).
        identity: one element (``elems``' structure without ``dim``, broadcastable); required
            for ``exclusive=True`` and used only there.
        method: ``"sequential"`` (``T - 1`` calls of ``combine``), ``"blelloch"`` (BPPSA's
            modified Blelloch scan: ``2 log2 T`` calls, ``2 T`` combines, operands reversed in
            the down-sweep), ``"hillis_steele"`` (``log2 T`` calls, ``T log2 T`` combines),
            ``"chunked"`` (about ``3 sqrt(T)`` calls, ``2 T`` combines) or ``"auto"``
            (``sequential`` for ``T <= 16``, else ``blelloch``): :data:`ASSOCIATIVE_METHODS`.
            ``"native"`` and ``"triton"`` are kernels of :func:`linear_recurrence` only.
        levels: ``"blelloch"`` only: tree levels run in parallel (BPPSA's cap); the
            ``ceil(T / 2^levels)`` block results at the top are scanned sequentially.
        chunk_size: ``"chunked"`` only: chunk length (default ``ceil(sqrt(T / 2))``).

    Returns:
        Tensors structured and shaped like ``elems``.

    Raises:
        TypeError: ``elems`` not a tensor or a tuple/list of tensors, ``combine`` not callable
            or returning the wrong structure.
        ValueError: mismatched lengths along ``dim``, empty input, unknown ``method``
            or a kernel method (``"native"``, ``"triton"``), ``exclusive`` without
            ``identity``, options a method does not use, ``combine``
            returning wrong shapes.

    Example:
        >>> M = torch.randn(50, 3, 3)                       # running matrix products
        >>> P = associative_scan(M, lambda a, b: b @ a, method="blelloch")
        >>> torch.allclose(P[2], M[2] @ M[1] @ M[0], atol=1e-5)
        True
    """
    single = isinstance(elems, torch.Tensor)
    if single:
        leaves = [elems]
    elif isinstance(elems, tuple | list) and elems and all(isinstance(x, torch.Tensor)
                                                           for x in elems):
        leaves = list(elems)
    else:
        raise TypeError("elems must be a tensor or a non-empty tuple/list of tensors, got "
                        f"{type(elems).__name__}")
    checks.callable_arg("combine", combine)
    checks.one_of("method", method, METHODS)
    if method in KERNELS:
        raise ValueError(f"associative_scan has no method {method!r}: the native and Triton "
                         "kernels run linear recurrences only (paraprop.scan.linear_recurrence); "
                         f"choose one of {', '.join(ASSOCIATIVE_METHODS)}")
    if levels is not None and method != "blelloch":
        raise ValueError(f"levels is only used by method='blelloch', not {method!r}")
    checks.nonneg_int("levels", levels, allow_none=True)
    if chunk_size is not None and method != "chunked":
        raise ValueError(f"chunk_size is only used by method='chunked', not {method!r}")
    checks.positive_int("chunk_size", chunk_size, allow_none=True)
    if exclusive and identity is None:
        raise ValueError("exclusive=True needs identity= (one element, e.g. torch.eye(H) for "
                         "matrix products)")
    ndim = leaves[0].dim()
    if ndim == 0 or not -ndim <= dim < ndim:
        raise ValueError(f"dim={dim} is out of range for elems of shape {tuple(leaves[0].shape)}")
    dim = dim % ndim
    lengths = {x.shape[dim] for x in leaves if x.dim() > dim}
    if len(lengths) != 1 or any(x.dim() <= dim for x in leaves):
        raise ValueError(f"every tensor of elems needs the same length along dim={dim}; got "
                         f"shapes {[tuple(x.shape) for x in leaves]}")
    n = lengths.pop()
    if n < 1:
        raise ValueError(f"elems must have length >= 1 along dim={dim}, got 0")

    def inner(a: list, b: list) -> list:
        res = combine(a[0] if single else type(elems)(a), b[0] if single else type(elems)(b))
        out = [res] if single and isinstance(res, torch.Tensor) else res
        if not isinstance(out, tuple | list) or len(out) != len(b) or not all(
                isinstance(x, torch.Tensor) for x in out):
            raise TypeError(f"combine must return {'a tensor' if single else f'{len(b)} tensors'}"
                            f" structured like elems, got {type(res).__name__}")
        for x, y in zip(out, b, strict=True):
            if x.shape != y.shape:
                raise ValueError(f"combine returned shape {tuple(x.shape)} for operands of shape "
                                 f"{tuple(y.shape)}; it must keep the shape of its operands")
        return list(out)

    if reverse:
        leaves = [x.flip(dim) for x in leaves]
    if method == "auto":
        method = "sequential" if n <= 16 else "blelloch"
    if exclusive:
        if method == "blelloch":
            body = blelloch.exclusive(leaves, inner, dim, levels)
        else:
            body = _inclusive(leaves, inner, dim, method, chunk_size)
            body = [torch.cat([y.narrow(dim, 0, 1), y.narrow(dim, 0, n - 1)], dim) for y in body]
        ident = [identity] if single else list(identity)
        if len(ident) != len(leaves):
            raise TypeError("identity must be structured like elems")
        out = []
        for y, e in zip(body, ident, strict=True):
            first = torch.as_tensor(e, dtype=y.dtype, device=y.device)
            if first.dim() == y.dim() - 1:  # one element without the scan dim
                first = first.unsqueeze(dim)
            first = first.expand_as(y.narrow(dim, 0, 1))
            out.append(torch.cat([first, y.narrow(dim, 1, n - 1)], dim))
    else:
        out = _inclusive(leaves, inner, dim, method, chunk_size, levels)
    if reverse:
        out = [y.flip(dim) for y in out]
    return out[0] if single else type(elems)(out)


def _inclusive(leaves, combine, dim, method, chunk_size, levels=None):
    if method == "sequential":
        return sequential.scan(leaves, combine, dim)
    if method == "hillis_steele":
        return hillis_steele.scan(leaves, combine, dim)
    if method == "chunked":
        return chunked.scan(leaves, combine, dim, chunk_size)
    return blelloch.scan(leaves, combine, dim, levels)
