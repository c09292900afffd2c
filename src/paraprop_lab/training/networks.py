"""``paraprop train densenet``: brief training of the networks of ``paraprop bench networks``.

Pretrained ImageNet weights cannot be downloaded here, so the torchvision DenseNets (and the
ResNet and deep MLP the benchmark compares them with) are trained briefly on the data at hand:
the MNIST test set (10,000 images; the first 8,000 train, the last 2,000 are held out) or the
scikit-learn digits (1,500 / 297), resized to ``size x size`` and repeated to three channels for
the torchvision architectures. A user with a checkpoint passes it with ``--weights FILE``
(this job's checkpoints, or a plain ``state_dict`` such as torchvision's ImageNet files).

After training the job reports the held-out accuracy and evaluates the network by Jacobi-GS over
its layers (:func:`paraprop.networks.evaluate`), saying which weights were used.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch
from torch import nn

from paraprop import checks
from paraprop.data import load_digits, load_mnist
from paraprop.models.checkpoint import build_within_budget, read_torch_file
from paraprop_lab.progress import progress as progress_bar
from paraprop_lab.training._common import check_finite_weights, check_out_file, default_path

NAME = "densenet"
HELP = "train a DenseNet (or the benchmark's ResNet / deep MLP) briefly on digits or MNIST"

ARCHS = ("densenet121", "densenet201", "resnet18", "mlp")
MEAN, STD = 0.1307, 0.3081  # MNIST pixel statistics, used for both data sets
SPLITS = {"mnist": 8000, "digits": 1500}  # training images; the rest are held out


def make_network(arch: str, num_classes: int = 10, *, size: int = 32, depth: int = 24,
                 width: int = 256, seed: int = 0) -> nn.Module:
    """A network of the benchmark, randomly initialised (seeded).

    Arguments:
        arch: ``"densenet121"``, ``"densenet201"``, ``"resnet18"`` (torchvision architectures,
            3-channel input) or ``"mlp"`` (``depth`` hidden layers of ``width`` with ReLU on the
            flattened 1-channel ``size x size`` image).
        num_classes: outputs.
        size, depth, width: the MLP's input side, hidden layers and width.
        seed: seed of the initialisation.

    Returns:
        The model, in eval mode.

    Raises:
        ValueError: an unknown ``arch`` or a size below 1.
    """
    checks.one_of("arch", arch, ARCHS)
    if min(num_classes, size, depth, width) < 1:
        raise ValueError(f"num_classes, size, depth and width must be >= 1, got {num_classes}, "
                         f"{size}, {depth}, {width}")
    torch.manual_seed(seed)
    if arch == "mlp":
        layers: list[nn.Module] = [nn.Flatten()]
        sizes = [size * size] + [width] * depth
        for a, b in zip(sizes, sizes[1:], strict=False):
            lin = nn.Linear(a, b)
            nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")  # keeps deep ReLU stacks
            nn.init.zeros_(lin.bias)  # trainable (PyTorch's default init shrinks activations)
            layers += [lin, nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], num_classes))
        return nn.Sequential(*layers).eval()
    import torchvision

    return getattr(torchvision.models, arch)(weights=None, num_classes=num_classes).eval()


def default_lr(arch: str) -> float:
    """Adam's learning rate for a brief training of ``arch`` (the deep MLP needs a smaller one)."""
    return 3e-4 if arch == "mlp" else 1e-3


def input_channels(arch: str) -> int:
    """Image channels the architecture takes (torchvision stems expect 3)."""
    return 1 if arch == "mlp" else 3


