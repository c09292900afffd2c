"""A network's forward pass as a triangular system over its layer outputs.

A feedforward network computes states ``s_t = f_t(s_<t)``: each state is the output of one
layer (or of a short run of layers), and it reads some earlier states, for a DenseNet the
concatenation of every earlier state of its dense block (Song et al. 2021, §5.2). That is a
nonlinear lower triangular system, so every :func:`paraprop.solve` method evaluates it.

:class:`LayerRecurrence` holds the steps (what each state runs and reads). :class:`LayerSystem`
binds it to one input batch: states of different shapes live in one padded tensor ``(B, T, F)``
(``B`` samples, ``T`` states, ``F`` the largest state's size per sample, zeros beyond a state's
own size), which is the layout :func:`paraprop.solve` needs (``dim=1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from paraprop.determinism import stochastic_parts
from paraprop.errors import StochasticModelError

COMBINES = ("single", "list", "cat")


@dataclass(frozen=True)
class Step:
    """One state of a network recurrence: ``s_t = module(inputs)``.

    Attributes:
        name: the qualified names of the modules it runs, as ``model.named_modules()`` has them.
        module: the callable (it shares the model's parameters and buffers).
        inputs: the earlier states it reads, in order; ``-1`` is the network input.
        combine: how the inputs reach ``module``: ``"single"`` (exactly one input, passed as a
            tensor), ``"list"`` (a list of tensors, as torchvision's dense layers take them) or
            ``"cat"`` (concatenated along dim 1, the channels).
        clone_input: copy the input first, because ``module`` changes it in place.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> [(s.name, s.inputs) for s in paraprop.networks.as_recurrence(net).steps]
        [('0..1', (-1,)), ('2', (0,))]
    """

    name: str
    module: Callable[..., torch.Tensor]
    inputs: tuple[int, ...]
    combine: str = "single"
    clone_input: bool = False


class LayerRecurrence:
    """The steps of a network's forward pass, in evaluation order.

    Build one with :func:`paraprop.networks.as_recurrence`; evaluate it layer by layer with
    :meth:`states` (the sequential reference) or bind it to an input with :meth:`bind` and hand
    the resulting :class:`LayerSystem` to :func:`paraprop.solve`.

    Arguments:
        steps: the states in order; step ``t`` may read only inputs ``< t`` (or ``-1``).
        source: a short description of where the steps came from (shown by ``repr``).

    Raises:
        ValueError: no steps, an unknown ``combine``, ``"single"`` with other than one input, or
            an input that is not an earlier state (the step is named).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> rec = paraprop.networks.as_recurrence(net.eval())
        >>> len(rec), torch.allclose(rec(torch.ones(3, 4)), net(torch.ones(3, 4)))
        (2, True)
    """

    def __init__(self, steps: Sequence[Step], *, source: str = ""):
        steps = tuple(steps)
        if not steps:
            raise ValueError("a recurrence needs at least one step, got none")
        for t, s in enumerate(steps):
            if not isinstance(s, Step):
                raise TypeError(f"steps[{t}] must be a Step, got {type(s).__name__}")
            if s.combine not in COMBINES:
                raise ValueError(f"step {t} ({s.name!r}): unknown combine={s.combine!r}; "
                                 f"choose one of {', '.join(COMBINES)}")
            if not s.inputs or any(not -1 <= i < t for i in s.inputs):
                raise ValueError(f"step {t} ({s.name!r}) reads inputs {s.inputs}; each must be an "
                                 f"earlier state (0..{t - 1}) or -1 (the network input)")
            if s.combine == "single" and len(s.inputs) != 1:
                raise ValueError(f"step {t} ({s.name!r}): combine='single' needs exactly one "
                                 f"input, got {s.inputs}")
        self.steps = steps
        self.source = source

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        src = f" from {self.source}" if self.source else ""
        return f"LayerRecurrence({len(self)} states{src})"

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.steps]

    def run_step(self, t: int, fetch: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """State ``t`` from its inputs; ``fetch(i)`` returns state ``i`` (``-1``: the input).

        Raises:
            TypeError: the module did not return a tensor (the step is named).
            RuntimeError: the module changed one of its inputs in place (the step is named).
        """
        step = self.steps[t]
        args = [fetch(i) for i in step.inputs]
        if step.clone_input or any(a.is_inference() for a in args):
            # (an inference tensor has no version counter to detect an in-place change by: a
            # copy keeps the earlier state safe from one)
            args = [a.clone() for a in args]
            versions = None
        else:
            versions = [a._version for a in args]
        if step.combine == "single":
            y = step.module(args[0])
        elif step.combine == "list":
            y = step.module(args)
        else:
            y = step.module(args[0] if len(args) == 1 else torch.cat(args, 1))
        if versions is not None and any(a._version != v for a, v in zip(args, versions,
                                                                          strict=True)):
            raise RuntimeError(
                f"step {t} ({step.name!r}) changed its input in place, which would corrupt an "
                "earlier state; use out-of-place modules there (e.g. inplace=False)")
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"step {t} ({step.name!r}) returned {type(y).__name__}, not a tensor; "
                            "a state must be one tensor (modules that return tuples, such as "
                            "recurrent layers, cannot be states)")
        return y

    @torch.no_grad()
    def states(self, u: torch.Tensor) -> list[torch.Tensor]:
        """Every state for the input batch ``u``, one step after another (the reference)."""
        out: list[torch.Tensor] = []
        for t in range(len(self.steps)):
            out.append(self.run_step(t, lambda i: u if i < 0 else out[i]))
        return out

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        """The network output (the last state) by sequential evaluation."""
        return self.states(u)[-1]

    def check_deterministic(self, entry: str = "networks") -> None:
        """Refuse steps whose modules are not fixed functions of their inputs now: a layer in
        train mode that draws random numbers or reads batch statistics
        (:func:`paraprop.determinism.stochastic_parts`). Run by :meth:`bind`, so that a model
        switched to train mode after :func:`~paraprop.networks.as_recurrence` is caught.

        Raises:
            paraprop.StochasticModelError: naming the step, the layer and the fix.
        """
        for t, step in enumerate(self.steps):
            parts = stochastic_parts(step.module)
            if not parts:
                continue
            where, kind, does = parts[0]
            layer = "its module" if where == "(the model)" else f"its layer {where!r}"
            raise StochasticModelError(
                f"{entry}: step {t} ({step.name!r}) is in train mode, and {layer} ({kind}) "
                f"{does}: two evaluations of the same input differ, so there is no sequential "
                "result to reproduce; call model.eval() first (expected every layer in eval "
                "mode or deterministic; found train mode)")

    def bind(self, u: torch.Tensor) -> LayerSystem:
        """The triangular system of this recurrence for the input batch ``u`` (see
        :class:`LayerSystem`); evaluates the network once to learn the state shapes.

        Raises:
            paraprop.StochasticModelError: a step's module is in train mode with a stochastic
                layer (:meth:`check_deterministic`).
            TypeError / ValueError: ``u`` is not a tensor with a leading batch dim.
        """
        if not isinstance(u, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(u).__name__}")
        if u.dim() < 1 or u.shape[0] < 1:
            raise ValueError(f"x must have a leading batch dim of size >= 1, got shape "
                             f"{tuple(u.shape)}")
        self.check_deterministic("networks.bind")
        return LayerSystem(self, u, self.states(u))


class LayerSystem:
    """``x = fn(x)`` for one input batch: the recurrence in the padded layout ``(B, T, F)``.

    Position ``t`` of ``x`` holds state ``t`` flattened per sample in its first ``sizes[t]``
    entries (zeros after). ``fn(x)`` (``__call__``) computes every state from the states in ``x``;
    ``update(x, index)`` only the states ``index``. Pass it to :func:`paraprop.solve` with
    ``x0=system.x0`` and ``dim=1``; the solution's :meth:`output` is the network output.

    Attributes:
        recurrence: the :class:`LayerRecurrence`.
        input: the bound input batch.
        shapes: per-sample shape of every state; ``sizes`` their sizes; ``F`` the largest.
        reference: the states from sequential evaluation (computed at binding).

    Raises (at construction):
        TypeError: a state that is not floating point, or whose dtype differs from the first
            state's, or that lost the batch dim (the step is named).

    Example:
        >>> import torchvision        # a small DenseNet; densenet121() works the same, slower
        >>> net = torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2, 2, 2),
        ...                                   num_init_features=16, num_classes=10).eval()
        >>> system = paraprop.networks.as_recurrence(net).bind(torch.randn(2, 3, 32, 32))
        >>> sol = paraprop.solve(system, system.x0, method="jacobi", dim=1, tol=0)
        >>> torch.equal(system.output(sol.value), system.reference[-1])
        True

    Song et al. 2021, eq. 2 (the triangular system) and §5.2 (DenseNets).
    """

    def __init__(self, recurrence: LayerRecurrence, u: torch.Tensor, states: list[torch.Tensor]):
        self.recurrence = recurrence
        self.input = u
        self.B = u.shape[0]
        self.dtype = states[0].dtype
        for t, s in enumerate(states):
            name = recurrence.steps[t].name
            if not s.is_floating_point() or s.dtype != self.dtype:
                raise TypeError(f"state {t} ({name!r}) has dtype {s.dtype}; every state must "
                                f"share one floating dtype ({self.dtype})")
            if s.dim() < 1 or s.shape[0] != self.B:
                raise TypeError(f"state {t} ({name!r}) has shape {tuple(s.shape)}; it must keep "
                                f"the batch dim of size {self.B} in front")
        self.shapes = [tuple(s.shape[1:]) for s in states]
        self.sizes = [math.prod(sh) for sh in self.shapes]
        self.T = len(states)
        self.F = max(self.sizes)
        self.device = u.device
        self.reference = states

    @property
    def x0(self) -> torch.Tensor:
        """The zero initial guess ``(B, T, F)``."""
        return torch.zeros(self.B, self.T, self.F, dtype=self.dtype, device=self.device)

    def state(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """State ``t`` of ``x``, shaped ``(B, *shapes[t])``: a contiguous copy, as the layers see
        it (a copy, so that no layer can change ``x`` and concurrent writes to other states of
        ``x`` do not touch the tensors a layer is reading)."""
        return x[:, t, : self.sizes[t]].reshape(self.B, *self.shapes[t]).clone(
            memory_format=torch.contiguous_format)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The network output (the last state) held in ``x``."""
        return self.state(x, self.T - 1)

    def pack(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The padded tensor holding ``states`` (e.g. :attr:`reference`)."""
        x = self.x0
        for t, s in enumerate(states):
            x[:, t, : self.sizes[t]] = s.reshape(self.B, -1)
        return x

    def compute(self, t: int, x: torch.Tensor, *, before: torch.Tensor | None = None,
                start: int = 0) -> torch.Tensor:
        """State ``t`` computed from the states held in ``x``, shaped ``(B, sizes[t])``; states
        ``< start`` are read from ``before`` instead when it is given (a Jacobi-GS block reads
        the blocks before it from the previous iterate)."""

        def fetch(i: int) -> torch.Tensor:
            if i < 0:
                return self.input
            return self.state(before if before is not None and i < start else x, i)

        y = self.recurrence.run_step(t, fetch)
        if y.shape[1:] != self.shapes[t] or y.dtype != self.dtype:
            raise RuntimeError(
                f"step {t} ({self.recurrence.steps[t].name!r}) returned shape "
                f"{tuple(y.shape)} {y.dtype}, but {(self.B, *self.shapes[t])} {self.dtype} when "
                "evaluated sequentially; a state's shape must not depend on the values it reads")
        return y.reshape(self.B, self.sizes[t])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t in range(self.T):
            out[:, t, : self.sizes[t]] = self.compute(t, x)
        return out

    def update(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        idx = index.tolist()
        out = x.new_zeros(self.B, len(idx), self.F)
        for j, t in enumerate(idx):
            out[:, j, : self.sizes[t]] = self.compute(t, x)
        return out
