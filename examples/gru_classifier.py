"""Train a GRU (or LSTM) sequence classifier whose backward pass is a scan (BPPSA).

`paraprop.nn.GRU` takes `torch.nn.GRU`'s arguments and state dict and runs torch's own kernel
forward; only back-propagation through time differs: the hidden-state gradients of all time
steps come from one linear recurrence per layer (a scan) and the weight gradients from a few
batched contractions, instead of T dependent autograd steps. Swap the class, keep the rest.
`--cell lstm` does the same with `paraprop.nn.LSTM` in place of `torch.nn.LSTM` (its scan
carries the cell state beside the hidden state).

The task is BPPSA's synthetic bitstream classification (Wang et al. 2020, §4.1): a sequence of
T bits drawn with probability 0.05 + 0.1 c, and the label is the class c. This script trains
the classifier with `paraprop.nn.GRU` and, at every step, computes `torch.nn.GRU`'s loss and
gradients at the same weights: it times both (forward + backward) and checks that the gradients
agree to rounding. (Two separate float32 runs, one per module, drift apart within ~100 Adam
steps however close their gradients: training amplifies any rounding difference.)

Run:  python examples/gru_classifier.py               (T=1000, about a minute on 2 CPU cores)
      python examples/gru_classifier.py --cell lstm   (the same with an LSTM)
      python examples/gru_classifier.py --smoke       (a few seconds; with --cell lstm too)
"""

import argparse
import time

import torch
from torch import nn

import paraprop.nn
from paraprop.data import bitstreams  # (T, batch, 1) bits with P(1) = 0.05 + 0.1 * label
from paraprop.models import (
    RecurrentClassifier,  # a recurrent layer, then a linear readout of its last state
)

# the torch layer and its paraprop drop-in (same constructor arguments, same state dict)
CELLS = {"gru": (nn.GRU, paraprop.nn.GRU), "lstm": (nn.LSTM, paraprop.nn.LSTM)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=1000, help="sequence length T")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=20)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--cell", choices=CELLS, default="gru",
                   help="the recurrent layer: torch.nn.GRU or torch.nn.LSTM and its drop-in")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    args = p.parse_args()
    if args.smoke:
        args.length, args.steps = 50, 4

    torch.manual_seed(0)
    torch_cell, paraprop_cell = CELLS[args.cell]
    ref = RecurrentClassifier(torch_cell(1, args.hidden), args.classes)
    model = RecurrentClassifier(paraprop_cell(1, args.hidden), args.classes)  # backward="scan"
    model.load_state_dict(ref.state_dict())                                  # the same weights
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    gen = torch.Generator().manual_seed(1)
    losses, times, worst = [], {"torch": [], "paraprop": []}, 0.0
    for step in range(args.steps):
        x, y = bitstreams(args.length, args.batch, generator=gen, classes=args.classes)
        ref.load_state_dict(model.state_dict())  # the reference sees the current weights
        for name, m in (("torch", ref), ("paraprop", model)):
            m.zero_grad()
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()                      # paraprop: one scan over the T steps
            times[name].append(time.perf_counter() - t0)
        # the promise: torch's gradients, up to rounding (relative, per parameter tensor)
        for a, b in zip(ref.parameters(), model.parameters(), strict=True):
            worst = max(worst, ((a.grad - b.grad).norm() / a.grad.norm()).item())
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # usual for RNNs
        opt.step()
        losses.append(loss.item())
        every = max(1, args.steps // 6)
        if (step + 1) % every == 0:              # the loss curve, averaged over `every` steps
            print(f"steps {step + 1 - every:4d}-{step:4d}  mean loss "
                  f"{sum(losses[-every:]) / every:.4f}")

    assert worst < 1e-4, worst
    t_ref, t_ours = (sorted(t)[len(t) // 2] for t in times.values())   # medians
    print(f"{args.cell.upper()}, T={args.length}, batch {args.batch}, hidden {args.hidden}: "
          f"median forward+backward "
          f"torch {t_ref * 1e3:.1f} ms, paraprop {t_ours * 1e3:.1f} ms "
          f"({t_ref / t_ours:.1f}x)")
    print(f"gradients equal to torch's within {worst:.1e} (relative): OK")


if __name__ == "__main__":
    main()
