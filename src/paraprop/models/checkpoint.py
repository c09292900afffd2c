"""The checkpoint format of the models of this package: one torch file holding
``{"kind", "config", "state_dict"}``, read back with ``weights_only=True``.

Reading a checkpoint never runs code from the file and never allocates what the file cannot
justify:

- :func:`read_torch_file` loads with ``torch.load(..., weights_only=True)`` (tensors and plain
  containers only); a file that needs more (pickled Python objects) is refused, and every other
  failure (a directory, an empty, text, truncated or foreign file) becomes a ``ValueError`` that
  names the file, says what it is and what was expected.
- :func:`build_within_budget` builds the model from the checkpoint's config while watching every
  tensor the constructor allocates (each size is worked out on the ``meta`` device first) and
  every module, parameter and buffer it registers. A config that asks for more than the file
  can justify (a vocabulary of ``10**12``, a width of ``10**9``, a billion layers) is refused
  before the allocation, with a message that names the file and the config field.
"""

from __future__ import annotations

import math
import pickle
import re
import stat
import threading
import zipfile
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.utils._python_dispatch
import torch.utils._pytree

__all__ = ["Checkpointed", "build_within_budget", "load_checkpoint", "read_torch_file",
           "save_checkpoint"]

# A config may make the constructor allocate this much in all, or 8 times the file's size if
# more: parameters come back in float32 from a float16 file, masks and tables are not saved.
MIN_BUDGET_BYTES = 256 << 20
BUDGET_PER_FILE_BYTE = 8
# Modules, parameters and buffers a constructor may register per tensor of the state dict
# (measured: under 2 for the models of this package and diffusers' UNet2DModel), plus a margin.
REGISTRATIONS_PER_TENSOR = 8
MIN_REGISTRATIONS = 256
# No integer of a config (sizes, counts) may exceed this or the file's size in bytes, whichever
# is larger, checked before the constructor runs (it may build Python lists of that length).
MIN_INT_BOUND = 1 << 20


