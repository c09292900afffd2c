"""Sample a trained zuko normalizing flow faster, with bitwise the same samples.

A masked autoregressive flow (MAF) samples by inverting each autoregressive transform, and
zuko does that with a fixed loop of D passes of the network (D = number of features): pass k
fixes feature k. That loop is Jacobi iteration on a triangular system, which usually reaches
its fixed point long before D passes (Song et al. 2021). `paraprop.flows.accelerate(flow)`
runs the same passes but stops at the fixed point, inside zuko's own `flow().sample()`: the
samples are bitwise zuko's, after far fewer passes. (`paraprop.flows.parallel_inverse` does
the same for one call and returns a `paraprop.Solution` with the counts.)

This script trains a small zuko MAF on the 8x8 digits (D = 64, shipped with paraprop), then
samples it with and without paraprop from the same random state and compares.

Run:  python examples/flow_sampling.py            (about half a minute on 2 CPU cores)
      python examples/flow_sampling.py --smoke    (a few seconds)
"""

import argparse
import time

import torch
import zuko

import paraprop.data
import paraprop.flows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--hidden", type=int, default=256, help="width of the MADE networks")
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (A B A B ...)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.hidden, args.samples, args.rounds = 20, 32, 16, 1

    # 1. train: maximum likelihood on the digits, dequantized (17 grey levels, step 1/16)
    images, _ = paraprop.data.load_digits()
    data = images.flatten(1)                                   # (1797, 64) in [0, 1]
    torch.manual_seed(0)
    flow = zuko.flows.MAF(64, transforms=3, hidden_features=(args.hidden, args.hidden))
    opt = torch.optim.Adam(flow.parameters(), lr=1e-3)
    for step in range(args.steps):
        x = data[torch.randint(0, len(data), (128,))]
        x = x + torch.rand_like(x) / 16
        loss = -flow().log_prob(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  negative log-likelihood {loss.item():8.2f}")
    flow.requires_grad_(False)

    # 2. sample: zuko's own loop, then the same call with paraprop, from the same seed
    times = {"zuko": [], "paraprop": []}
    for r in range(args.rounds):
        torch.manual_seed(r)
        t0 = time.perf_counter()
        expected = flow().sample((args.samples,))             # D passes per transform
        times["zuko"].append(time.perf_counter() - t0)

        with paraprop.flows.accelerate(flow) as handle:       # the one-line change
            torch.manual_seed(r)
            t0 = time.perf_counter()
            samples = flow().sample((args.samples,))          # same call, early stop
            times["paraprop"].append(time.perf_counter() - t0)
        assert torch.equal(samples, expected)                 # the promise: bitwise zuko's

    t_zuko, t_ours = (sorted(t)[len(t) // 2] for t in times.values())
    print(f"{args.samples} samples, D = 64, 3 transforms: network passes zuko "
          f"{handle.library_passes}, paraprop {handle.passes}")
    print(f"median sampling time zuko {t_zuko * 1e3:.1f} ms, paraprop {t_ours * 1e3:.1f} ms "
          f"({t_zuko / t_ours:.1f}x)")
    print("samples bitwise equal to zuko's own sample: OK")


if __name__ == "__main__":
    main()
