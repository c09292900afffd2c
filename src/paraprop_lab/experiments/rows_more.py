"""Device rows of the suites without a GPU target in issue 28 (their comparisons measured on the
device all the same): the core triangular systems, the flow libraries' sampling, back-propagation
as a block bi-diagonal system, and layer-parallel multigrid. See
:mod:`paraprop_lab.experiments.rows` for the record format and the scales.
"""

from __future__ import annotations

import torch

from paraprop_lab.experiments.rows import Context, max_abs, max_rel, row

CORE_TOL = 1e-5


# -- core: the two triangular systems of ``paraprop bench core`` -------------------------------
def core_rows(ctx: Context) -> list[dict]:
    """A MADE-shaped masked map (D=784, hidden 2x512, batch 100) and a tanh MLP as a recurrence
    over its layers (depth 4096, width 8, batch 8): the plain sequential loop against Jacobi
    (tol 1e-5), as ``paraprop bench core``."""
    from paraprop.models import LayerChain, MaskedAffineMap
    from paraprop.solve import solve

    dev, out = ctx.device, []
    D, hidden, B = ctx.pick((16, (32, 32), 4), (784, (512, 512), 100))
    m = MaskedAffineMap(D, hidden, seed=0).to(dev).requires_grad_(False)
    m.bind(torch.randn(B, D, generator=torch.Generator().manual_seed(1)).to(dev))
    idx = [torch.tensor([d], device=dev) for d in range(D)]

    def ancestral():
        x = torch.zeros(B, D, device=dev)
        with torch.no_grad():
            for d in range(D):
                x[:, d:d + 1] = m.update(x, idx[d])
        return x

    x0 = torch.zeros(B, D, device=dev)
    jac = lambda: solve(m, x0, method="jacobi", tol=CORE_TOL)  # noqa: E731
    times = ctx.time({"loop": ancestral, "jacobi": jac}, repeats=ctx.rounds(5), desc="core made")
    sol = jac()
    out.append(row("core", "made_map.jacobi", what="a MADE-shaped triangular map: Jacobi vs the "
                   "sequential loop", shape=f"D={D}, hidden {'x'.join(map(str, hidden))}, "
                   f"batch {B}, random weights", baseline="plain loop (D updates)",
                   baseline_s=times["loop"], method=f"jacobi, tol {CORE_TOL:g}",
                   method_s=times["jacobi"], max_dev=max_abs(sol.value, ancestral()),
                   bound=CORE_TOL, iterations=sol.iterations))
    depth, width, B = ctx.pick((64, 4, 2), (4096, 8, 8))
    c = LayerChain(depth, width, seed=0).to(dev).requires_grad_(False)
    u = torch.randn(B, width, generator=torch.Generator().manual_seed(1)).to(dev)
    c.bind(u)
    x0 = torch.zeros(B, depth, width, device=dev)
    jac = lambda: solve(c, x0, method="jacobi", tol=CORE_TOL, dim=-2)  # noqa: E731
    times = ctx.time({"loop": lambda: c.forward_sequential(u), "jacobi": jac},
                     repeats=ctx.rounds(3), desc="core chain")
    sol = jac()
    out.append(row("core", "mlp_chain.jacobi", what="a tanh MLP over its layers (Markov: the "
                   "hardest case for Jacobi) vs its forward pass", shape=f"depth {depth}, width "
                   f"{width}, batch {B}", baseline="forward pass", baseline_s=times["loop"],
                   method=f"jacobi, tol {CORE_TOL:g}", method_s=times["jacobi"],
                   max_dev=max_abs(sol.value, c.forward_sequential(u)), bound=CORE_TOL,
                   iterations=sol.iterations))
    return out


# -- flows: the libraries' own sampling, accelerated -------------------------------------------
def flows_rows(ctx: Context) -> list[dict]:
    """zuko's and nflows' MAF (784 features, 3 layers, random weights), 100 samples by the
    library's own ``sample`` as shipped and inside :func:`paraprop.flows.accelerate` (tol 0:
    bitwise the library's result)."""
    from paraprop.flows import accelerate

    d, n = ctx.pick((16, 10), (784, 100))

    def zuko_maf():
        import zuko

        return zuko.flows.MAF(d, transforms=3)

    def nflows_maf():
        from nflows.flows import MaskedAutoregressiveFlow

        return MaskedAutoregressiveFlow(d, 64, num_layers=3, num_blocks_per_layer=2).eval()

    out = []
    for label, build, call in (("zuko", zuko_maf, lambda f: f().sample((n,))),
                               ("nflows", nflows_maf, lambda f: f.sample(n))):
        torch.manual_seed(0)
        flow = build().to(ctx.device)

        def library(flow=flow, call=call):
            torch.manual_seed(1)
            return call(flow)

        def accelerated(flow=flow, library=library):
            with accelerate(flow):
                return library()

        with torch.no_grad():
            times = ctx.time({"library": library, "accelerated": accelerated},
                             repeats=ctx.rounds(5), desc=f"{label} MAF")
            want = library()
            with accelerate(flow) as handle:
                got = library()
        out.append(row("flows", f"{label}_maf.sample", what=f"{label} MAF sampling: the "
                       "library's own vs paraprop.flows.accelerate", shape=f"{d} features, 3 "
                       f"layers, {n} samples", baseline="the library's sample",
                       baseline_s=times["library"], method="accelerate(flow), tol 0",
                       method_s=times["accelerated"], max_dev=max_abs(got, want), bound=0.0,
                       library_passes=handle.library_passes, passes=handle.passes))
    return out


