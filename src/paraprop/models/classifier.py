"""A recurrent layer read out from its last state: the classifier of BPPSA's RNN experiments."""

from __future__ import annotations

from typing import cast

from torch import nn


class RecurrentClassifier(nn.Module):
    """A recurrent layer read out by a linear layer from its last state (BPPSA §4.1).

    Example:
        >>> model = RecurrentClassifier(paraprop.nn.GRU(1, 8), classes=3)
        >>> model(torch.randn(20, 4, 1)).shape          # (T, batch, 1) -> logits (batch, 3)
        torch.Size([4, 3])
    """

    def __init__(self, rnn: nn.Module, classes: int):
        super().__init__()
        self.rnn = rnn
        # torch's and paraprop's recurrent layers hold their width as an int attribute
        self.head = nn.Linear(cast(int, rnn.hidden_size), classes)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[-1])
