"""The recurrent classifiers of BPPSA's experiments, in torch's and paraprop's versions with
identical weights; shared by ``paraprop bench bppsa`` and the BPPSA demo part.
"""

from __future__ import annotations

import torch
from torch import nn

from paraprop.models import RecurrentClassifier
from paraprop.nn import GRU, RNN

HIDDEN, CLASSES, LR = 20, 10, 1e-5


def pair(kind: str, inputs: int, classes: int, seed: int, **ours_kwargs):
    """The torch model and ours with identical weights: ``{"torch": m, "scan": m, ...}``."""
    torch.manual_seed(seed)
    if kind == "rnn":
        ref = RecurrentClassifier(nn.RNN(inputs, HIDDEN), classes)
        mine = RecurrentClassifier(RNN(inputs, HIDDEN, **ours_kwargs), classes)
    else:
        ref = RecurrentClassifier(nn.GRU(inputs, HIDDEN), classes)
        mine = RecurrentClassifier(GRU(inputs, HIDDEN, **ours_kwargs), classes)
    mine.load_state_dict(ref.state_dict())
    return ref, mine

