"""The recurrent classifiers of BPPSA's experiments, in torch's and paraprop's versions with
identical weights; shared by ``paraprop bench bppsa`` and the BPPSA demo part.
"""

from __future__ import annotations

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

