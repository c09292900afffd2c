"""Fuse the optimizer step into training, with gradient clipping and accumulation.

`paraprop.optim.fuse(optimizer, model)` returns an optimizer that you use exactly like the one
you gave it. In forward mode `step()` only records the update; each module applies its own
parameters' update right before it runs in the next forward pass, while their memory is hot
(Jiang et al. 2021). With `overlap=True` the updates run on a background thread while the pass
goes on. The updates run the wrapped optimizer's own code: the trained model is bitwise the
same.

Two things change in the loop, both shown below:
- gradient accumulation: `fuse(..., accumulation_steps=k)`, then call `step()` and
  `zero_grad()` after every backward; every k-th call updates, the others accumulate;
- clipping: `clip_grad_norm_` before the `step()` call that updates (forward mode only).

This script trains an MLP on the 8x8 digits twice from the same weights on the same batches,
with a plain `torch.optim.AdamW` loop and with the fused optimizer, and checks that the
parameters are bitwise equal at the end. The time saved is small on a CPU, where the optimizer
is a small part of a step (docs/optim.md, "Measured").

Run:  python examples/fused_optimizer.py            (about a minute on 2 CPU cores)
      python examples/fused_optimizer.py --smoke    (a few seconds)
"""

import argparse
import time

import torch
from torch import nn

import paraprop.data
import paraprop.optim


def make_model(width, depth):
    torch.manual_seed(0)                       # the same weights every time
    layers, size = [nn.Flatten()], 64
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, 10))


def batches(x, y, micro, seed=1):
    """An endless stream of random micro-batches (the same stream for the same seed)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, len(x), (micro,), generator=gen)
        yield x[idx], y[idx]


def train(model, opt, data, updates, accumulate, fused):
    """`updates` optimizer updates of `accumulate` micro-batches each: (seconds, losses)."""
    losses = []
    t0 = time.perf_counter()
    for _ in range(updates):
        total = 0.0
        for k in range(accumulate):
            xb, yb = next(data)
            loss = nn.functional.cross_entropy(model(xb), yb) / accumulate
            loss.backward()                    # gradients add up over the micro-batches
            total += loss.item()
            last = k == accumulate - 1
            if last:
                nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            if fused or last:                  # fused: step() after every backward
                opt.step()
                opt.zero_grad()
        losses.append(total)
    if fused:
        opt.flush()                            # apply the last recorded update now
    return time.perf_counter() - t0, losses


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4, help="hidden layers")
    p.add_argument("--steps", type=int, default=300, help="optimizer updates")
    p.add_argument("--micro", type=int, default=16, help="micro-batch size")
    p.add_argument("--accumulate", type=int, default=4, help="micro-batches per update")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    args = p.parse_args()
    if args.smoke:
        args.width, args.depth, args.steps = 32, 2, 5

    images, labels = paraprop.data.load_digits()
    plain = make_model(args.width, args.depth)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    fused = make_model(args.width, args.depth)
    fused_opt = paraprop.optim.fuse(torch.optim.AdamW(fused.parameters(), lr=1e-3), fused,
                                    mode="forward", accumulation_steps=args.accumulate,
                                    overlap=True)

    # train both on the same batches, taking turns (A B A B) so that the machine's load and
    # warm-up hit both alike; the first turn is a warm-up and is not timed
    runs = {"plain": (plain, plain_opt, False), "fused": (fused, fused_opt, True)}
    data = {name: batches(images, labels, args.micro) for name in runs}
    seconds, losses = {"plain": 0.0, "fused": 0.0}, {"plain": [], "fused": []}
    turns = 6
    for turn in range(turns):
        n = args.steps // turns + (turn < args.steps % turns)
        for name, (model, opt, is_fused) in runs.items():
            t, ls = train(model, opt, data[name], n, args.accumulate, is_fused)
            seconds[name] += t if turn > 0 else 0.0
            losses[name] += ls
    l_plain, l_fused = losses["plain"], losses["fused"]
    t_plain, t_fused = seconds["plain"], seconds["fused"]

    every = max(1, args.steps // 5)
    for i in range(0, args.steps, every):
        print(f"update {i:4d}  loss plain {l_plain[i]:.4f}  fused {l_fused[i]:.4f}")
    # the promise: bitwise the plain optimizer's result
    same = all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                  fused.state_dict().values(), strict=True))
    assert same and l_plain == l_fused
    n = sum(p.numel() for p in plain.parameters())
    print(f"{n:,} parameters, {args.steps} updates of {args.accumulate} x {args.micro}: "
          f"plain {t_plain:.2f} s, fused {t_fused:.2f} s ({t_plain / t_fused:.2f}x, "
          f"first turn of {turns} not timed)")
    print("parameters and losses bitwise equal: OK")


if __name__ == "__main__":
    main()