def image_data(data: str, *, size: int = 32, channels: int = 3, mnist_dir=None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised images ``(N, channels, size, size)`` and labels ``(N,)``.

    Arguments:
        data: ``"mnist"`` (the MNIST test set, via :func:`paraprop.data.load_mnist`) or
            ``"digits"`` (8x8, embedded).
        size: side after bilinear resizing.
        channels: the gray channel is repeated this many times.
        mnist_dir: the MNIST directory (default: found by :func:`paraprop.data.find_mnist_dir`).

    Raises:
        ValueError: an unknown ``data`` or a bad ``size`` / ``channels``.
    """
    if data == "mnist":
        images, labels = load_mnist(mnist_dir)
    elif data == "digits":
        images, labels = load_digits()
    else:
        raise ValueError(f"unknown data={data!r}; choose 'mnist' or 'digits'")
    if size < 1 or channels < 1:
        raise ValueError(f"size and channels must be >= 1, got {size}, {channels}")
    x = images[:, None]
    if x.shape[-1] != size:
        x = nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = ((x - MEAN) / STD).expand(-1, channels, -1, -1).contiguous()
    return x, labels


def split(data: str, x: torch.Tensor, y: torch.Tensor):
    """``(x_train, y_train, x_held_out, y_held_out)``: the fixed split of ``data``."""
    n = SPLITS[data]
    return x[:n], y[:n], x[n:], y[n:]


def train_network(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int,
                  batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
                  progress: bool = True, desc: str = "train") -> dict:
    """Adam on the cross-entropy for ``steps`` mini-batches (reshuffled every epoch).

    Returns ``{"steps", "loss_first", "loss_last", "train_accuracy_last"}`` (the last two over
    the final 10 batches). The model is left in eval mode.

    Raises:
        ValueError: ``steps`` or ``batch_size`` below 1.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps}, {batch_size}")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    losses, hits = [], []
    order = torch.randperm(len(x), generator=g)
    pos = 0
    bar = progress_bar(range(steps), desc=desc, unit="steps", disable=not progress)
    for _ in bar:
        if pos + batch_size > len(x):
            order, pos = torch.randperm(len(x), generator=g), 0
        idx = order[pos : pos + batch_size]
        pos += batch_size
        logits = model(x[idx])
        loss = nn.functional.cross_entropy(logits, y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        hits.append(float((logits.argmax(1) == y[idx]).float().mean()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    last = min(10, len(losses))
    return {"steps": steps, "loss_first": losses[0], "loss_last": sum(losses[-last:]) / last,
            "train_accuracy_last": sum(hits[-last:]) / last}


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 250) -> float:
    """Top-1 accuracy of ``model`` (eval mode) on ``(x, y)``."""
    model.eval()
    hits = sum(int((model(xb).argmax(1) == yb).sum())
               for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True))
    return hits / len(x)


def save_checkpoint(path: str | Path, model: nn.Module, arch: str, info: dict) -> Path:
    """Write ``{"arch", "state_dict", "info"}`` to ``path`` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"arch": arch, "state_dict": model.state_dict(), "info": info}, path)
    return path


_OLD_DENSE_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$")


def read_weights(path: str | Path, arch: str | None = None) -> tuple[dict, dict]:
    """``(state_dict, info)`` of a weights file for an ``arch`` network (``None``: any of
    :data:`ARCHS`): this job's format
    (``{"arch", "state_dict", "info"}``) or a plain ``state_dict`` (old torchvision DenseNet key
    names such as ``norm.1`` are renamed), read with ``weights_only=True``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a checkpoint (a directory, an empty, text or truncated
            file, pickled Python objects), a checkpoint of another model (a paraprop model's,
            or this job's for another ``--arch``), holds no state dict of tensors, or tensors
            with NaN or inf values; the message names the file and what was expected.
    """
    path = Path(path)
    expected = (f"a {arch or 'network'} checkpoint (this job's format or a plain state_dict "
                "of tensors, e.g. torchvision's)")
    blob = read_torch_file(path, expected)
    if isinstance(blob, dict) and isinstance(blob.get("kind"), str) and "config" in blob:
        raise ValueError(f"{path}: holds a paraprop {blob['kind']} checkpoint, not {expected}")
    if isinstance(blob, dict) and arch is not None and "arch" in blob and blob["arch"] != arch:
        hint = f" (pass --arch {blob['arch']})" if blob["arch"] in ARCHS else ""
        raise ValueError(f"{path}: holds a {blob['arch']!r} network's checkpoint, not "
                         f"{expected}{hint}")
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        found = type(state if isinstance(blob, dict) else blob).__name__
        raise ValueError(f"{path}: not a checkpoint (expected a state_dict or a dict with one: "
                         f"names to tensors; it holds a {found}"
                         f"{' that is empty or holds other values' if found == 'dict' else ''})")
    check_finite_weights(state, path)
    state = {_OLD_DENSE_KEY.sub(r"\1\2", k): v for k, v in state.items()}
    info = blob.get("info", {}) if "state_dict" in blob else {}
    return state, dict(info) if isinstance(info, dict) else {}


def load_weights(model: nn.Module, path: str | Path, arch: str | None = None) -> dict:
    """Load a checkpoint of an ``arch`` network (``None``: any) into ``model``
    (:func:`read_weights`); returns its ``info``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a checkpoint of ``arch`` (:func:`read_weights`), or its tensors do not
            fit the model (the message lists missing and unexpected keys).
    """
    state, info = read_weights(path, arch)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{path}: its weights do not fit the model: {e}") from None
    model.eval()
    return info


def checkpoint_classes(path: str | Path, arch: str | None = None) -> int | None:
    """The number of outputs of the checkpoint's last linear layer, if it can be told."""
    state, _ = read_weights(path, arch)
    return classes_of(state)


def classes_of(state: dict) -> int | None:
    """The number of outputs of the last linear layer of ``state``, if it can be told."""
    for key in ("classifier.weight", "fc.weight"):
        if key in state and state[key].dim() == 2:
            return int(state[key].shape[0])
    weights = [v for k, v in state.items() if k.endswith("weight") and v.dim() == 2]
    return int(weights[-1].shape[0]) if weights else None


def trained_network(arch: str, *, data: str = "mnist", size: int = 32, steps: int = 80,
                    batch_size: int = 64, lr: float | None = None, seed: int = 0, cache_dir=None,
                    mnist_dir=None, progress: bool = True) -> tuple[nn.Module, dict]:
    """A network trained briefly here (reusing ``cache_dir``'s checkpoint of the same config).

    Returns ``(model, info)``; ``info["weights"]`` says which weights these are, with the
    held-out accuracy and the training record.
    """
    lr = default_lr(arch) if lr is None else lr
    x, y = image_data(data, size=size, channels=input_channels(arch), mnist_dir=mnist_dir)
    xt, yt, xh, yh = split(data, x, y)
    model = make_network(arch, size=size, seed=seed)
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / (f"networks_{arch}_{data}{size}_s{steps}_b{batch_size}_"
                                  f"lr{lr:g}_{seed}.pt")
        if path.is_file():
            info = load_weights(model, path, arch)
            return model, {**info, "checkpoint": str(path), "trained_now": False}
    record = train_network(model, xt, yt, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                           progress=progress, desc=f"train {arch}")
    acc = accuracy(model, xh, yh)
    info = {"weights": f"trained here: {steps} Adam steps of {batch_size} on {len(xt)} {data} "
                       f"images ({size}x{size}), held-out accuracy {acc:.3f}",
            "held_out_accuracy": acc, "training": record, "data": data, "size": size}
    if path is not None:
        save_checkpoint(path, model, arch, info)
        info["checkpoint"] = str(path)
    return model, {**info, "trained_now": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=ARCHS, default="densenet201")
    p.add_argument("--data", choices=["mnist", "digits"], default="mnist")
    p.add_argument("--mnist-dir", default=None, help="directory of the MNIST IDX files")
    p.add_argument("--size", type=int, default=32, help="image side after resizing (>= 32 for "
                   "the DenseNets)")
    p.add_argument("--steps", type=int, default=80, help="training steps (0: no training)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=None, help="Adam's learning rate (default 1e-3; "
                   "3e-4 for the MLP)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default=None, help="start from this checkpoint (this job's "
                   "format or a plain state_dict, e.g. torchvision's ImageNet weights)")
    p.add_argument("--out", default=None, help="checkpoint file (default "
                   "results/networks_ARCH_DATA.pt)")
    p.add_argument("--eval-batch", type=int, default=16, help="held-out images evaluated by "
                   "Jacobi-GS after training (0: skip)")
    p.add_argument("--tol", type=float, default=1e-4, help="forward-difference tolerance of "
                   "that evaluation")


def _network_from(path, arch: str, *, size: int, seed: int) -> tuple[nn.Module, int]:
    """``(model, num_classes)``: an ``arch`` network with the weights of the file ``path``
    (:func:`read_weights`), its number of classes read from its last linear layer. The network
    is built within the budget the file justifies
    (:func:`paraprop.models.checkpoint.build_within_budget`), so a checkpoint that claims a
    billion classes is refused before anything that size is allocated.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_weights`; an absurd number of classes;
            weights that do not fit the network.
    """
    state, _ = read_weights(path, arch)
    num_classes = classes_of(state) or 10
    config = {"arch": arch, "num_classes": num_classes, "size": size, "seed": seed}
    model = build_within_budget(make_network, config, path=path, kind=arch,
                                file_bytes=Path(path).stat().st_size, tensors=len(state))
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{path}: its weights do not fit the {arch} network: {e}") from None
    return model.eval(), num_classes


def run(args) -> int:
    from paraprop.networks import evaluate

    if args.steps < 0 or args.eval_batch < 0:
        raise ValueError(f"--steps and --eval-batch must be >= 0, got {args.steps}, "
                         f"{args.eval_batch}")
    out = check_out_file(default_path(args.out, f"results/networks_{args.arch}_{args.data}.pt"),
                         example=f"networks_{args.arch}_{args.data}.pt")
    num_classes, source = 10, "random initialisation"
    if args.weights is None:
        model = make_network(args.arch, num_classes, size=args.size, seed=args.seed)
    else:
        model, num_classes = _network_from(args.weights, args.arch, size=args.size,
                                           seed=args.seed)
        source = f"loaded from {args.weights}"
    if args.steps > 0 and num_classes < 10:
        raise ValueError(f"--weights {args.weights}: the checkpoint has {num_classes} outputs, "
                         "fewer than the 10 classes to train on (use --steps 0 to evaluate it)")
    x, y = image_data(args.data, size=args.size, channels=input_channels(args.arch),
                      mnist_dir=args.mnist_dir)
    xt, yt, xh, yh = split(args.data, x, y)
    if args.steps > 0:
        lr = default_lr(args.arch) if args.lr is None else args.lr
        rec = train_network(model, xt, yt, steps=args.steps, batch_size=args.batch_size,
                            lr=lr, seed=args.seed, desc=f"train {args.arch}")
        source += (f", then trained here: {args.steps} Adam steps of {args.batch_size} on "
                   f"{len(xt)} {args.data} images ({args.size}x{args.size}); loss "
                   f"{rec['loss_first']:.3f} -> {rec['loss_last']:.3f}")
    acc = accuracy(model, xh, yh) if num_classes == 10 else math.nan
    info = {"weights": source, "held_out_accuracy": acc, "data": args.data, "size": args.size}
    save_checkpoint(out, model, args.arch, info)
    print(f"{args.arch}: weights = {source}")
    print(f"held-out accuracy ({len(xh)} {args.data} images): {acc:.4f}; saved {out}")
    if args.eval_batch > 0:
        out_y, sol = evaluate(model, xh[: args.eval_batch], tol=args.tol)
        st = sol.stats
        print(f"Jacobi-GS over {st['T']} states (block_size 1, tol={args.tol:g}, batch "
              f"{args.eval_batch}): stopped after {sol.iterations} iterations with "
              f"{st['output_error']} top-5 changes; top-5 settled at iteration {st['settled']}; "
              f"max |output - sequential| {st['max_abs_error']:.2e}")
    return 0
