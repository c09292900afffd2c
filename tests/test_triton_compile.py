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
    appends ``(kernel, args, meta)``."""

    def __init__(self, module, calls):
        self.module, self.calls = module, calls

    def __getattr__(self, name):
        attr = getattr(self.module, name)
        if name == "tl":
            return attr
        calls = self.calls

        class Grid:
            def __getitem__(self, grid):
                return lambda *args, **meta: calls.append((attr, args, meta))
        return Grid()


@pytest.fixture
def launches(monkeypatch):
    """The host code's launches, on ``meta`` tensors (any size, no memory), recorded with the
    compiled-mode kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real = tk.load
    monkeypatch.setattr(tk, "load", lambda source, device: Recorder(
        real(source, torch.device("cuda")), calls))
    return calls


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


def test_the_dense_scan_compiles_with_its_matrix_products(launches):
    N, T, H = 16, 1000, 20
    A = meta(N, T, H, H).transpose(-1, -2)      # the transposed steps of a backward pass
    tk.dense_launch(A, meta(N, T, H), meta(N, T, H), meta(N, H), True, chunks=3)
    assert {name for name, _, _ in compile_all(launches)} == {"dense_scan", "dense_carries"}


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
