"""The Triton kernels compile for the GPU (sm_90: H100 / H200) on this machine, without a GPU.

The interpreter (tests/test_triton.py) accepts code the compiler rejects (a float64 division
intrinsic, a dtype branch, a standard-library function decorated in the other mode), and a GPU
is at hand only rarely, so every kernel family is compiled here down to a cubin with triton's
own ptxas, with the specialisation the JIT gives real arguments (pointers and sizes divisible by
16, strides of 1 folded). The main diagonal kernel must also load and store with 16-byte
vector instructions (coalesced, what its bandwidth target needs) and keep no local memory.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

from paraprop.scan import triton_kernels as tk  # noqa: E402
from paraprop.scan import triton_runtime as rt  # noqa: E402

if "nvidia" not in getattr(triton.backends, "backends", {}):
    pytest.skip("triton has no NVIDIA backend here", allow_module_level=True)

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
         torch.float64: "fp64"}


def compile_for_sm90(kernel, args, meta):
    """``kernel`` (a compiled-mode JITFunction) specialised like the JIT does for ``args``."""
    sig, const, attrs = {}, {}, {}
    values = dict(zip(kernel.arg_names, args, strict=False))
    values.update({k: v for k, v in meta.items() if k in kernel.arg_names})
    params = {p.name: p for p in kernel.params}
    for i, name in enumerate(kernel.arg_names):
        v = values[name]
        if params[name].is_constexpr or v is None or (type(v) is int and v == 1):
            sig[name], const[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name], attrs[(i,)] = "*" + TYPES[v.dtype], [["tt.divisibility", 16]]
        else:
            sig[name] = "i32" if abs(v) < 2 ** 31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = compiler.ASTSource(kernel, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=backends.GPUTarget("cuda", 90, 32),
                          options={"num_warps": meta.get("num_warps", 4)})


class Recorder:
    """A kernel module whose launches are recorded, not run: ``kernel[grid](*args, **meta)``
    appends ``(kernel, args, meta)`` to ``calls`` and ``(kernel name, grid)`` to ``grids``."""

    def __init__(self, module, calls, grids):
        self.module, self.calls, self.grids = module, calls, grids

    def __getattr__(self, name):
        attr = getattr(self.module, name)
        if name == "tl":
            return attr
        calls, grids = self.calls, self.grids

        class Grid:
            def __getitem__(self, grid):
                grids.append((name, tuple(grid)))
                return lambda *args, **meta: calls.append((attr, args, meta))
        return Grid()


@pytest.fixture
def recorded(monkeypatch):
    """The host code's launches, on ``meta`` tensors (any size, no memory), recorded with the
    compiled-mode kernels: ``(calls, grids)``."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls, grids = [], []
    real = rt.load
    monkeypatch.setattr(rt, "load", lambda source, device: Recorder(
        real(source, torch.device("cuda")), calls, grids))
    return calls, grids


@pytest.fixture
def launches(recorded):
    return recorded[0]