def save_checkpoint(kind: str, config: dict, state_dict: dict, path) -> None:
    """Write the checkpoint of a model of class ``kind`` to ``path`` (parents created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"kind": kind, "config": config, "state_dict": state_dict}, path)


# -- reading a torch file --------------------------------------------------------------------------
def _what_it_is(head: bytes, path: Path) -> tuple[str, bool]:
    """What a file that torch cannot load looks like, from its first bytes, and whether that
    says it all (``False``: it looks like a torch file, so torch's reason matters)."""
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            return ("a truncated or damaged torch file (a zip archive without its central "
                    "directory)", True)
        return "a zip archive that torch cannot read as a torch file", False
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file", True
    if head.startswith(b"\x80"):
        return "a damaged or truncated pickle (torch's legacy format)", False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
        lines = text.splitlines()
        return f"a text file (it starts with {(lines[0] if lines else text)[:40]!r})", True
    return f"not a torch file (it starts with the bytes {head[:8].hex(' ')})", True


_TORCH_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _reason(e: BaseException) -> str:
    """The informative first line of an exception of ``torch.load``."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()
             and not ln.strip().startswith(_TORCH_BOILERPLATE)]
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


def read_torch_file(path, expected: str, *, map_location="cpu"):
    """``torch.load(path, map_location=map_location, weights_only=True)``, with errors that
    name the file, say what it is and what was ``expected``.

    Arguments:
        path: the file.
        expected: what the caller wanted, for the messages (e.g. ``"a paraprop MADE
            checkpoint"``).
        map_location: as in ``torch.load``.

    Returns:
        What the file holds (tensors in plain containers).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a directory, not a regular file, an empty file, a file torch cannot read
            (text, truncated, another format), or one that holds pickled Python objects
            (loading them would run code from the file, so they are refused).
        OSError: the file cannot be read (permissions, I/O).
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (expected {expected})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path}: is a directory, not {expected}")
    cannot = f"{path}: cannot be read as {expected}: it is"
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block torch.load
        raise ValueError(f"{cannot} not a regular file (a FIFO, socket or device)")
    if st.st_size == 0:
        raise ValueError(f"{cannot} empty (0 bytes)")
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise OSError(f"{path}: cannot be read ({e.strerror or e}); expected {expected}") from e
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found:
            raise ValueError(
                f"{path}: cannot be read as {expected}: it holds pickled Python objects "
                f"({found.group(1)}), which torch.load(weights_only=True) refuses because "
                "loading them runs code from the file (expected tensors and plain containers "
                "only)") from None
        reason = _reason(e)
    except Exception as e:  # torch.load fails in many ways on a foreign or damaged file
        reason = _reason(e)
    what, says_all = _what_it_is(head, path)
    more = "" if says_all else f"; torch.load: {reason}"
    raise ValueError(f"{cannot} {what} ({st.st_size} bytes{more})") from None


# -- building a model from a config within a budget -----------------------------------------------
class _OverBudget(BaseException):  # not an Exception: a constructor's `except Exception` passes it
    def __init__(self, what: str, shape: tuple | None = None):
        super().__init__(what)
        self.what, self.shape = what, shape


def _meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _nbytes(out) -> tuple[int, tuple | None]:
    """Bytes of the tensors in ``out`` and the shape of the largest."""
    total, shape, largest = 0, None, -1
    for t in torch.utils._pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            n = t.numel() * t.element_size()
            total += n
            if n > largest:
                largest, shape = n, tuple(t.shape)
    return total, shape


class _Budget(torch.utils._python_dispatch.TorchDispatchMode):
    """Refuses (:class:`_OverBudget`) the operation that would take the tensors allocated under
    it past ``budget`` bytes in all, before running it: each new tensor's size comes from running
    the operation on ``meta`` tensors first (views and in-place operations allocate nothing;
    an operation without a meta kernel is counted after it ran)."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget, self.total = budget, 0

    def _count(self, n: int, shape, func) -> None:
        if self.total + n > self.budget:
            raise _OverBudget(f"need {func.__name__} of a tensor of shape {shape} ({_human(n)}, "
                              f"after {_human(self.total)}), more than the "
                              f"{_human(self.budget)}", shape)
        self.total += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable or getattr(func, "is_view", False):
            return func(*args, **kwargs)
        try:
            mkw = torch.utils._pytree.tree_map(_meta, kwargs)
            if any(a.name == "device" for a in func._schema.arguments):
                mkw["device"] = "meta"
            if "generator" in mkw:
                mkw["generator"] = None
            n, shape = _nbytes(func(*torch.utils._pytree.tree_map(_meta, args), **mkw))
        except Exception:  # no meta kernel: a factory's size argument, or what it made
            size = _size_argument(func, args, kwargs)
            if size is not None:
                self._count(math.prod(size) * 8, tuple(size), func)
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            self._count(*_nbytes(out), func)
            return out
        self._count(n, shape, func)
        return func(*args, **kwargs)


def _size_argument(func, args, kwargs) -> list[int] | None:
    """The ``size`` argument of a factory operation, if it has one."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "size":
            v = kwargs.get("size", args[i] if i < len(args) else None)
            if isinstance(v, list | tuple) and all(isinstance(x, int) for x in v):
                return list(v)
    return None


def _human(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"


def _int_fields(config: dict) -> list[tuple[str, int]]:
    """``(name, value)`` of the integer entries of ``config`` (and of its lists), seeds left
    out, largest first."""
    out = []
    for k, v in config.items():
        if "seed" in str(k):
            continue
        items = [(str(k), v)] if not isinstance(v, list | tuple) else \
            [(f"{k}[{i}]", x) for i, x in enumerate(v)]
        out += [(name, x) for name, x in items if isinstance(x, int) and not isinstance(x, bool)]
    return sorted(out, key=lambda kv: -abs(kv[1]))


def _suspects(config: dict, shape: tuple | None, above: int) -> list[tuple[str, int]]:
    """The config fields that most likely asked for a tensor of ``shape``: those equal to its
    largest dimension, else those that divide it (up to a factor 64, e.g. ``3 * hidden``), else
    the largest field; without a shape, the fields larger than ``above`` and within a factor
    16 of the largest."""
    fields = [(k, v) for k, v in _int_fields(config) if v > 1]
    if shape:
        d = max(shape)
        for test in (lambda v: d == v, lambda v: d % v == 0 and d // v <= 64):
            hits = [(k, v) for k, v in fields if test(v)]
            if hits:
                return hits[:3]
        return fields[:1]
    big = [(k, v) for k, v in fields if v > above and 16 * v >= fields[0][1]]
    return big[:3] or fields[:1]


def build_within_budget(build, config: dict, *, path, kind: str, file_bytes: int,
                        tensors: int):
    """``build(**config)``, refused before it allocates more than the checkpoint justifies.

    First, no integer of the config (seeds aside) may exceed ``max(2**20, file_bytes)``: a
    size or count of a real model is at most its number of weights. Then the constructor runs
    with a budget of ``max(256 MiB, 8 x file_bytes)`` for all the tensors it makes (each one's
    size found on the ``meta`` device before it is allocated) and ``max(256, 8 x tensors)``
    registrations of modules, parameters and buffers (a loop over many layers is stopped long
    before memory runs out).

    Arguments:
        build: the model's constructor (or a function of the config).
        config: its keyword arguments, from the checkpoint.
        path, kind: the file and the model kind, for the message.
        file_bytes: the checkpoint's size on disk.
        tensors: the number of tensors in its state dict.

    Returns:
        The model.

    Raises:
        ValueError: the config asks for more; the message names the file, the config field(s)
            that most likely did, and the allocation.
        TypeError, ValueError: what ``build`` raises for a config it refuses (passed through).
    """
    bound = max(MIN_INT_BOUND, file_bytes)
    big = [(k, v) for k, v in _int_fields(config) if abs(v) > bound]
    if big:
        named = ", ".join(f"{k}={v}" for k, v in big[:3])
        raise ValueError(
            f"{path}: the {kind} config in this checkpoint asks for an absurd model ({named}): "
            f"a size or count of a checkpoint of {file_bytes} bytes is at most {bound}, refused "
            "before building it. The file is damaged or was not written by this version of "
            "paraprop")
    budget = max(MIN_BUDGET_BYTES, BUDGET_PER_FILE_BYTE * file_bytes)
    limit = max(MIN_REGISTRATIONS, REGISTRATIONS_PER_TENSOR * tensors)
    owner = threading.get_ident()
    count = [0]

    def registered(*_):
        if threading.get_ident() == owner:
            count[0] += 1
            if count[0] > limit:
                raise _OverBudget(f"register more than the {limit} modules, parameters and "
                                  f"buffers that a state dict of {tensors} tensors in")

    hooks = torch.nn.modules.module
    handles = [hooks.register_module_module_registration_hook(registered),
               hooks.register_module_parameter_registration_hook(registered),
               hooks.register_module_buffer_registration_hook(registered)]
    try:
        with _Budget(budget):
            return build(**config)
    except _OverBudget as e:
        suspects = _suspects(config, e.shape, above=limit)
        named = ", ".join(f"{k}={v}" for k, v in suspects) or "(no integer field)"
        raise ValueError(
            f"{path}: the {kind} config in this checkpoint asks for an absurd model ({named}): "
            f"building it would {e.what} a checkpoint of {file_bytes} bytes justifies; refused "
            "before allocating it. The file is damaged or was not written by this version of "
            "paraprop") from None
    finally:
        for h in handles:
            h.remove()


# -- the checkpoint of a model ---------------------------------------------------------------------
def check_finite_weights(state: dict, path, option: str = "") -> None:
    """Every floating-point tensor of ``state`` must be finite: weights holding NaN or inf
    train to a loss of NaN and predict nothing.

    Raises:
        ValueError: naming the file, the first tensor with non-finite values and how many.
    """
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                kinds = " and ".join(k for k, m in (("NaN", torch.isnan(t)),
                                                     ("inf", torch.isinf(t))) if bool(m.any()))
                where = f"{option} {path}" if option else f"{path}"
                raise ValueError(
                    f"{where}: tensor {name!r} holds {int(bad.sum())} non-finite values "
                    f"({kinds}) among its {t.numel()}; expected finite weights (training from "
                    "them gives a loss of NaN, evaluating them meaningless outputs)")


def load_checkpoint(cls, kind: str, path, map_location):
    """A model of class ``cls`` from the checkpoint ``{"kind", "config", "state_dict"}`` that
    ``cls.save`` wrote at ``path``; every failure names the file.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a torch file of tensors (:func:`read_torch_file`), a checkpoint of
            another kind, a config the model refuses or one that asks for an absurd allocation
            (:func:`build_within_budget`), or weights that do not fit the config.
    """
    path = Path(path)
    expected = f"a paraprop {kind} checkpoint"
    ckpt = read_torch_file(path, expected, map_location=map_location)
    found = ckpt.get("kind") if isinstance(ckpt, dict) else None
    if found != kind:
        what = f"a {found} checkpoint" if isinstance(found, str) else \
            f"a {type(ckpt).__name__} without a model kind"
        raise ValueError(f"{path}: not {expected} (it holds {what})")
    cfg, state = ckpt.get("config"), ckpt.get("state_dict")
    if not isinstance(cfg, dict) or not isinstance(state, dict):
        raise ValueError(f"{path}: not {expected} (config or state_dict missing)")
    if not all(isinstance(k, str) for k in cfg):
        raise ValueError(f"{path}: bad {kind} config in the checkpoint: its keys must be "
                         f"strings, got {sorted(map(repr, cfg))[:5]}")
    check_finite_weights(state, path)
    try:
        model = build_within_budget(cls, cfg, path=path, kind=kind,
                                    file_bytes=path.stat().st_size, tensors=len(state))
    except ValueError as e:
        if str(e).startswith(f"{path}: "):
            raise
        raise ValueError(f"{path}: bad {kind} config in the checkpoint: {e}") from None
    except TypeError as e:
        raise ValueError(f"{path}: bad {kind} config in the checkpoint: {e}") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        errors = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()] or [str(e)]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(f"{path}: the weights do not fit the {kind} config: "
                         f"{errors[0].rstrip('.')}{more}") from None
    return model


class _Saveable(Protocol):
    """What :meth:`Checkpointed.save` reads from the module it is mixed into."""

    @property
    def config(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...


class Checkpointed:
    """``save`` / ``load`` for a model class with a ``config`` dict of its constructor's
    arguments; the checkpoint's kind is the class name."""

    load_in_eval: bool = False  # load() returns the model in eval mode

    def save(self: _Saveable, path: str | Path) -> None:
        """Save the config and state dict (``load`` of the same class rebuilds the model)."""
        save_checkpoint(type(self).__name__, self.config, self.state_dict(), path)

    @classmethod
    def load(cls, path: str | Path, map_location="cpu"):
        """The model saved by :meth:`save` at ``path``.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a checkpoint of this class (not a torch file of
                tensors, another model's, a config that asks for an absurd allocation, or
                weights that do not fit); the message names the file.
        """
        model = load_checkpoint(cls, cls.__name__, path, map_location)
        return model.eval() if cls.load_in_eval else model
