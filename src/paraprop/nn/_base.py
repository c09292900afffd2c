"""What the drop-in recurrent modules share: option checks (at construction and at every call),
input plumbing, the backward switch, the compute dtype of low-precision modules, the refusals
of torch.jit and torch.autocast, and the records of what the last call ran. What their autograd
Functions share is :mod:`paraprop.nn.stack`."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence

from paraprop.nn.options import (
    AutoBackward,
    AutogradBackward,
    JacobiBackward,
    ParallelForward,
    ScanBackward,
    SequentialForward,
    backward_option,
    check_pair,
    describe,
    forward_option,
    resolve,
)
from paraprop.nn.runs import BackwardRun, RunLog
from paraprop.result import Solution

# bf16 / fp16 modules: the scan backward, the Jacobian factors and the parallel forward compute
# in float32 (the sequential forward stays torch's kernel in the module's dtype)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scan / Jacobi backward, the Jacobian factors and a parallel forward of a
    module in ``dtype`` compute in: float32 for bfloat16 and float16 (their rounding would
    otherwise accumulate over the ``T`` steps of the scan), the dtype itself otherwise."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def check_options(cls_name: str, *, dropout, bidirectional, proj_size) -> None:
    """Reject the torch options the scan backward does not implement (at construction, and at
    every call: the attributes may be assigned after construction)."""
    if bidirectional:
        raise NotImplementedError(
            f"paraprop.nn.{cls_name} does not support bidirectional=True; use "
            f"torch.nn.{cls_name} (or two modules, one on the flipped sequence)")
    if isinstance(dropout, int | float) and not isinstance(dropout, bool) and dropout != 0:
        raise NotImplementedError(
            f"paraprop.nn.{cls_name} does not support dropout between layers (got "
            f"dropout={dropout}); use torch.nn.{cls_name} or apply dropout outside")
    if proj_size:
        why = "" if cls_name == "LSTM" else " (torch supports it only for LSTM)"
        raise NotImplementedError(
            f"paraprop.nn.{cls_name} does not support proj_size{why}; got "
            f"proj_size={proj_size}")


# the attributes that fix a module's parameters at construction: assigning one later would make
# the module compute with parameters of another shape, or silently drop some (bias=False)
STRUCTURE = ("input_size", "hidden_size", "num_layers", "bias", "mode", "nonlinearity")


def structure(module) -> tuple:
    """The values of :data:`STRUCTURE` (``None`` for an attribute the module does not have)."""
    return tuple(getattr(module, a, None) for a in STRUCTURE)


def refuse_jit(name: str) -> None:
    """Raise the refusal of ``torch.jit.trace`` (called from ``forward`` while tracing)."""
    raise NotImplementedError(
        f"paraprop.nn.{name} cannot be traced by torch.jit.trace: its forward and backward are "
        "Python (a solver loop and an autograd Function that torch.jit does not record); use "
        f"torch.compile(module) instead, or the module without jit. To export torch's own "
        f"module, load the state dict into torch.nn.{name}")


def native_runs(fwd, *tensors: torch.Tensor) -> bool:
    """Whether a ``forward=`` of ``fwd`` runs paraprop's native loop on these tensors: a
    :class:`SequentialForward` with ``kernel="native"`` or ``"auto"``, CPU tensors of one dtype
    (float32 or float64), the kernels built, no :mod:`torch.func` transform running, no
    :func:`torch.autocast` region active."""
    if not isinstance(fwd, SequentialForward) or fwd.kernel == "torch" or transforms_active():
        return False
    if any(t is not None and torch.is_autocast_enabled(t.device.type) for t in tensors[:1]):
        return False
    from paraprop.scan import native

    return native.supports(*tensors)


def transforms_active() -> bool:
    """Whether a :mod:`torch.func` transform (grad, vjp, jacrev, vmap, ...) is running."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def time_major(name: str, input: torch.Tensor, input_size: int, batch_first: bool  # noqa: A002
               ) -> tuple[torch.Tensor, bool]:
    """``input`` checked (2-D or 3-D, ``input_size`` features, at least one step) and seen as
    ``(T, B, input_size)``; also whether it had a batch dim."""
    if input.dim() not in (2, 3):
        raise ValueError(f"{name}: expected input to be 2D or 3D, got "
                         f"{input.dim()}D tensor of shape {tuple(input.shape)}")
    if input.shape[-1] != input_size:
        raise ValueError(f"input.size(-1) must be equal to input_size={input_size}, got "
                         f"input of shape {tuple(input.shape)}")
    batched = input.dim() == 3
    x = input if batched else input.unsqueeze(1)
    if batched and batch_first:
        x = x.transpose(0, 1)
    if x.shape[0] < 1:
        raise ValueError(f"{name}: the sequence is empty (input shape {tuple(input.shape)})")
    return x, batched


