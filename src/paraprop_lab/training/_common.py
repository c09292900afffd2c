"""What the training jobs share: the data switch, the Adam loop and the figures of samples."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from paraprop.data import load_digits, load_mnist
from paraprop.models.checkpoint import check_finite_weights  # noqa: F401 (re-export)
from paraprop_lab.progress import progress as progress_bar


def _can_write_in(directory: Path, option: str, path: Path) -> None:
    """Create and remove a temporary file in ``directory`` (the test that also holds for root,
    read-only file systems and ACLs); an ``OSError`` naming ``option`` if that fails."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".paraprop-write-test-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise OSError(f"{option} {path}: cannot write in {directory} "
                      f"({e.strerror or e})") from None


def _make_dir(directory: Path, option: str, path: Path, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{option} {path}: cannot create {what} ({e.strerror or e})") from None


def _not_empty(path, option: str, expected: str) -> None:
    """An empty ``path`` (``--out ""``) is refused, not read as the current directory or
    replaced by a default."""
    if path is None or (isinstance(path, str | bytes) and not path.strip()):
        raise ValueError(f"{option} {path!r}: empty; expected {expected} (leave the option "
                         "out for the default)")


def add_data_arguments(p, *, choices, default: str, epochs: int | dict[str, int]) -> None:
    """The options every image job opens with: ``--data`` (``choices``, ``default``),
    ``--mnist-dir`` and ``--epochs`` (``epochs``: an int default, or data -> epochs, then
    ``None`` by default, the data's number, listed in the help)."""
    p.add_argument("--data", choices=list(choices), default=default)
    p.add_argument("--mnist-dir", default=None, help="directory of the MNIST IDX files")
    if isinstance(epochs, dict):
        p.add_argument("--epochs", type=int, default=None,
                       help="default: " + ", ".join(f"{k} {v}" for k, v in epochs.items()))
    else:
        p.add_argument("--epochs", type=int, default=epochs)


def results_file(args, job: str) -> Path:
    """The checkpoint of ``paraprop train JOB``: ``--out``, by default
    ``results/JOB_DATA.pt``, checked by :func:`check_out_file` before any training."""
    return check_out_file(default_path(args.out, f"results/{job}_{args.data}.pt"),
                          example=f"{job}_{args.data}.pt")


def subplots(*args, **kwargs):
    """``matplotlib.pyplot.subplots`` on the headless Agg backend (matplotlib imported when a
    figure is drawn, so that the jobs load without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def default_path(value, default):
    """The option's ``value``, or ``default`` when it was not given (``None``); an empty value
    is kept, for :func:`check_out_file` to refuse."""
    return default if value is None else value


def check_out_file(path, option: str = "--out", *, example: str = "model.pt") -> Path:
    """Check, before any training, that the file ``path`` can be written: not a directory, and
    its folder writable (or, if it does not exist yet, the nearest existing folder above it,
    where saving will create it). Nothing is left behind.

    Arguments:
        path: the output file.
        option: the command-line option it came from, for the messages.
        example: a file name to suggest when ``path`` is a directory.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: ``path`` is empty, ends with a path separator (it names a directory, and
            ``Path`` would drop the separator and write a file of that name), is a directory or
            another non-regular file.
        OSError: nothing can be written in its folder, a folder on its way is a file, or
            the file exists and is read-only.
    """
    _not_empty(path, option, "the path of a file to write, e.g. " + example)
    raw = os.fsdecode(os.fspath(path))
    last = raw
    for sep in (os.sep, os.altsep):
        if sep:
            last = last.rsplit(sep, 1)[-1]
    if last in ("", ".", ".."):   # Path() would drop a final separator or "." and write there
        end = "a path separator" if not last else repr(last)
        raise ValueError(f"{option} {raw}: ends with {end}, so it names a directory; expected "
                         f"the path of a file to write, e.g. {Path(raw) / example}")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory; expected the path of a file to "
                         f"write, e.g. {path / example}")
    if path.exists() and not path.is_file():
        raise ValueError(f"{option} {path}: exists and is not a regular file; expected the "
                         "path of a file to write")
    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise OSError(f"{option} {path}: cannot create its directory {path.parent} ({folder} "
                      "is a file)")
    _can_write_in(folder, option, path)
    if path.exists() and not os.access(path, os.W_OK):
        raise OSError(f"{option} {path}: the file exists and is not writable")
    return path


def check_out_dir(path, option: str = "--out", *, what: str = "the output directory") -> Path:
    """Check, before any work, that the directory ``path`` can be written in: created if
    missing (with its parents), not a file, writable.

    Raises:
        ValueError: ``path`` is empty, or exists and is not a directory.
        OSError: it cannot be created or written in.
    """
    _not_empty(path, option, what)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path}: is a file, not a directory; expected {what}")
    _make_dir(path, option, path, what)
    _can_write_in(path, option, path)
    return path


def load_images(data: str, *, mnist_dir=None) -> tuple[torch.Tensor, int]:
    """Images ``(N, S, S)`` in ``[0, 1]`` and their number of grey levels (17 for the digits,
    256 for MNIST)."""
    if data == "digits":
        return load_digits()[0], 17
    if data == "mnist":
        return load_mnist(mnist_dir)[0], 256
    raise ValueError(f"unknown data={data!r}; choose 'digits' or 'mnist'")


def signed_images(data: str, *, mnist_dir=None, n: int | None = None) -> torch.Tensor:
    """Images ``(N, 1, S, S)`` float32 scaled to ``[-1, 1]``: the first ``n``, or all."""
    images, _ = load_images(data, mnist_dir=mnist_dir)
    x = images[:, None] * 2 - 1
    return x if n is None else x[:n]


def fit(model: torch.nn.Module, x: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor], *,
        epochs: int, batch_size: int, lr: float, seed: int, progress: bool, desc: str,
        label: str) -> list[float]:
    """Adam on ``loss(batch)`` over shuffled mini-batches of ``x``; returns the mean loss of every
    epoch (shown as ``label`` in the progress bar). The model is left in eval mode."""
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    history = []
    steps = math.ceil(len(x) / batch_size)
    bar = progress_bar(total=epochs * steps, desc=desc, unit="steps", disable=not progress)
    model.train()
    for _ in range(epochs):
        total = 0.0
        for idx in torch.randperm(len(x), generator=g).split(batch_size):
            value = loss(x[idx])
            opt.zero_grad()
            value.backward()
            opt.step()
            total += value.item() * len(idx)
            bar.update()
        history.append(total / len(x))
        bar.set_postfix({label: f"{history[-1]:.4f}"})
    bar.close()
    model.eval()
    return history


def tile(images: torch.Tensor, cols: int = 4, gap: int = 1) -> torch.Tensor:
    """Images ``(N, 1, S, S)`` in ``[-1, 1]`` as one picture in ``[0, 1]``: ``cols`` per row,
    separated by ``gap`` grey pixels (black where the last row is not full)."""
    n, s = len(images), images.shape[-1]
    rows = -(-n // cols)
    step = s + gap
    out = torch.full((rows * step + gap, cols * step + gap), 0.5)
    for i, img in enumerate((images[:, 0].detach().float().cpu().clamp(-1, 1) + 1) / 2):
        r, c = divmod(i, cols)
        out[gap + r * step:gap + r * step + s, gap + c * step:gap + c * step + s] = img
    for i in range(n, rows * cols):
        r, c = divmod(i, cols)
        out[gap + r * step:gap + r * step + s, gap + c * step:gap + c * step + s] = 0
    return out


def image_panel(ax, images: torch.Tensor, title: str) -> None:
    """Images ``(N, 1, S, S)`` in ``[-1, 1]`` as one grey tiled picture on ``ax``, titled."""
    ax.imshow(tile(images).numpy(), cmap="gray", vmin=0, vmax=1)
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])


def moons_panels(axes, x: torch.Tensor, samples: torch.Tensor, how: str) -> None:
    """The two-moons figure of a generative job: the training points (left) and ``samples``
    (right, titled with ``how``), same square axes."""
    n = len(samples)
    lim = 1.15 * max(float(x[:n].abs().max()), 1.0)
    for ax, pts, title in ((axes[0], x[:n], f"training data ({n} points)"),
                           (axes[1], samples, f"samples ({n}, {how})")):
        pts = pts.detach().float().cpu()
        ax.scatter(pts[:, 0], pts[:, 1], s=3, alpha=0.6)
        ax.set_title(title)
        ax.set_xlabel("first coordinate (standardised)")
        ax.set_ylabel("second coordinate (standardised)")
        ax.set_xlim(-lim, lim)
        ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")


def save_png(fig, path) -> Path:
    """Lay out ``fig``, write it to ``path`` (folders created), close it; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fit_options(args, **override) -> dict:
    """The Adam loop's options of a job's command line (``--epochs``, ``--batch-size``,
    ``--lr``, ``--seed``), as keywords of its ``train_*`` function; ``override`` replaces
    some (e.g. the data's default epochs)."""
    return {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
            "seed": args.seed, **override}


def n_parameters(model: torch.nn.Module) -> int:
    """The number of parameters (entries) of ``model``."""
    return sum(p.numel() for p in model.parameters())


def report_trained(what: str, history: list[float], saved: list, *, loss: str = "NLL",
                   unit: str = "nats/dim", digits: int = 4, seconds: float | None = None) -> int:
    """Print a job's closing line, ``trained WHAT: LOSS first -> last UNIT in N s; saved A and
    B`` (``loss`` and ``unit`` left out where empty, the time where ``seconds`` is ``None``),
    and return the job's exit status, 0."""
    first, last = f"{history[0]:.{digits}f}", f"{history[-1]:.{digits}f}"
    curve = " ".join(w for w in (loss, first, "->", last, unit) if w)
    took = "" if seconds is None else f" in {seconds:.0f} s"
    print(f"trained {what}: {curve}{took}; saved {' and '.join(map(str, saved))}")
    return 0
