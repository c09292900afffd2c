"""JAX ``lax.scan`` peers of torch's recurrent layers and of ParaGRU/ParaLSTM, jitted and timed.

A *peer row* of a recurrent benchmark: the same cell as a single-layer, unidirectional
:class:`torch.nn.RNN` (tanh or relu), :class:`torch.nn.GRU`, :class:`torch.nn.LSTM` (and their
subclasses :class:`paraprop.nn.RNN` / ``GRU`` / ``LSTM``), :class:`paraprop.nn.ParaGRU` or
:class:`paraprop.nn.ParaLSTM`, written as a JAX user would write it: the input projection of
all steps in one matrix product, then :func:`jax.lax.scan` over time with the cell's
hidden-to-hidden part, under :func:`jax.jit`. :func:`peer` copies the module's weights;
:meth:`Peer.forward` and :meth:`Peer.train_step` (``jax.jit(jax.value_and_grad(loss))`` with
respect to every weight, ``loss = sum(outputs * G)`` for a fixed cotangent ``G``) return torch
tensors, so that tests can compare them with torch's outputs and autograd's gradients;
:meth:`Peer.time_forward` / :meth:`Peer.time_train` (and :meth:`Peer.runner`, a callable for
:func:`paraprop_lab.experiments.harness.interleaved`) time the jitted calls.

The cells follow torch's equations and gate orders (``W_hh h`` a matrix product for torch's
layers, an elementwise ``w_hh * h`` with ``w_hh`` a vector for the ParaRNN cells)::

    RNN:  h' = act(W_ih x + b_ih + W_hh h + b_hh)                       (act: tanh or relu)
    GRU:  r, z = sigmoid(gi_r + gh_r), sigmoid(gi_z + gh_z)             (gi = W_ih x + b_ih,
          n = tanh(gi_n + r * gh_n),  h' = (1 - z) * n + z * h           gh = W_hh h + b_hh)
    LSTM: i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of W_ih x + b_ih + W_hh h + b_hh
          c' = f * c + i * g,  h' = o * tanh(c')

For RNN and LSTM (and ParaLSTM, as the module does) the two biases are added to the hoisted
input projection; for GRU and ParaGRU ``b_hh`` stays in the step, as ``b_hn`` is multiplied by
``r``. Matrix products use ``precision=HIGHEST`` (full float32, as torch's default; it changes
nothing on a CPU).

JAX is optional (the ``peers`` extra: ``pip install 'paraprop[peers]'``); this module imports it
only inside its functions, so importing it without JAX works and :func:`available` says whether
the peers can run. Everything is float32: JAX's x64 mode is off by default, this module never
turns it on, and its arrays are float32 even where a user turned it on. The arrays live on JAX's
default device (the CPU with the plain ``jax`` wheel).

Threads: XLA's CPU client sizes its thread pools to the CPUs the process may run on (its
affinity mask, so ``taskset -c 1`` gives it one CPU); unlike torch it reads no
``OMP_NUM_THREADS``-like setting, and ``torch.set_num_threads`` does not affect it. Compare
with torch on the same CPUs: pin both, or give torch as many threads as the mask allows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["KINDS", "Peer", "available", "peer"]

# The cells a peer can be: torch's RNN (tanh, relu), GRU, LSTM, and ParaRNN's ParaGRU, ParaLSTM.
KINDS = ("rnn_tanh", "rnn_relu", "gru", "lstm", "paragru", "paralstm")
_GATES = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4, "paragru": 3, "paralstm": 4}


def available() -> bool:
    """Whether JAX can be imported (the ``peers`` extra is installed).

    Returns:
        ``True`` when ``import jax`` succeeds, ``False`` when it fails (not installed, or a
        ``jaxlib`` that does not match ``jax``).
    """
    try:
        import jax  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


def _require_jax():
    if not available():
        raise ImportError("paraprop_lab.experiments.jax_peers needs JAX: pip install "
                          "'paraprop[peers]' (or pip install jax)")


def _kind(module: torch.nn.Module) -> str:
    """The cell of ``module``, after the checks :func:`peer` documents."""
    from paraprop.nn.para import ParaGRU, ParaLSTM

    if isinstance(module, ParaGRU):
        kind = "paragru"
    elif isinstance(module, ParaLSTM):
        kind = "paralstm"
    elif isinstance(module, torch.nn.LSTM):
        kind = "lstm"
    elif isinstance(module, torch.nn.GRU):
        kind = "gru"
    elif isinstance(module, torch.nn.RNN):
        if module.nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"peer: module.nonlinearity must be 'tanh' or 'relu', got "
                             f"{module.nonlinearity!r}")
        kind = f"rnn_{module.nonlinearity}"
    else:
        raise ValueError("peer: module must be a torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM, "
                         "paraprop.nn.ParaGRU or paraprop.nn.ParaLSTM (or a subclass), got "
                         f"{type(module).__module__}.{type(module).__qualname__}")
    if module.num_layers != 1:
        raise ValueError(f"peer: module.num_layers must be 1, got {module.num_layers}")
    if getattr(module, "bidirectional", False):
        raise ValueError(f"peer: module.bidirectional must be False, got "
                         f"{module.bidirectional}")
    if getattr(module, "proj_size", 0) != 0:
        raise ValueError(f"peer: module.proj_size must be 0, got {module.proj_size}")
    for name, p in module.named_parameters():
        if p.dtype != torch.float32:
            raise ValueError(f"peer: module's parameters must be torch.float32, got {p.dtype} "
                             f"({name})")
    return kind


def peer(module: torch.nn.Module, *, seed: int = 0, unroll: int = 1) -> Peer:
    """The JAX peer of a single-layer, unidirectional recurrent module, with its weights copied.

    Arguments:
        module: a :class:`torch.nn.RNN` (``nonlinearity`` ``"tanh"`` or ``"relu"``),
            :class:`torch.nn.GRU`, :class:`torch.nn.LSTM` (subclasses such as
            :class:`paraprop.nn.GRU` count), :class:`paraprop.nn.ParaGRU` or
            :class:`paraprop.nn.ParaLSTM`, with ``num_layers=1``, not bidirectional, no
            ``proj_size``, float32 parameters (``bias=False`` is supported). Its weights are
            copied now: later changes to the module do not reach the peer. ``batch_first`` is
            ignored: the peer's inputs are always time-major.
        seed: seeds the fixed cotangent ``G`` of :meth:`Peer.train_step`'s loss
            (:meth:`Peer.cotangent`).
        unroll: passed to :func:`jax.lax.scan` (steps per loop iteration; 1, the default, is
            what a JAX user writes first).

    Returns:
        A :class:`Peer`.

    Raises:
        ValueError: a module of another type, ``num_layers != 1``, ``bidirectional=True``,
            ``proj_size > 0``, parameters that are not float32, or an RNN nonlinearity other
            than tanh/relu (the message names the attribute, the expected and the actual
            value).
        ImportError: JAX is not installed.
    """
    kind = _kind(module)
    _require_jax()
    weights = {name: p.detach().cpu() for name, p in module.named_parameters()}
    return Peer(kind, module.input_size, module.hidden_size, weights, seed=seed, unroll=unroll)


class Peer:
    """A recurrent cell as a jitted JAX ``lax.scan``, made by :func:`peer`.

    Inputs are torch tensors, time-major ``(T, B, I)`` float32 (as torch's ``batch_first=False``);
    initial states as torch's ``hx`` of a one-layer module: ``h0`` ``(1, B, H)`` (or
    ``(B, H)``), for LSTM and ParaLSTM a tuple ``(h0, c0)``; ``None`` for zeros. Every distinct
    input shape compiles once (on its first call).

    Attributes:
        kind: one of :data:`KINDS`.
        input_size, hidden_size: the module's sizes.
        params: the weights as JAX float32 arrays, named as the module's parameters
            (``weight_ih_l0``, ``weight_hh_l0``, and ``bias_ih_l0``, ``bias_hh_l0`` with bias).
        seed: the seed of :meth:`cotangent`.
    """

    def __init__(self, kind: str, input_size: int, hidden_size: int,
                 weights: dict[str, torch.Tensor], *, seed: int = 0, unroll: int = 1):
        import jax
        import jax.numpy as jnp

        if kind not in KINDS:
            raise ValueError(f"Peer: kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.input_size, self.hidden_size = kind, input_size, hidden_size
        self.seed = seed
        self.params = {k: jnp.asarray(np.asarray(v, dtype=np.float32))
                       for k, v in weights.items()}
        run = _scan_fn(kind, unroll)

        def loss(params, x, state, g):
            return jnp.sum(run(params, x, state) * g)

        self._forward = jax.jit(run)
        self._train = jax.jit(jax.value_and_grad(loss))

    def __repr__(self) -> str:
        return (f"Peer({self.kind!r}, input_size={self.input_size}, "
                f"hidden_size={self.hidden_size}, bias={'bias_ih_l0' in self.params})")

    # -- inputs -----------------------------------------------------------------------------
    def _x(self, x: torch.Tensor):
        import jax.numpy as jnp

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Peer: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.input_size:
            raise ValueError(f"Peer: x must be time-major (T, B, {self.input_size}), got "
                             f"{tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise ValueError(f"Peer: x must be torch.float32, got {x.dtype}")
        return jnp.asarray(x.detach().cpu().numpy())

    def _state(self, h0, B: int):
        """The initial state as JAX arrays ``(B, H)``: ``h`` or ``(h, c)``."""
        import jax.numpy as jnp

        H = self.hidden_size
        parts = 2 if self.kind in ("lstm", "paralstm") else 1
        if h0 is None:
            zeros = jnp.zeros((B, H), jnp.float32)
            return zeros if parts == 1 else (zeros, zeros)
        if parts == 2 and not (isinstance(h0, tuple | list) and len(h0) == 2):
            raise TypeError(f"Peer: h0 of a {self.kind} peer must be a tuple (h0, c0) or None, "
                            f"got {type(h0).__name__}")
        out = []
        for t in (h0,) if parts == 1 else tuple(h0):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Peer: h0 must hold torch tensors, got {type(t).__name__}")
            if tuple(t.shape) not in ((1, B, H), (B, H)) or t.dtype != torch.float32:
                raise ValueError(f"Peer: h0 must be float32 (1, {B}, {H}) or ({B}, {H}), got "
                                 f"{t.dtype} {tuple(t.shape)}")
            out.append(jnp.asarray(t.detach().cpu().reshape(B, H).numpy()))
        return out[0] if parts == 1 else tuple(out)

    def cotangent(self, T: int, B: int) -> torch.Tensor:
        """The fixed cotangent ``G`` ``(T, B, H)`` of :meth:`train_step`'s loss
        ``sum(outputs * G)``: standard normal, drawn by a torch generator seeded with
        :attr:`seed` (so the same for every call with these sizes)."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randn(T, B, self.hidden_size, generator=gen)

    def _args(self, x, h0, weights_out=None, train=False) -> tuple:
        import jax.numpy as jnp

        xj = self._x(x)
        T, B = xj.shape[:2]
        args = (self.params, xj, self._state(h0, B))
        if not train:
            return args
        g = self.cotangent(T, B) if weights_out is None else weights_out
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != (T, B, self.hidden_size):
            raise ValueError(f"Peer: weights_out must be a torch tensor ({T}, {B}, "
                             f"{self.hidden_size}), got {getattr(g, 'shape', type(g).__name__)}")
        return (*args, jnp.asarray(g.detach().cpu().numpy().astype(np.float32)))

    # -- results ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, h0=None) -> torch.Tensor:
        """The outputs of the jitted ``lax.scan``.

        Arguments:
            x: the inputs ``(T, B, I)``, float32, time-major.
            h0: the initial state (see :class:`Peer`), ``None`` for zeros.

        Returns:
            The hidden states of every step, ``(T, B, H)`` (a new CPU torch tensor).

        Raises:
            ValueError / TypeError: ``x`` or ``h0`` of the wrong type, shape or dtype.
        """
        return torch.from_numpy(np.array(self._forward(*self._args(x, h0))))

    def train_step(self, x: torch.Tensor, h0=None, weights_out: torch.Tensor | None = None
                   ) -> tuple[float, dict[str, torch.Tensor]]:
        """The jitted ``value_and_grad`` of ``loss = sum(outputs * G)`` w.r.t. every weight.

        Arguments:
            x, h0: as :meth:`forward`.
            weights_out: the cotangent ``G`` ``(T, B, H)``; ``None`` for :meth:`cotangent`.

        Returns:
            ``(loss, grads)``: the loss as a float, and the gradients as CPU torch tensors
            named and shaped as the module's parameters.

        Raises:
            ValueError / TypeError: as :meth:`forward`; ``weights_out`` of the wrong shape.
        """
        value, grads = self._train(*self._args(x, h0, weights_out, train=True))
        return float(value), {k: torch.from_numpy(np.array(v)) for k, v in grads.items()}

    # -- timing -----------------------------------------------------------------------------
    def runner(self, x: torch.Tensor, h0=None, *, train: bool = False,
               weights_out: torch.Tensor | None = None) -> Callable[[], None]:
        """A zero-argument callable that runs the jitted forward (or, with ``train=True``, the
        training step) once and waits for its result with ``block_until_ready``: the inputs
        are converted to JAX arrays here, once, not in the call. For
        :func:`paraprop_lab.experiments.harness.interleaved` (warm it up once: the first call
        compiles)."""
        import jax

        fn = self._train if train else self._forward
        args = self._args(x, h0, weights_out, train=train)

        def run() -> None:
            jax.block_until_ready(fn(*args))

        return run

    def time_forward(self, x: torch.Tensor, h0=None, repeats: int = 5) -> float:
        """Seconds per jitted forward call on these inputs.

        Method: the inputs are converted to JAX arrays once; one untimed warm-up call
        compiles; then ``repeats`` calls are timed one by one with :func:`time.perf_counter`
        around the call and its ``block_until_ready`` (dispatch and the whole computation, no
        conversion), and the median is returned.

        Arguments:
            x, h0: as :meth:`forward`.
            repeats: timed calls (``>= 1``).

        Returns:
            The median wall time of one call, in seconds.
        """
        return _median_time(self.runner(x, h0), repeats)

    def time_train(self, x: torch.Tensor, h0=None, repeats: int = 5,
                   weights_out: torch.Tensor | None = None) -> float:
        """Seconds per jitted training step (``value_and_grad`` of :meth:`train_step`'s loss,
        waiting for the loss and every gradient), timed as :meth:`time_forward`.

        Arguments:
            x, h0, weights_out: as :meth:`train_step`.
            repeats: timed calls (``>= 1``).

        Returns:
            The median wall time of one step, in seconds.
        """
        return _median_time(self.runner(x, h0, train=True, weights_out=weights_out), repeats)


