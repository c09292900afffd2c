"""The recurrent classifiers of BPPSA's experiments, in torch's and paraprop's versions with
identical weights; shared by ``paraprop bench bppsa`` and the BPPSA demo part.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from paraprop.models import RecurrentClassifier
from paraprop.nn import GRU, LSTM, RNN

HIDDEN, CLASSES, LR = 20, 10, 1e-5


MODULES = {"rnn": (nn.RNN, RNN), "gru": (nn.GRU, GRU), "lstm": (nn.LSTM, LSTM)}


def pair(kind: str, inputs: int, classes: int, seed: int, hidden: int = HIDDEN, **ours_kwargs):
    """The torch classifier and ours (``kind``: ``"rnn"``, ``"gru"`` or ``"lstm"``) with
    identical weights, ``(torch's, ours)``. Ours runs torch's forward kernel and the scan
    backward unless ``ours_kwargs`` say otherwise (the columns' meaning; the modules' own
    defaults are ``"auto"``, which picks torch's LSTM on a CPU)."""
    ours_kwargs.setdefault("forward", "sequential")
    ours_kwargs.setdefault("backward", "scan")
    torch.manual_seed(seed)
    theirs, ours = MODULES[kind]
    ref = RecurrentClassifier(theirs(inputs, hidden), classes)
    mine = RecurrentClassifier(ours(inputs, hidden, **ours_kwargs), classes)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


class Stepper:
    """One training step, its forward / backward / optimizer parts timed separately."""

    def __init__(self, model: nn.Module, x, y):
        self.model, self.x, self.y = model, x, y
        self.opt = torch.optim.Adam(model.parameters(), lr=LR)
        self.fwd: list[float] = []
        self.bwd: list[float] = []

    def __call__(self):
        self.opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.fwd.append(t1 - t0)
        self.bwd.append(t2 - t1)
        return loss
