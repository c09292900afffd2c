"""A recurrent layer read out from its last state: the classifier of BPPSA's RNN experiments."""

from __future__ import annotations

from torch import nn


class RecurrentClassifier(nn.Module):
    """A recurrent layer read out by a linear layer from its last state (BPPSA §4.1)."""

    def __init__(self, rnn: nn.Module, classes: int):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size, classes)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[-1])