def _median_time(run: Callable[[], None], repeats: int) -> float:
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    run()                                              # compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _scan_fn(kind: str, unroll: int) -> Callable:
    """``run(params, x, state) -> outputs (T, B, H)`` for one cell kind, traceable by JAX."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    hi = lax.Precision.HIGHEST
    gates = _GATES[kind]

    def split(a):
        return jnp.split(a, gates, axis=-1)

    def run(params, x, state):
        w_ih, w_hh = params["weight_ih_l0"], params["weight_hh_l0"]
        b_ih, b_hh = params.get("bias_ih_l0"), params.get("bias_hh_l0")
        gi = jnp.matmul(x, w_ih.T, precision=hi)                   # (T, B, gates * H)
        fold = kind in ("rnn_tanh", "rnn_relu", "lstm", "paralstm")
        if b_ih is not None:
            gi = gi + (b_ih + b_hh if fold else b_ih)

        if kind in ("rnn_tanh", "rnn_relu"):
            act = jnp.tanh if kind == "rnn_tanh" else jax.nn.relu

            def step(h, g):
                h = act(g + jnp.matmul(h, w_hh.T, precision=hi))
                return h, h
        elif kind in ("gru", "paragru"):
            def step(h, g):
                if kind == "gru":
                    gh = jnp.matmul(h, w_hh.T, precision=hi)
                else:
                    gh = jnp.tile(h, (1, 3)) * w_hh
                if b_hh is not None:
                    gh = gh + b_hh
                (gi_r, gi_z, gi_n), (gh_r, gh_z, gh_n) = split(g), split(gh)
                r = jax.nn.sigmoid(gi_r + gh_r)
                z = jax.nn.sigmoid(gi_z + gh_z)
                n = jnp.tanh(gi_n + r * gh_n)
                h = (1 - z) * n + z * h
                return h, h
        else:   # lstm, paralstm
            def step(hc, g):
                h, c = hc
                if kind == "lstm":
                    p = g + jnp.matmul(h, w_hh.T, precision=hi)
                else:
                    p = g + jnp.tile(h, (1, 4)) * w_hh
                p_i, p_f, p_g, p_o = split(p)
                c = jax.nn.sigmoid(p_f) * c + jax.nn.sigmoid(p_i) * jnp.tanh(p_g)
                h = jax.nn.sigmoid(p_o) * jnp.tanh(c)
                return (h, c), h

        _, ys = lax.scan(step, state, gi, unroll=unroll)
        return ys

    return run