# -- triangular: back-propagation as a block bi-diagonal system (Naumov 2017) ------------------
def triangular_rows(ctx: Context) -> list[dict]:
    """The backward pass of deep narrow tanh MLPs by cyclic reduction
    (:func:`paraprop.linalg.mlp_backward`) against autograd's backward of the same pass."""
    from paraprop.linalg import activation_points, mlp_backward
    from paraprop.models import deep_mlp

    out = []
    for depth, width, batch in ctx.pick([(32, 8, 2)], [(1024, 16, 16), (4096, 16, 16)]):
        net = deep_mlp(depth, width).to(ctx.device)
        params = list(net.parameters())
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, width, generator=g).to(ctx.device)
        gy = torch.randn(batch, width, generator=g).to(ctx.device)
        xg = x.clone().requires_grad_()
        y = net(xg)
        pts = activation_points(net, x)
        runs = {"autograd": lambda y=y, xg=xg, gy=gy, params=params: torch.autograd.grad(
                    y, [xg, *params], gy, retain_graph=True),
                "cr": lambda net=net, x=x, gy=gy, pts=pts: mlp_backward(net, x, gy, points=pts)}
        times = ctx.time(runs, repeats=ctx.rounds(5), desc=f"mlp backward l={depth}")
        want = runs["autograd"]()
        (gx, gp), _ = runs["cr"]()
        dev = max(max_rel(a, b) for a, b in zip([gx, *gp], want, strict=True))
        out.append(row("triangular", f"mlp_backward.l{depth}", what="an MLP's backward as a "
                       "block bi-diagonal system: cyclic reduction vs autograd",
                       shape=f"depth {depth}, width {width}, batch {batch}, float32",
                       baseline="autograd backward", baseline_s=times["autograd"],
                       method="cyclic reduction", method_s=times["cr"], max_dev=dev, bound=None,
                       note="deviation: largest relative difference of a gradient (float32)"))
    return out


# -- multigrid: layer-parallel forward of a residual network (Kirby et al. 2020) -------------
def multigrid_rows(ctx: Context) -> list[dict]:
    """A residual tanh MLP (width 16, depth 1024 and 4096, batch 32): the serial forward against
    MGRIT (3 levels, c = 4, FCF, batched relaxation) run to its tolerance."""
    from paraprop.models.blocks import mlp_blocks
    from paraprop.multigrid import ParallelResidualStack

    out = []
    for depth in ctx.pick([64], [1024, 4096]):
        blocks = mlp_blocks(depth, 16, kind="iid", seed=0, fast=True)
        net = ParallelResidualStack(blocks, 1.0 / depth, levels=3).to(ctx.device)
        x = torch.randn(ctx.pick(4, 32), 16, generator=torch.Generator().manual_seed(2))
        x = x.to(ctx.device)
        with torch.no_grad():
            times = ctx.time({"serial": lambda net=net, x=x: net.serial_forward(x),
                              "mgrit": lambda net=net, x=x: net(x)}, repeats=ctx.rounds(3),
                             desc=f"multigrid l={depth}")
            ref, got = net.serial_forward(x), net(x)
        st = net.last_forward
        out.append(row("multigrid", f"mgrit_forward.l{depth}", what="a residual network's "
                       "forward by MGRIT vs the serial forward", shape=f"depth {depth}, width "
                       f"16, batch {x.shape[0]}", baseline="serial forward",
                       baseline_s=times["serial"], method=f"MGRIT, 3 levels, c=4, FCF, tol "
                       f"{net.tol:g}", method_s=times["mgrit"], max_dev=max_abs(got, ref),
                       bound=None, note="tol bounds the MGRIT residual, not the deviation",
                       cycles=st.iterations))
    return out
