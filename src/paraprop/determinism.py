"""Is a user's module a fixed function of its input?

Every parallel method evaluates the user's module more often than the sequential loop does, on
other batches of positions. That reproduces the sequential result only when the module is a
fixed function of its input. A module in train mode with active dropout (or another layer that
draws random numbers, or a norm layer that reads batch statistics and updates running ones) is
not: two calls on the same input differ, so there is no sequential result to reproduce, and a
parallel method would report a difference that is the model's, not the solver's.

:func:`require_deterministic` is the one check every entry point that calls a user's module runs
before it starts (decoding, diffusion, flows, sampling, networks, multigrid). It finds such layers
by type (``torch.nn`` dropout layers, ``RReLU``, batch and instance norm) and by the attributes
through which ``transformers`` and other libraries apply functional dropout in train mode
(``attention_dropout``, ``dropout`` and the like, when positive). A stochastic module that hides
its randomness elsewhere is caught later, by the solvers' verification of the fixed point
(:class:`paraprop.NotTriangularError`, whose message names this cause too).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers

import torch
from torch import nn

from paraprop.errors import StochasticModelError

__all__ = ["DROPOUT_ATTRIBUTES", "NOISE_ATTRIBUTES", "NORM_MODULES", "RANDOM_MODULES", "own_part",
           "refuse_random_draws", "require_deterministic", "stochastic_parts"]

# layers that draw random numbers in train mode
RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU)
# layers whose train-mode output reads batch statistics (and updates running ones)
NORM_MODULES = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
# attributes through which a module applies functional dropout in train mode (transformers'
# attention classes read `attention_dropout`, GPT-2 style configs `attn_pdrop` and the like,
# torch.nn.RNN/GRU/LSTM `dropout` between layers, timm-style blocks `drop_rate`/`drop_path`,
# transformers' DropPath `drop_prob`, Seed-OSS `residual_dropout`, MPT `attn_dropout_p`, LASR
# `dropout_positions`) or other train-mode noise (the router jitter of the mixture-of-experts
# blocks: Mixtral / Switch / MiniMax `jitter_noise`, PhiMoE `router_jitter_noise` and
# `input_jitter_noise`, DBRX `moe_jitter_eps`)
DROPOUT_ATTRIBUTES = ("dropout", "dropout_p", "dropout_rate", "attention_dropout",
                      "attn_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "drop_rate",
                      "drop_path_rate", "hidden_dropout", "activation_dropout", "layerdrop",
                      "drop_prob", "residual_dropout", "attn_dropout_p", "dropout_positions",
                      "jitter_noise", "router_jitter_noise", "input_jitter_noise",
                      "moe_jitter_eps")
# of those, the noise amplitudes (any positive value draws random numbers; the others are
# probabilities in (0, 1))
NOISE_ATTRIBUTES = ("jitter_noise", "router_jitter_noise", "input_jitter_noise",
                    "moe_jitter_eps")


def own_part(m: nn.Module, *, norms: bool = True) -> str | None:
    """What ``m`` itself (not its children) does in train mode that makes its output not a
    fixed function of its input, or ``None``: the per-module rule behind
    :func:`stochastic_parts`."""
    if not m.training:
        return None
    if isinstance(m, RANDOM_MODULES):
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p == 0:
            return None
        p = f" p={m.p}" if hasattr(m, "p") else ""
        return f"draws random numbers at every call{p}"
    if isinstance(m, NORM_MODULES):
        if not norms or (isinstance(m, nn.modules.instancenorm._InstanceNorm)
                         and not m.track_running_stats):
            return None   # per-sample statistics: a fixed function of each sample
        return "normalises with batch statistics and updates its running ones"
    for attr in _present(m):
        # the instance's own attribute: no __getattr__ fallback (diffusers' modules answer
        # unknown names from their config, with a deprecation warning), no property
        v = inspect.getattr_static(m, attr, None)
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(float(v)):
            continue
        if attr in NOISE_ATTRIBUTES and float(v) > 0:
            return f"draws random numbers in train mode ({attr}={v})"
        if attr not in NOISE_ATTRIBUTES and 0 < float(v) < 1:
            return f"applies dropout in train mode ({attr}={v})"
    return None


_ATTRIBUTE_SET = frozenset(DROPOUT_ATTRIBUTES)


def _present(m: nn.Module) -> list[str]:
    """The names of :data:`DROPOUT_ATTRIBUTES` that ``m``'s instance dict or class hierarchy
    defines, in that tuple's order: set intersections instead of one ``getattr_static`` per
    name (most modules define none, and this runs for every module of a model per call)."""
    found = _ATTRIBUTE_SET.intersection(vars(m)) if hasattr(m, "__dict__") else set()
    for klass in type(m).__mro__:
        found |= _ATTRIBUTE_SET.intersection(klass.__dict__)
    return [a for a in DROPOUT_ATTRIBUTES if a in found] if found else []


def stochastic_parts(module, *, norms: bool = True) -> list[tuple[str, str, str]]:
    """The parts of ``module`` that make its train-mode output not a fixed function of its
    input: ``(qualified name, type name, what it does)`` for each, in ``named_modules`` order
    (the module itself is named ``"(the model)"``); empty for a module in eval mode, and for
    anything that is not a ``torch.nn.Module``.

    Arguments:
        module: the user's module (a bound method of a module counts as that module).
        norms: include batch/instance norm layers in train mode that track running statistics
            or read batch statistics (``False``: only layers that draw random numbers).
    """
    module = _as_module(module)
    if module is None:
        return []
    out = []
    for name, m in module.named_modules():
        does = own_part(m, norms=norms)
        if does is not None:
            out.append((name or "(the model)", type(m).__name__, does))
    return out


def require_deterministic(module, *, argument: str = "model", entry: str = "paraprop",
                          norms: bool = True) -> None:
    """Refuse a module whose repeated evaluation differs (see the module doc).

    Arguments:
        module: the user's module; anything that is not a ``torch.nn.Module`` (or a bound
            method of one) passes, and is checked later by the solvers' verification.
        argument: the argument's name as the caller wrote it, for the message.
        entry: the entry point, for the message (e.g. ``"decoding.generate"``).
        norms: also refuse norm layers in train mode (see :func:`stochastic_parts`).

    Raises:
        paraprop.StochasticModelError: a ``ValueError`` naming the layer, what it does and the
            fix (``model.eval()``).
    """
    parts = stochastic_parts(module, norms=norms)
    if not parts:
        return
    where, kind, does = parts[0]
    more = f" (and {len(parts) - 1} more such layers)" if len(parts) > 1 else ""
    what = (f"{argument} ({kind}) is in train mode and {does}" if where == "(the model)" else
            f"{argument} is in train mode, and its layer {where!r} ({kind}) {does}")
    raise StochasticModelError(
        f"{entry}: {what}{more}: "
        "two evaluations of the same input differ, so there is no sequential result to "
        f"reproduce; call {argument}.eval() first (expected a module in eval mode, or one "
        "without stochastic layers; found train mode)")


def _as_module(obj):
    if isinstance(obj, nn.Module):
        return obj
    owner = getattr(obj, "__self__", None)   # a bound method such as unet.forward
    return owner if isinstance(owner, nn.Module) else None


@contextlib.contextmanager
def refuse_random_draws(device, message: str):
    """Around a parallel evaluation of a user's module: a module that draws random numbers in
    its forward (``torch.randn_like``, functional dropout: randomness no list of layers knows)
    moves the global generator of ``device``; that raises :class:`StochasticModelError` with
    ``message`` (which should name the entry point, the cause and the fix). One comparison of
    the generator's state per call of the context, none per evaluation.

    An error raised inside (the solver may trip over the randomness first: a
    ``NotTriangularError``, or ``vmap``'s refusal of a random operation) becomes the
    :class:`StochasticModelError` too when the generator moved; otherwise it propagates. Draws
    from explicit ``torch.Generator`` objects are not seen (the solvers' verification is the
    check there).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"

    def state():
        return torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()

    before = state()
    try:
        yield
    except Exception as e:
        vmap_refused = isinstance(e, RuntimeError) and "random operation" in str(e) \
            and "vmap" in str(e)
        if not vmap_refused and torch.equal(before, state()):
            raise
        detail = f" (torch: {str(e).splitlines()[0]})" if vmap_refused else ""
        raise StochasticModelError(f"{message}{detail}") from None
    if not torch.equal(before, state()):
        raise StochasticModelError(message)
