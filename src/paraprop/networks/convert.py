"""``as_recurrence``: turn a network into a :class:`~paraprop.networks.LayerRecurrence`.

Supported out of the box (converters are looked up along the model's class hierarchy):

- ``nn.Sequential`` (nested ones are flattened): one state per module with parameters or
  buffers; parameter-free modules (activations, pooling, flatten) join the state before them.
  Residual blocks are just modules here, so a sequence of them is a residual network.
- torchvision ``DenseNet`` (``densenet121/161/169/201``): the stem, every dense layer, every
  transition and the head are states; a dense layer reads its block's input and every earlier
  layer of its block (the concatenation inside a dense block), a transition and the head read
  all of them (Song et al. 2021, §5.2).
- torchvision ``ResNet`` (``resnet18`` ... ``wide_resnet``): the stem, every residual block and
  the head are states, each reading the one before.

Anything else raises :class:`UnsupportedModuleError` naming the module and the reason; new
architectures can be added with :func:`register_converter`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from paraprop import checks
from paraprop.determinism import require_deterministic
from paraprop.networks.layer_system import LayerRecurrence, Step

__all__ = ["UnsupportedModuleError", "as_recurrence", "register_converter"]


class UnsupportedModuleError(TypeError):
    """A module that cannot be turned into states of a recurrence (the message says why).

    Example:
        >>> paraprop.networks.as_recurrence(nn.LSTM(3, 3))
        Traceback (most recent call last):
        paraprop.networks.convert.UnsupportedModuleError: cannot turn the model (LSTM) into ...
    """


_CONVERTERS: dict[type, Callable[[nn.Module], list[Step]]] = {}
_BUILTIN_REGISTERED = False  # user converters registered first take precedence

# Containers that have no forward of their own.
_NOT_CALLABLE = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def register_converter(cls: type, converter: Callable[[nn.Module], list[Step]]) -> None:
    """Teach :func:`as_recurrence` a new architecture.

    Arguments:
        cls: the model class (subclasses match too, unless they have their own converter).
        converter: ``converter(model) -> list[Step]``, the states in evaluation order.

    Raises:
        TypeError: ``cls`` is not a class or ``converter`` is not callable.

    Example:
        >>> class MyNet(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        ...     def forward(self, x):
        ...         return self.head(self.body(x))
        >>> register_converter(MyNet, lambda m: [Step("body", m.body, (-1,)),
        ...                                      Step("head", m.head, (0,))])
        >>> net, x = MyNet(), torch.randn(3, 4)
        >>> len(as_recurrence(net)), torch.equal(as_recurrence(net)(x), net(x))
        (2, True)
    """
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {cls!r}")
    checks.callable_arg("converter", converter)
    _CONVERTERS[cls] = converter


def as_recurrence(model: nn.Module | LayerRecurrence) -> LayerRecurrence:
    """The states of ``model``'s forward pass as a triangular system.

    Arguments:
        model: an ``nn.Sequential``, a torchvision DenseNet or ResNet, a model of a class given
            to :func:`register_converter`, or a :class:`LayerRecurrence` (returned as it is). It
            must be in eval mode if it has batch/instance norm, dropout or another stochastic
            layer (:func:`paraprop.determinism.stochastic_parts`; checked here and again at
            every :meth:`LayerRecurrence.bind`, since ``model.train()`` may come later); it is
            used, not copied (states share its parameters, so a later ``model.to(device)``
            applies to them).

    Returns:
        A :class:`LayerRecurrence` whose sequential evaluation is ``model(x)``.

    Raises:
        UnsupportedModuleError: a model or module whose structure is unknown (its ``forward`` is
            arbitrary Python), a container without ``forward``, or a torchvision model whose
            ``forward`` was overridden; the message names the module and the reason.
        paraprop.StochasticModelError: (a ``ValueError``) a model in train mode with a
            stochastic layer (named, with the fix: ``model.eval()``).
        ValueError: an empty ``nn.Sequential``.

    Example:
        >>> import torchvision
        >>> net = torchvision.models.densenet121(num_classes=10).eval()
        >>> rec = as_recurrence(net)          # stem, 58 dense layers, 3 transitions, head
        >>> len(rec)
        63

    Song et al. 2021, "Accelerating Feedforward Computation via Parallel Nonlinear Equation
    Solving", §3 (eq. 1-2) and §5.2.
    """
    if isinstance(model, LayerRecurrence):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a LayerRecurrence, got "
                        f"{type(model).__name__}")
    require_deterministic(model, argument="model", entry="networks.as_recurrence")
    _register_builtin()
    converter = _find_converter(type(model))
    if converter is None:
        raise UnsupportedModuleError(
            f"cannot turn the model ({type(model).__name__}) into a recurrence: its forward() is "
            "arbitrary Python, so which layers run in which order on which inputs is unknown. "
            "Supported: nn.Sequential (of any modules), torchvision DenseNet and ResNet; wrap the "
            "network's stages in nn.Sequential or use paraprop.networks.register_converter")
    steps = converter(model)
    return LayerRecurrence(steps, source=type(model).__name__)


def _find_converter(cls: type):
    for base in cls.__mro__:
        if base in _CONVERTERS:
            return _CONVERTERS[base]
    return None


# -- nn.Sequential ----------------------------------------------------------------------------


def _leaves(seq: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    out = []
    for name, m in seq.named_children():
        full = f"{prefix}{name}"
        if type(m) is nn.Sequential:  # plain nested sequences are flattened; subclasses are leaves
            out += _leaves(m, full + ".")
        elif isinstance(m, _NOT_CALLABLE):
            raise UnsupportedModuleError(
                f"module {full!r} ({type(m).__name__}) is a container without forward(); it "
                "cannot be a step of a sequence")
        else:
            out.append((full, m))
    return out


def _has_state(m: nn.Module) -> bool:
    return any(True for _ in m.parameters()) or any(True for _ in m.buffers())


def _units(leaves: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """Group leaves into states: each module with parameters or buffers starts a state;
    parameter-free modules join the state before them (leading ones the first state)."""
    units: list[list[tuple[str, nn.Module]]] = []
    lead: list[tuple[str, nn.Module]] = []
    for leaf in leaves:
        if _has_state(leaf[1]):
            units.append(lead + [leaf])
            lead = []
        elif units:
            units[-1].append(leaf)
        else:
            lead.append(leaf)
    if lead:  # no module with parameters or buffers at all: one state
        units.append(lead)
    return units


def _unit_step(unit: list[tuple[str, nn.Module]], inputs: tuple[int, ...], combine: str) -> Step:
    names = [n for n, _ in unit]
    module = unit[0][1] if len(unit) == 1 else nn.Sequential(*(m for _, m in unit))
    name = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
    return Step(name, module, inputs, combine, clone_input=bool(getattr(unit[0][1], "inplace",
                                                                        False)))


def _sequential_steps(model: nn.Module, prefix: str = "") -> list[Step]:
    # (the converter of nn.Sequential and its subclasses: model is one)
    leaves = _leaves(model, prefix)
    if not leaves:
        raise ValueError(f"nn.Sequential {prefix.rstrip('.') or '(the model)'!r} is empty")
    return [_unit_step(u, (t - 1,), "single") for t, u in enumerate(_units(leaves))]


# -- torchvision DenseNet and ResNet ------------------------------------------------------------


def _require_own_forward(model: nn.Module, base: type, methods: tuple[str, ...]) -> None:
    for meth in methods:
        if getattr(type(model), meth) is not getattr(base, meth):
            raise UnsupportedModuleError(
                f"the model ({type(model).__name__}) overrides {base.__name__}.{meth}(), so its "
                f"forward pass may differ from torchvision's {base.__name__}; register a "
                "converter for it with paraprop.networks.register_converter")


def _densenet_steps(model: nn.Module) -> list[Step]:
    from torchvision.models.densenet import DenseNet, _DenseBlock

    assert isinstance(model, DenseNet)   # as_recurrence dispatches on the class
    _require_own_forward(model, DenseNet, ("forward",))
    if not isinstance(getattr(model, "features", None), nn.Sequential):
        raise UnsupportedModuleError(f"the model ({type(model).__name__}) has no nn.Sequential "
                                     "'features'; it is not a torchvision DenseNet")
    steps: list[Step] = []
    current: tuple[int, ...] = (-1,)  # states whose concatenation is the current feature map
    pending: list[tuple[str, nn.Module]] = []  # non-dense modules waiting to become one state

    def flush() -> None:
        nonlocal current, pending
        if pending:
            steps.append(_unit_step(pending, current, "cat"))
            current, pending = (len(steps) - 1,), []

    for name, m in model.features.named_children():
        full = f"features.{name}"
        if isinstance(m, _DenseBlock):
            flush()
            for lname, layer in m.named_children():
                steps.append(Step(f"{full}.{lname}", layer, current, "list"))
                current = (*current, len(steps) - 1)
        elif isinstance(m, _NOT_CALLABLE):
            raise UnsupportedModuleError(f"module {full!r} ({type(m).__name__}) is a container "
                                         "without forward() inside DenseNet.features")
        else:
            pending.append((full, m))
    names = [n for n, _ in pending] + ["classifier"]
    # the tail of torchvision's DenseNet.forward: final norm, ReLU, global pool, classifier
    head = nn.Sequential(*(m for _, m in pending), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(1), model.classifier)
    steps.append(Step(f"{names[0]}..classifier" if len(names) > 1 else "classifier", head,
                      current, "cat"))
    return steps


def _resnet_steps(model: nn.Module) -> list[Step]:
    from torchvision.models.resnet import ResNet

    assert isinstance(model, ResNet)   # as_recurrence dispatches on the class
    _require_own_forward(model, ResNet, ("forward", "_forward_impl"))
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
    steps = [Step("conv1..maxpool", stem, (-1,))]
    for lname in ("layer1", "layer2", "layer3", "layer4"):
        for bname, block in getattr(model, lname).named_children():
            steps.append(Step(f"{lname}.{bname}", block, (len(steps) - 1,)))
    # the tail of torchvision's ResNet._forward_impl: pool, flatten, fully connected
    head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
    steps.append(Step("avgpool..fc", head, (len(steps) - 1,)))
    return steps


def _register_builtin() -> None:
    """Register the built-in converters (torchvision is imported only when first needed, and is
    optional: the 'vision' extra; without it there is no torchvision model to convert)."""
    global _BUILTIN_REGISTERED
    if _BUILTIN_REGISTERED:
        return
    _BUILTIN_REGISTERED = True
    try:
        from torchvision.models import DenseNet, ResNet
    except ImportError:
        pass
    else:
        _CONVERTERS.setdefault(DenseNet, _densenet_steps)
        _CONVERTERS.setdefault(ResNet, _resnet_steps)
    _CONVERTERS.setdefault(nn.Sequential, _sequential_steps)
