"""The checkpoint format of the models of this package: one torch file holding
``{"kind", "config", "state_dict"}``, read back with ``weights_only=True``."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch


def save_checkpoint(kind: str, config: dict, state_dict: dict, path) -> None:
    """Write the checkpoint of a model of class ``kind`` to ``path`` (parents created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"kind": kind, "config": config, "state_dict": state_dict}, path)


def load_checkpoint(cls, kind: str, path, map_location):
    """A model of class ``cls`` from the checkpoint ``{"kind", "config", "state_dict"}`` that
    ``cls.save`` wrote at ``path``; every failure names the file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (expected a paraprop {kind} checkpoint)")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a paraprop {kind} checkpoint")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except pickle.UnpicklingError:
        raise ValueError(f"{path}: cannot be read as a paraprop {kind} checkpoint (torch.load "
                         "with weights_only=True: not a torch file of tensors and plain "
                         "containers)") from None
    except Exception as e:  # torch.load fails in many ways on a foreign file
        lines = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
        raise ValueError(f"{path}: cannot be read as a paraprop {kind} checkpoint "
                         f"(torch.load: {reason})") from None
    found = ckpt.get("kind") if isinstance(ckpt, dict) else None
    if found != kind:
        what = f"a {found} checkpoint" if isinstance(found, str) else \
            f"a {type(ckpt).__name__} without a model kind"
        raise ValueError(f"{path}: not a paraprop {kind} checkpoint (it holds {what})")
    cfg, state = ckpt.get("config"), ckpt.get("state_dict")
    if not isinstance(cfg, dict) or not isinstance(state, dict):
        raise ValueError(f"{path}: not a paraprop {kind} checkpoint (config or state_dict "
                         "missing)")
    try:
        model = cls(**cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad {kind} config in the checkpoint: {e}") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        errors = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()] or [str(e)]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(f"{path}: the weights do not fit the {kind} config: "
                         f"{errors[0].rstrip('.')}{more}") from None
    return model


class Checkpointed:
    """``save`` / ``load`` for a model class with a ``config`` dict of its constructor's
    arguments; the checkpoint's kind is the class name."""

    load_in_eval: bool = False  # load() returns the model in eval mode

    def save(self, path: str | Path) -> None:
        """Save the config and state dict (``load`` of the same class rebuilds the model)."""
        save_checkpoint(type(self).__name__, self.config, self.state_dict(), path)

    @classmethod
    def load(cls, path: str | Path, map_location="cpu"):
        """The model saved by :meth:`save` at ``path``.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a checkpoint of this class (not a torch file, another
                model's, or a config or weights that do not fit); the message names the file.
        """
        model = load_checkpoint(cls, cls.__name__, path, map_location)
        return model.eval() if cls.load_in_eval else model

