"""Train ParaRNN's diagonal GRU and LSTM (Newton forward, scan backward) on BPPSA's bitstreams.

`paraprop.nn.ParaGRU` and `paraprop.nn.ParaLSTM` are the cells of ParaRNN (Danieli et al., ICLR
2026): torch's GRU and LSTM with every hidden-to-hidden matrix replaced by a diagonal, so that
Newton's method over the sequence is exact per iteration and costs O(T H). Their forward pass
runs Newton by default (a few parallel iterations instead of T dependent steps) and their
backward pass is one scan per layer.

The task is BPPSA's synthetic bitstream classification (Wang et al. 2020, §4.1): T bits drawn
with probability 0.05 + 0.1 c, and the label is the class c. The script trains one classifier
per cell (the last hidden state read out by a linear layer) and checks, at the first step, that
the Newton forward equals the module's sequential loop and that the scan backward gives the
gradients of autograd through that loop (the same weights). It writes the loss curves and the
Newton iterations per step to a PNG and checks that both cells learn (the last losses well below
the first). Newton needs more iterations as the cells learn to count (long memory makes the
linearised dynamics nearly marginal); the result stays exact, only the time grows.

Run:  python examples/para_rnn_bitstreams.py            (T=300, about a minute and a half on a
                                                         2-core CPU)
      python examples/para_rnn_bitstreams.py --smoke    (a few seconds)
"""

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import paraprop.nn  # noqa: E402
from paraprop.data import bitstreams  # noqa: E402  (T, batch, 1) bits, P(1) = 0.05 + 0.1 c
from paraprop.models import (
    RecurrentClassifier,  # a recurrent layer, then a linear readout of its last state
)


def check_against_the_loop(model, x, y):
    """The Newton forward and the scan backward against autograd through the sequential loop
    (a copy of the model, the same weights): max |out difference| and the largest relative
    gradient difference."""
    ref = RecurrentClassifier(type(model.rnn)(1, model.rnn.hidden_size, forward="sequential",
                                     backward="autograd"), model.head.out_features)
    ref.load_state_dict(model.state_dict())
    outs, grads = [], []
    for m in (model, ref):
        m.zero_grad()
        logits = m(x)
        nn.functional.cross_entropy(logits, y).backward()
        outs.append(logits.detach())
        grads.append([p.grad.clone() for p in m.parameters()])
    out_err = (outs[0] - outs[1]).abs().max().item()
    grad_err = max(((a - b).norm() / b.norm()).item() for a, b in zip(*grads, strict=True))
    return out_err, grad_err


def train(cls, args):
    torch.manual_seed(0)
    model = RecurrentClassifier(cls(1, args.hidden), args.classes)  # newton fwd, scan bwd
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    losses, iters, checks = [], [], None
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = bitstreams(args.length, args.batch, generator=gen, classes=args.classes)
        if step == 0:
            checks = check_against_the_loop(model, x, y)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()                                   # the scan backward
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        iters.append(model.rnn.last_forward[0].iterations)
        every = max(1, args.steps // 5)
        if (step + 1) % every == 0:
            print(f"  {cls.__name__} steps {step + 1 - every:4d}-{step:4d}: mean loss "
                  f"{sum(losses[-every:]) / every:.4f}, Newton iterations "
                  f"{min(iters[-every:])}-{max(iters[-every:])}")
    return losses, iters, checks, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=300, help="sequence length T")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--plot", type=Path, default=Path("results/para_rnn_bitstreams.png"),
                   help="where to write the loss curves")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    args = p.parse_args()
    if args.smoke:
        args.length, args.steps, args.hidden = 50, 6, 8

    runs = {}
    for cls in (paraprop.nn.ParaGRU, paraprop.nn.ParaLSTM):
        print(f"{cls.__name__}: T={args.length}, batch {args.batch}, hidden {args.hidden}, "
              f"{args.classes} classes")
        runs[cls.__name__] = train(cls, args)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    k = max(1, args.steps // 30)                  # a moving average over k steps
    for name, (losses, iters, _, _) in runs.items():
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(losses, alpha=0.3)
        ax.plot(smooth, color=ax.lines[-1].get_color(), label=f"{name} (Newton forward)")
        ax2.plot(iters, label=name)
    ax.axhline(torch.log(torch.tensor(float(args.classes))).item(), color="grey", ls="--", lw=0.8,
               label="chance (log classes)")
    ax.set_xlabel("training step (Adam)")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(f"bitstreams, T={args.length}: ParaGRU and ParaLSTM learn")
    ax.legend()
    ax2.set_xlabel("training step (Adam)")
    ax2.set_ylabel("Newton iterations of the forward pass")
    ax2.set_title(f"iterations to tol (at most T={args.length})")
    ax2.legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"loss curves: {args.plot}")

    worst = 0.0
    for name, (losses, _, (out_err, grad_err), took) in runs.items():
        n = max(1, len(losses) // 10)
        first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
        print(f"{name}: loss {first:.3f} -> {last:.3f} in {took:.1f} s; first step: logits "
              f"within {out_err:.1e} of the loop's, gradients within {grad_err:.1e} (relative)")
        assert out_err < 1e-4 and grad_err < 1e-4, (name, out_err, grad_err)
        if not args.smoke:                        # learning needs more than a few steps
            assert last < 0.6 * first, (name, first, last)
        worst = max(worst, grad_err)
    print(f"ParaGRU and ParaLSTM trained; gradients equal to autograd through the loop within "
          f"{worst:.1e}: OK")


if __name__ == "__main__":
    main()