class ScanBackwardMixin:
    """Forward plumbing for the modules: shapes as torch.nn.RNN/GRU/LSTM, then ``_function``.

    Subclasses set ``_function`` (an autograd Function taking ``cfg, x, *states, *weights``
    with time-major ``x`` and one ``(layers, B, H)`` tensor per part of the state, returning the
    outputs and the final states) and inherit the parameters and ``forward`` of the torch
    module. A state of several parts (the LSTM's ``(h, c)``) overrides :meth:`_state_tensors`
    and :meth:`_hidden`.
    """

    _function: type[torch.autograd.Function]
    _state_parts = 1
    # whether the backward's reverse recurrence steps by full (dense, factored or LSTM)
    # transitions of width _state_parts * hidden_size (False: diagonal ones, ParaGRU/ParaLSTM)
    _dense_backward = True
    hidden_size: int
    # what the module classes this plumbing is mixed into have (torch's, or _ParaRNN's)
    num_layers: int
    bias: bool
    _forward_config: SequentialForward | ParallelForward
    _backward_config: ScanBackward | JacobiBackward | AutogradBackward | AutoBackward

    def _state_tensors(self, hx) -> tuple:
        """The tensors of ``hx`` (``()`` for ``None``)."""
        return () if hx is None else (hx,)

    def _hidden(self, finals: list):
        """What ``forward`` returns after the outputs, from the final states."""
        return finals[0]

    # -- the two options, validated on every assignment ----------------------------------------
    @property
    def forward_config(self) -> SequentialForward | ParallelForward:
        """How the forward pass runs: :class:`SequentialForward` or :class:`ParallelForward`
        (assign a name or an object, as the ``forward`` argument)."""
        return self._forward_config

    @forward_config.setter
    def forward_config(self, value) -> None:
        fwd = forward_option(value)
        self._check_kernel(fwd)
        check_pair(fwd, getattr(self, "_backward_config", None))
        object.__setattr__(self, "_forward_config", fwd)

    @property
    def backward_config(self):
        """How gradients are computed: :class:`ScanBackward`, :class:`JacobiBackward` or
        :class:`AutogradBackward` (assign a name or an object, as the ``backward`` argument)."""
        return self._backward_config

    @backward_config.setter
    def backward_config(self, value) -> None:
        bwd = backward_option(value)
        check_pair(getattr(self, "_forward_config", None), bwd)
        self._check_backward_fits(bwd)
        object.__setattr__(self, "_backward_config", bwd)

    def _check_backward_fits(self, bwd) -> None:
        """``ScanBackward(method="triton")`` where the kernels cannot run this module's reverse
        recurrence (a dense state wider than one program's ``H x H`` step) is refused here, not
        at the first backward (the first GPU run met it there, inside a training step)."""
        if not (isinstance(bwd, ScanBackward) and bwd.method == "triton"
                and self._dense_backward):
            return
        from paraprop.scan.triton_kernels import MAX_DENSE

        width = self._state_parts * self.hidden_size
        if width > MAX_DENSE:
            parts = ("" if self._state_parts == 1
                     else f" ({self._state_parts} x hidden_size: h and c)")
            raise ValueError(
                f"backward=ScanBackward(method='triton') runs a reverse recurrence with a state "
                f"of at most {MAX_DENSE} (one H x H step per program); this "
                f"{type(self).__name__}(hidden_size={self.hidden_size}) has a state of "
                f"{width}{parts}: use ScanBackward() (method='auto') or method='chunked' or "
                "'blelloch'")

    # -- what the last call ran ------------------------------------------------------------------
    def _run_log(self) -> RunLog:
        runs = self.__dict__.get("_runs")
        if runs is None:        # a module pickled before the log existed: from now on
            runs = self._runs = RunLog()
        return runs

    @property
    def last_forward(self) -> tuple[Solution, ...]:
        """The last forward's :class:`paraprop.Solution` per layer, bottom layer first: a
        parallel forward's solves, or the loop that ran for ``forward="native"`` / ``"auto"``;
        ``()`` after ``forward="sequential"`` (:mod:`paraprop.nn.runs`)."""
        return self._run_log().solutions()

    @property
    def last_backward(self) -> BackwardRun | None:
        """The last call's backward (:class:`paraprop.nn.BackwardRun`): its kind and one
        :class:`paraprop.Solution` per layer; ``None`` until a backward of the last call
        runs (set by the forward already where torch's autograd will run)."""
        return self._run_log().backward

    # the SequentialForward kernels a module runs (ParaGRU / ParaLSTM: only their own loop)
    _sequential_kernels: tuple[str, ...] = ("torch", "native", "auto")

    def _check_kernel(self, fwd) -> None:
        if isinstance(fwd, SequentialForward) and fwd.kernel not in self._sequential_kernels:
            name = type(self).__name__
            raise ValueError(f"paraprop.nn.{name} has no forward={fwd.kernel!r} (no native loop "
                             f"for its cell); forward='sequential' is its step-by-step loop, "
                             f"or choose a parallel method such as 'newton'")

    def _init_options(self, forward, backward):
        """Validate both options once (before torch's constructor allocates anything)."""
        fwd, bwd = forward_option(forward), backward_option(backward)
        self._check_kernel(fwd)
        check_pair(fwd, bwd)
        return fwd, bwd

    def _set_options(self, fwd, bwd) -> None:
        self._check_backward_fits(bwd)
        object.__setattr__(self, "_forward_config", fwd)
        object.__setattr__(self, "_backward_config", bwd)
        self._runs = RunLog()
        self._structure = structure(self)

    # -- the settings at call time ---------------------------------------------------------------
    def _check_settings(self) -> None:
        """Every call: the torch options the module refuses (``dropout``, ``bidirectional``,
        ``proj_size``), and the attributes its parameters were built for (:data:`STRUCTURE`)
        unchanged. The constructor checks them too, but an attribute may be assigned later
        (``module.dropout = 0.5``); a few attribute reads."""
        name = type(self).__name__
        check_options(name, dropout=getattr(self, "dropout", 0),
                      bidirectional=getattr(self, "bidirectional", False),
                      proj_size=getattr(self, "proj_size", 0))
        now = structure(self)
        built = self.__dict__.get("_structure")
        if built is None:      # a module pickled before this check existed: from now on
            self._structure = built = now
        if now == built:
            return
        for attr, was, new in zip(STRUCTURE, built, now, strict=True):
            if was != new or type(was) is not type(new):
                raise ValueError(
                    f"paraprop.nn.{name}: {attr} was assigned after construction (expected "
                    f"{attr}={was!r}, the value the parameters were built for; found {new!r}); "
                    f"build a new module with {attr}={new!r} instead")

    def __prepare_scriptable__(self):
        """``torch.jit.script`` calls this first (also on the submodules of a scripted model):
        refuse by name instead of torch's error about the options' types."""
        name = type(self).__name__
        raise NotImplementedError(
            f"paraprop.nn.{name} cannot be compiled by torch.jit.script: its forward and "
            "backward are Python (a solver loop, an autograd Function, option objects) that "
            "TorchScript does not support; use torch.compile(module) instead, or the module "
            f"without jit. To export torch's own module, load the state dict into "
            f"torch.nn.{name}")

    def _weights(self) -> list[torch.Tensor]:
        names = []
        for k in range(self.num_layers):
            names += [f"weight_ih_l{k}", f"weight_hh_l{k}"]
            if self.bias:
                names += [f"bias_ih_l{k}", f"bias_hh_l{k}"]
        return [getattr(self, n) for n in names]

    def forward(self, input, hx=None):  # noqa: A002 - torch's argument name
        name = type(self).__name__
        if torch.jit.is_tracing():
            refuse_jit(name)
        self._check_settings()
        if isinstance(input, PackedSequence):
            raise NotImplementedError(
                f"paraprop.nn.{name} does not take a PackedSequence; pad the "
                "batch to one length or use the torch module")
        fwd, bwd = self._forward_config, self._backward_config
        kernel_shown = isinstance(fwd, SequentialForward) and fwd.kernel != "torch"
        fwd, bwd = resolve(self.mode, input.device, fwd, bwd)
        parallel = isinstance(fwd, ParallelForward)
        if transforms_active():
            # torch.func runs its own differentiation and batching: torch's kernel with
            # autograd behaves exactly as torch.nn.RNN / GRU there; a solve cannot (its
            # iteration count depends on the values)
            if parallel:
                raise NotImplementedError(
                    f"paraprop.nn.{name}(forward={describe(fwd)}) cannot run under torch.func "
                    "transforms (grad, jacrev, vmap, ...): the solver's stopping depends on the "
                    f"values; use forward='sequential' (torch's kernel) there")
            return super().forward(input, hx)
        if parallel and torch.is_autocast_enabled(input.device.type):
            raise NotImplementedError(
                f"paraprop.nn.{name}(forward={describe(fwd)}) does not run under torch.autocast "
                "(autocast picks the dtype of every operation inside the solver); convert the "
                "module and its inputs instead (module.to(torch.bfloat16): the solve then runs "
                "in float32 and rounds to bfloat16), or use forward='sequential' under autocast")
        weights = self._weights()
        hxs = self._state_tensors(hx)
        needs_grad = torch.is_grad_enabled() and (
            input.requires_grad or any(h.requires_grad for h in hxs)
            or any(w.requires_grad for w in weights))
        if needs_grad and not isinstance(bwd, AutogradBackward) and \
                torch.is_autocast_enabled(input.device.type):
            raise NotImplementedError(
                f"paraprop.nn.{name}(backward={describe(bwd)}) does not run under "
                "torch.autocast: autocast runs torch's kernel in a dtype of its choosing, which "
                "the scan backward cannot reproduce; use backward='autograd' (torch's own "
                "backward) under autocast, or convert the module and its inputs instead "
                "(module.to(torch.bfloat16), where the scan backward runs in float32)")
        native = native_runs(fwd, input, *hxs, *weights)
        runs = self._run_log()
        log = runs.begin()    # this call's backward, when it runs, records itself
        # forward="native" / "auto": the loop that ran, one record per layer
        loop = ("native" if native else "torch") if kernel_shown else None
        x, batched = time_major(name, input, self.input_size, self.batch_first)
        T, B = x.shape[:2]
        expect = (self.num_layers, B, self.hidden_size)
        states = []
        for h in hxs or (None,) * self._state_parts:
            if h is None:
                states.append(torch.zeros(expect, dtype=x.dtype, device=x.device))
                continue
            h0 = h if batched else (h.unsqueeze(1) if h.dim() == 2 else h)
            if tuple(h0.shape) != expect:
                raise ValueError(f"expected hidden size {expect if batched else expect[::2]}, "
                                 f"got {tuple(h.shape)}")
            if h0.dtype != x.dtype:
                raise TypeError(f"hx has dtype {h0.dtype} but input has {x.dtype}")
            states.append(h0)
        if any(w.dtype != x.dtype for w in weights):
            raise TypeError(f"input has dtype {x.dtype} but the parameters have "
                            f"{weights[0].dtype}")
        if not parallel and not native and (isinstance(bwd, AutogradBackward) or not needs_grad):
            if needs_grad:     # torch's own backward will run: nothing of ours to record
                runs.backward = BackwardRun("autograd")
            return self._loops_ran(loop, super().forward(input, hx), T)
        if B == 0:      # nothing to solve or to scan: torch's kernel (and autograd) as is
            return self._loops_ran(loop, super().forward(input, hx), T)
        cdt = compute_dtype(x.dtype)
        cfg = {"name": name, "mode": self.mode, "layers": self.num_layers, "bias": self.bias,
               "forward": fwd if parallel else None, "native": native, "compute": cdt,
               "input_dtypes": (None, x.dtype, *(s.dtype for s in states),
                                *(w.dtype for w in weights)),
               "forward_tol": fwd.tol_for(cdt) if parallel else None,
               "log": log, "backward": bwd, "backward_name": describe(bwd), "runs": runs}
        if needs_grad:
            out, *finals = self._function.apply(cfg, x, *states, *weights)
        else:
            with torch.no_grad():
                out, *finals, _ = self._function.layers(cfg, x, *states, weights, save=False)
        if not batched:
            out, finals = out.squeeze(1), [h.squeeze(1) for h in finals]
        elif self.batch_first:
            out = out.transpose(0, 1)
        return self._loops_ran(loop, (out, self._hidden(finals)), T)

    def _loops_ran(self, loop: str | None, result: tuple, steps: int) -> tuple:
        """``result`` (what ``forward`` returns), after recording that the sequential kernel
        ``loop`` ran (``forward="native"`` / ``"auto"``; ``None``: none): one
        :func:`~paraprop.nn.runs.loop_run` per layer, built when ``last_forward`` is read."""
        if loop is not None:
            hidden = result[1]
            self._run_log().loops(loop, hidden if isinstance(hidden, tuple) else (hidden,), steps)
        return result

    def extra_repr(self) -> str:
        s = super().extra_repr()  # type: ignore[misc]  # a mixin: torch's module is next in the MRO
        fwd = self._forward_config
        if isinstance(fwd, ParallelForward) or fwd != SequentialForward("auto"):
            s += f", forward={describe(fwd)}"
        return s + f", backward={describe(self._backward_config)}"
