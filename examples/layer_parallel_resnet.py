"""Train a ResNet with its layers split over 2 processes, solved in parallel by multigrid.

A residual network u_{n+1} = u_n + h F_n(u_n) is a chain over depth: plain model parallelism
makes rank 1 wait for rank 0's activations. `paraprop.distributed.LayerParallelStack` solves
the chain by MGRIT instead (Kirby et al. 2020): every rank relaxes its own layers at once and
only boundary values cross ranks; the backward pass is the adjoint, solved the same way. Each
solve stops when its estimated error against serial propagation is below `tol`, so training
follows the serial network's.

Rank 0 holds the opening convolution and the first half of the layers, rank 1 the second half
and the head. The script checks each rank's first gradients against the serial network's,
trains on the 8x8 digits, then trains the serial network on the same batches (on rank 1) to
compare. MGRIT evaluates each layer several times per solve, so on 2 shared CPU cores it is
much slower than serial training; it pays with many workers (docs/multigrid.md, cost model).

Run:  torchrun --standalone --nproc_per_node=2 examples/layer_parallel_resnet.py
      torchrun --standalone --nproc_per_node=2 examples/layer_parallel_resnet.py --smoke
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

import paraprop.data
from paraprop.distributed import LayerParallelStack, init_from_env, layer_range

CE = nn.functional.cross_entropy


class Block(nn.Module):
    """A residual branch F(u) = relu(conv3x3(u)); the layer is u + h F(u)."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, u):
        return torch.relu(self.conv(u))


class ResNet(nn.Module):
    """Opening conv, `depth` residual layers, linear head; `forward` is the plain serial net."""

    def __init__(self, depth, channels):
        super().__init__()
        torch.manual_seed(0)                      # the same weights on every rank
        self.opening = nn.Conv2d(1, channels, 3, padding=1)
        self.blocks = nn.ModuleList(Block(channels) for _ in range(depth))
        self.head = nn.Linear(channels * 64, 10)

    def forward(self, x):
        u, h = torch.relu(self.opening(x[:, None])), 1 / len(self.blocks)
        for block in self.blocks:
            u = u + h * block(u)
        return self.head(u.flatten(1))


def train_serial(net, images, labels, batches):
    """The reference: the same network trained serially in one process."""
    opt, losses, t0 = torch.optim.Adam(net.parameters(), lr=0.01), [], time.perf_counter()
    for idx in batches:
        loss = CE(net(images[idx]), labels[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=32, help="residual layers")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    args = p.parse_args()
    torch.set_num_threads(1)                      # one core per rank
    rank = init_from_env()                        # gloo on a CPU
    first, last = rank == 0, rank == dist.get_world_size() - 1

    # the data, and the same seeded split and batches on every rank
    images, labels = paraprop.data.load_digits()  # 1797 images, 8x8
    perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    gen = torch.Generator().manual_seed(1)
    batches = [train[i] for _ in range(args.epochs)
               for i in torch.randperm(len(train), generator=gen).split(args.batch)]
    if args.smoke:
        args.depth, batches = 8, batches[:3]

    # every rank builds the whole network, computes its serial gradients for the first batch
    # (to check against), then keeps only its share: layers [a, b) and the ends it owns
    net = ResNet(args.depth, args.channels)
    opening, head = net.opening, net.head
    CE(net(images[batches[0]]), labels[batches[0]]).backward()
    a, b = layer_range(args.depth)
    stack = LayerParallelStack(net.blocks[a:b], 1 / args.depth, depth=args.depth, levels=2,
                               coarsening=4, tol=1e-5)
    mine = [*stack.parameters(), *(opening.parameters() if first else ()),
            *(head.parameters() if last else ())]
    expected = [q.grad for q in mine]
    opt = torch.optim.Adam(mine, lr=0.01)
    opt.zero_grad()

    def forward(idx):                             # collective: every rank calls it
        if first:
            u = torch.relu(opening(images[idx][:, None]))
        else:                                     # only rank 0's input is used
            u = torch.zeros(len(idx), args.channels, 8, 8)
        return stack(u)                           # u_N on the last rank

    losses, cycles, t0 = [], [], time.perf_counter()
    for step, idx in enumerate(batches):
        out = forward(idx)
        if last:
            loss = CE(head(out.flatten(1)), labels[idx])
            loss.backward()
            losses.append(loss.item())
        else:
            out.backward(torch.zeros_like(out))   # backward is collective too
        if step == 0:                             # the promise: the serial gradients
            err = max(((q.grad - e).norm() / e.norm()).item()
                      for q, e in zip(mine, expected, strict=True))
            assert err < 1e-4, f"rank {rank}: gradients differ from serial by {err:.1e}"
        cycles.append(stack.last_forward.iterations)
        opt.step()
        opt.zero_grad()
    t_parallel = time.perf_counter() - t0
    with torch.no_grad():
        out = forward(test)
    dist.barrier()

    if last:
        acc = (head(out.flatten(1)).argmax(1) == labels[test]).float().mean().item()
        ref = ResNet(args.depth, args.channels)
        ref_losses, t_serial = train_serial(ref, images, labels, batches)
        with torch.no_grad():
            ref_acc = (ref(images[test]).argmax(1) == labels[test]).float().mean().item()
        for i in range(0, len(batches), max(1, len(batches) // 6)):
            print(f"step {i:4d}  loss layer-parallel {losses[i]:.4f}  serial {ref_losses[i]:.4f}")
        diff = max(abs(x - y) for x, y in zip(losses, ref_losses, strict=True))
        assert diff < 0.05 and abs(acc - ref_acc) < 0.03, (diff, acc, ref_acc)
        print(f"depth {args.depth}, {dist.get_world_size()} ranks, {len(batches)} steps: "
              f"layer-parallel {t_parallel:.1f} s ({sum(cycles) / len(cycles):.1f} V-cycles "
              f"per forward), serial {t_serial:.1f} s")
        print(f"test accuracy layer-parallel {acc:.1%}, serial {ref_acc:.1%}; max loss "
              f"difference {diff:.1e}; first gradients equal to serial on every rank: OK")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