def compile_all(calls):
    out = []
    for kernel, args, meta in calls:
        out.append((kernel.fn.__name__, meta.get("PASS"),
                    compile_for_sm90(kernel, list(args), meta).asm["ptx"]))
    assert out
    return out


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("reverse, chunks", [(False, None), (True, 4)])
def test_the_diagonal_scan_at_the_target_shape_compiles_vectorised(launches, reverse, chunks):
    """``(B, D, T) = (8, 1536, 65536)`` time contiguous, as :func:`diagonal_scan` views it."""
    N, T = 8 * 1536, 65536
    a, b, out = meta(N, T, 1), meta(N, T, 1), meta(N, T, 1)
    tk.diag_launch(a, b, out, None, reverse, chunks=chunks)
    for name, pass_, ptx in compile_all(launches):
        if name == "diag_scan":
            assert "ld.global.v4" in ptx and ".local" not in ptx, (reverse, pass_)
            assert pass_ == 1 or "st.global.v4" in ptx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_the_scans_compile_in_other_layouts_and_dtypes(launches, dtype):
    B, T, H = 8, 4096, 256                      # (B, T, H): channels contiguous
    x, h0 = meta(B, T, H, dtype=dtype), meta(B, H, dtype=dtype)
    tk.diag_launch(x, x, x, h0, True)
    A, b = meta(B * H, T, 2, 2, dtype=dtype), meta(B * H, T, 2, dtype=dtype)
    tk.pair_launch(A, b, b, meta(B * H, 2, dtype=dtype), False, chunks=3)
    compile_all(launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_dense_scan_compiles_with_its_matrix_products(launches, dtype):
    """In chunks: the chunks' products by ``tl.dot`` (IEEE float32, or float64)."""
    N, T, H = 16, 1000, 20
    A = meta(N, T, H, H, dtype=dtype).transpose(-1, -2)   # a backward pass's transposed steps
    x = meta(N, T, H, dtype=dtype)
    tk.dense_launch(A, x, x, meta(N, H, dtype=dtype), True, chunks=3)
    assert {name for name, _, _ in compile_all(launches)} == {"dense_scan", "dense_carries"}


def test_no_grid_axis_past_cudas_limits(recorded):
    """CUDA allows 65535 programs along grid axes 1 and 2 (``2^31 - 1`` along axis 0): many
    rows (``(16, 4096, T)`` with ``dim=-1``: 65536 rows) and many chunks stay within them."""
    from paraprop.nn import triton_cells

    calls, grids = recorded
    N, T = 16 * 4096, 1 << 12
    x = meta(N, T, 1)
    for chunks in (None, 3):
        tk.diag_launch(x, x, x, meta(N, 1), False, chunks=chunks)       # (16, 4096, T), dim=-1
    xt = meta(8, 1 << 27, 1)                                            # 65536 blocks of time
    tk.diag_launch(xt, xt, xt, None, True, chunks=70000)
    p = meta(N, 64, 2)
    tk.pair_launch(meta(N, 64, 2, 2), p, p, None, False, chunks=3)
    d = meta(N, 40, 3)
    tk.dense_launch(meta(1, 40, 3, 3).expand(N, 40, 3, 3), d, d, None, False, chunks=3)
    tk.dense_launch(meta(2, 1 << 17, 3, 3), meta(2, 1 << 17, 3), meta(2, 1 << 17, 3), None,
                    False, chunks=70000)
    g = meta(N, 64, 4)
    triton_cells.gru_newton_step(meta(N, 64, 3, 4), g, meta(N, 4), meta(3, 4), None, 0, g, g,
                                 chunks=3)
    s = meta(N, 64, 2)
    triton_cells.lstm_newton_step(meta(4, N // 4, 4, 64), s, meta(N, 2), meta(4, 4), 0, s, s,
                                  chunks=3)
    names = {name for name, _ in grids}
    assert {"diag_scan", "diag_carries", "pair_scan", "dense_scan", "gru_step",
            "lstm_step"} <= names
    for name, grid in grids:
        assert grid[0] <= rt.MAX_GRID0, (name, grid)
        assert all(n <= rt.MAX_GRID12 for n in grid[1:]), (name, grid)
    assert max(grid[0] for _, grid in grids) >= N                        # rows on axis 0
    assert max(len(grid) > 1 and grid[1] for _, grid in grids) >= 1 << 15    # many chunks


@pytest.mark.parametrize("dtype, chunks", [(torch.float32, None), (torch.bfloat16, 3),
                                           (torch.float64, None)])
def test_the_fused_newton_steps_compile(launches, dtype, chunks):
    from paraprop.nn import triton_cells

    B, T, H = 8, 65536, 256
    x = meta(B, T, H, dtype=dtype)
    triton_cells.gru_newton_step(meta(B, T, 3, H, dtype=dtype), x, meta(B, H, dtype=dtype),
                                 meta(3, H, dtype=dtype), meta(3, H, dtype=dtype), 5, x, x,
                                 chunks=chunks)
    s = meta(B * H, T, 2, dtype=dtype)
    triton_cells.lstm_newton_step(meta(4, B, H, T, dtype=dtype), s, meta(B * H, 2, dtype=dtype),
                                  meta(4, H, dtype=dtype), 0, s, s, chunks=chunks)
    for name, pass_, ptx in compile_all(launches):
        assert ".local" not in ptx, (name, pass_)
