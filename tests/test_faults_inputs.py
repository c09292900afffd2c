"""Bad inputs fail at the entry point with an error naming the argument and the expected and
actual dtype, shape, device or value (issue 15, item 4): flow inverses, Recurrence, the models'
constructors and checkpoints, the MNIST reader. The command line is in test_cli.py."""

import numpy as np
import pytest
import torch
import zuko

import paraprop
from paraprop.data import IDXError, load_mnist
from paraprop.flows import parallel_inverse
from paraprop.models import MADE, MaskedLinear, PixelCNN

F32, F64 = torch.float32, torch.float64


# -- parallel_inverse: zuko ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def maf():
    torch.manual_seed(0)
    return zuko.flows.MAF(5, transforms=2)


@pytest.fixture(scope="module")
def cmaf():
    torch.manual_seed(1)
    return zuko.flows.MAF(5, context=3, transforms=2)


def test_zuko_flow_is_accepted_as_its_transform(maf, cmaf):
    y = torch.randn(6, 5)
    with torch.no_grad():
        expected = maf().transform.inv(y)
    x, sol = parallel_inverse(maf, y)
    assert torch.equal(x, expected) and len(sol.stats["parts"]) == 2
    # a lazy transform too, and a conditional flow with its context: flow(context).transform
    assert torch.equal(parallel_inverse(maf.transform, y)[0], expected)
    c = torch.randn(6, 3)
    with torch.no_grad():
        expected = cmaf(c).transform.inv(y)
    assert torch.equal(parallel_inverse(cmaf, y, context=c)[0], expected)
    assert torch.equal(parallel_inverse(cmaf(c).transform, y)[0], expected)
    assert torch.equal(parallel_inverse(cmaf(c), y)[0], expected)   # a NormalizingFlow


@pytest.mark.parametrize("make,exc,match", [
    (lambda f, cf: (f, torch.randn(4, 5, dtype=F64), None), TypeError,
     r"y must have the dtype of the flow's parameters, torch.float32, got torch.float64"),
    (lambda f, cf: (f().transform, torch.randn(4, 5, dtype=F64), None), TypeError,
     r"y must have the dtype of the flow's parameters, torch.float32, got torch.float64"),
    (lambda f, cf: (f().transform, torch.ones(4, 5, dtype=torch.long), None), TypeError,
     r"y must have a floating-point dtype, got torch.int64"),
    (lambda f, cf: (f().transform, torch.randn(4, 6), None), ValueError,
     r"y must have shape \(N, 5\) \(5 features, as the flow\), got \(4, 6\)"),
    (lambda f, cf: (f().transform, torch.randn(4, 5), torch.randn(4, 3)), ValueError,
     r"context must be None with a zuko transform, which is already bound to its context: "
     r"pass the flow itself with context=\.\.\., or flow\(context\)\.transform without it "
     r"\(got context of shape \(4, 3\)\)"),
    (lambda f, cf: (f, torch.randn(4, 5), torch.randn(4, 3)), ValueError,
     r"context must be None: the flow takes no context, got context of shape \(4, 3\)"),
    (lambda f, cf: (cf, torch.randn(4, 5), None), ValueError,
     r"context is needed: the flow takes 3 context features"),
    (lambda f, cf: (cf(), torch.randn(4, 5), None), ValueError,
     r"context is needed: the flow takes 3 context features"),
    (lambda f, cf: (cf, torch.randn(4, 5), torch.randn(4, 2)), ValueError,
     r"context must have shape \(N, 3\) \(3 context features of the flow\), got \(4, 2\)"),
    (lambda f, cf: (cf, torch.randn(4, 5), torch.randn(3, 3)), ValueError,
     r"context must have shape \(N, 3\) with N = 4 \(the rows of y\) or 1, got \(3, 3\)"),
    (lambda f, cf: (cf(torch.randn(3, 3)).transform, torch.randn(4, 5), None), ValueError,
     r"context must have shape \(N, 3\) with N = 4 \(the rows of y\) or 1, got \(3, 3\)"),
    (lambda f, cf: (cf, torch.randn(4, 5), torch.randn(4, 3, dtype=F64)), TypeError,
     r"context must have the dtype of the flow's parameters, torch.float32, got torch.float64"),
    (lambda f, cf: (cf(torch.randn(4, 3, dtype=F64)).transform, torch.randn(4, 5), None),
     TypeError,
     r"context must have the dtype of the flow's parameters, torch.float32, got torch.float64"),
    (lambda f, cf: (f, torch.randn(4, 5), [1.0, 2.0]), TypeError,
     r"context must be a torch.Tensor or None, got list"),
    (lambda f, cf: (zuko.flows.GMM(5), torch.randn(4, 5), None), TypeError,
     r"transform must be a zuko Flow, lazy transform or transform, got the distribution GMM"),
])
def test_zuko_inverse_refuses(maf, cmaf, make, exc, match):
    t, y, c = make(maf, cmaf)
    with pytest.raises(exc, match=match):
        parallel_inverse(t, y, context=c)


def test_zuko_inverse_refuses_another_device(maf):
    # only a CPU here: parameters on the meta device stand for another device
    flow = zuko.flows.MAF(5, transforms=1).to("meta")
    with pytest.raises(ValueError, match=r"y must be on the device of the flow's parameters, "
                                         r"meta, got cpu"):
        parallel_inverse(flow, torch.randn(4, 5))


# -- parallel_inverse: nflows -------------------------------------------------------------------
@pytest.fixture(scope="module")
def nf():
    from nflows.transforms import (
        CompositeTransform,
        MaskedAffineAutoregressiveTransform,
        RandomPermutation,
    )

    torch.manual_seed(2)
    cond = CompositeTransform([MaskedAffineAutoregressiveTransform(5, 16, context_features=3),
                               RandomPermutation(5)]).eval()
    plain = MaskedAffineAutoregressiveTransform(5, 16).eval()
    return cond, plain


def test_nflows_flow_is_accepted_as_its_transform(nf):
    from nflows.distributions import StandardNormal
    from nflows.flows import Flow

    cond, _ = nf
    embed = torch.nn.Linear(2, 3)
    flow = Flow(cond, StandardNormal([5]), embedding_net=embed).eval()
    y, c = torch.randn(6, 5), torch.randn(6, 2)
    with torch.no_grad():
        expected = cond.inverse(y, embed(c))[0]
    assert torch.equal(parallel_inverse(flow, y, context=c)[0], expected)


@pytest.mark.parametrize("make,exc,match", [
    (lambda c, p: (c, torch.randn(4, 5, dtype=F64), torch.randn(4, 3)), TypeError,
     r"y must have the dtype of the transform's parameters, torch.float32, got torch.float64"),
    (lambda c, p: (c, torch.randn(4, 5), torch.randn(4, 3, dtype=F64)), TypeError,
     r"context must have the dtype of the transform's parameters, torch.float32, "
     r"got torch.float64"),
    (lambda c, p: (c, torch.randn(4, 6), torch.randn(4, 3)), ValueError,
     r"y must have shape \(N, 5\) \(5 features, as the transform\), got \(4, 6\)"),
    (lambda c, p: (c, torch.randn(4, 5), torch.randn(4, 2)), ValueError,
     r"context must have shape \(4, 3\) \(the rows of y, the context features of "
     r"MaskedAffineAutoregressiveTransform\), got \(4, 2\)"),
    (lambda c, p: (c, torch.randn(4, 5), torch.randn(3, 3)), ValueError,
     r"context must have shape \(4, 3\) .*got \(3, 3\)"),
    (lambda c, p: (c, torch.randn(4, 5), torch.randn(3)), ValueError,
     r"context must have shape \(4, 3\) .*got \(3,\)"),
    (lambda c, p: (c, torch.randn(4, 5), None), ValueError,
     r"context is needed: MaskedAffineAutoregressiveTransform takes 3 context features; pass "
     r"context of shape \(4, 3\)"),
    (lambda c, p: (p, torch.randn(4, 5), torch.randn(4, 3)), ValueError,
     r"context must be None: MaskedAffineAutoregressiveTransform was built without "
     r"context_features, got context of shape \(4, 3\)"),
    (lambda c, p: (p, torch.randn(4, 5), "c"), TypeError,
     r"context must be a torch.Tensor or None, got str"),
])
def test_nflows_inverse_refuses(nf, make, exc, match):
    t, y, c = make(*nf)
    with pytest.raises(exc, match=match):
        parallel_inverse(t, y, context=c)


def test_nflows_inverse_refuses_another_device(nf):
    _, plain = nf
    with pytest.raises(ValueError, match=r"y must be on the device of the transform's "
                                         r"parameters, cpu, got meta"):
        parallel_inverse(plain, torch.randn(4, 5, device="meta"))


# -- Recurrence ---------------------------------------------------------------------------------
def _z(*shape, dtype=F64, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


class _ModuleCell(torch.nn.Module):
    hidden_size = 4

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, u, h):
        return torch.tanh(self.lin(h))


@pytest.mark.parametrize("make,exc,match", [
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4), _z(2, 5, 3)), TypeError,
     r"inputs must have the dtype of the cell's parameters, torch.float32, got torch.float64"),
    (lambda: paraprop.Recurrence(torch.nn.RNNCell(3, 4), _z(2, 5, 3), _z(2, 4)), TypeError,
     r"inputs must have the dtype of the cell's parameters, torch.float32, got torch.float64"),
    (lambda: paraprop.Recurrence(torch.nn.LSTMCell(3, 4), _z(2, 5, 3)), TypeError,
     r"inputs must have the dtype of the cell's parameters, torch.float32, got torch.float64"),
    (lambda: paraprop.Recurrence(_ModuleCell(), _z(2, 5, 3)), TypeError,
     r"inputs must have the dtype of the cell's parameters, torch.float32, got torch.float64"),
    (lambda: paraprop.Recurrence(_ModuleCell(), None, _z(2, 4), length=5), TypeError,
     r"h0 must have the dtype of the cell's parameters, torch.float32, got torch.float64"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=F64), _z(2, 5, 3, dtype=F32),
                                 _z(2, 4, dtype=F32)), TypeError,
     r"inputs must have the dtype of the cell's parameters, torch.float64, got torch.float32"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=F64), _z(2, 5, 6)), ValueError,
     r"inputs must have 3 features \(the cell's input_size\), got shape \(2, 5, 6\)"),
    (lambda: paraprop.Recurrence(torch.nn.LSTMCell(3, 4, dtype=F64), _z(5, 2)), ValueError,
     r"inputs must have 3 features \(the cell's input_size\), got shape \(5, 2\)"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=F64), _z(2, 5, 3), _z(2, 5)),
     ValueError, r"h0 has 5 features but the cell's state has 4"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=F64), _z(2, 5, 3), _z(3, 4)),
     ValueError, r"h0 must have shape \(\*batch, H\) with batch \(2,\), got \(3, 4\)"),
    # devices: only a CPU here; the meta device stands for another one
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=F64, device="meta"),
                                 _z(2, 5, 3)), ValueError,
     r"inputs must be on the device of the cell's parameters, meta, got cpu"),
    (lambda: paraprop.Recurrence(_ModuleCell().to("meta"), None, _z(2, 4, dtype=F32),
                                 length=3), ValueError,
     r"h0 must be on the device of the cell's parameters, meta, got cpu"),
    (lambda: paraprop.Recurrence(torch.nn.GRUCell(3, 4, dtype=F64), _z(2, 5, 3),
                                 _z(2, 4, device="meta")), ValueError,
     r"h0 \(torch.float64, meta\) must match inputs \(torch.float64, cpu\)"),
])
def test_recurrence_refuses(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_recurrence_paraprop_nn_cells_are_checked_too():
    from paraprop.jacobians.linearized import GRUCellJacobian

    gru = torch.nn.GRUCell(3, 4)
    cell = GRUCellJacobian(gru.weight_ih, gru.weight_hh, gru.bias_ih, gru.bias_hh)
    with pytest.raises(TypeError, match=r"inputs must have the dtype of the cell's parameters, "
                                        r"torch.float32, got torch.float64"):
        paraprop.Recurrence(cell, _z(2, 5, 3))
    with pytest.raises(ValueError, match=r"inputs must have 3 features"):
        paraprop.Recurrence(cell, _z(2, 5, 2, dtype=F32))


# -- model constructors -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"levels": 1}, r"levels must be >= 2 \(the discrete pixel values\), got 1"),
    ({"levels": 0}, r"levels must be a positive int, got 0"),
    ({"levels": 2.0}, r"levels must be a positive int, got 2.0"),
    ({"hidden": "8"}, r"hidden must be a positive int, got '8'"),
    ({"image_size": -3}, r"image_size must be a positive int, got -3"),
    ({"kernel": 1}, r"kernel must be odd and >= 3, got 1"),
    ({"kernel": 3.0}, r"kernel must be odd and >= 3, got 3.0"),
    ({"seed": "a"}, r"seed must be an int >= 0, got 'a'"),
    ({"seed": -1}, r"seed must be an int >= 0, got -1"),
    ({"seed": None}, r"seed must be an int >= 0, got None"),
])
def test_pixelcnn_constructor_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PixelCNN(**kwargs)


@pytest.mark.parametrize("args,kwargs,match", [
    ((0,), {}, r"features must be a positive int, got 0"),
    ((4.0,), {}, r"features must be a positive int, got 4.0"),
    ((4, 8), {}, r"hidden must be a non-empty tuple of positive ints, got 8"),
    ((4, ()), {}, r"hidden must be a non-empty tuple of positive ints, got \(\)"),
    ((4, (True,)), {}, r"hidden must be a non-empty tuple of positive ints, got \(True,\)"),
    ((4, "ab"), {}, r"hidden must be a non-empty tuple of positive ints, got 'ab'"),
    ((4, (8,)), {"conditional": ["logistic"]},
     r"unknown conditional=\['logistic'\]; choose one of logistic, gaussian, bernoulli"),
    ((3, (8,)), {"order": [0.5, 1, 2]},
     r"order must be a permutation of 0..2 \(ints\), got \[0.5, 1, 2\]"),
    ((3, (8,)), {"order": torch.tensor([0.0, 1.0, 2.0])},
     r"order must be a permutation of 0..2 \(ints\), got tensor"),
    ((3, (8,)), {"order": "abc"}, r"order must be a permutation of 0..2 \(ints\), got 'abc'"),
    ((3, (8,)), {"order": 3}, r"order must be a permutation of 0..2 \(ints\), got 3"),
    ((3, (8,)), {"order": [0, 1, 1]}, r"order must be a permutation of 0..2, got \[0, 1, 1\]"),
    ((3, (8,)), {"seed": "x"}, r"seed must be an int >= 0, got 'x'"),
    ((3, (8,)), {"seed": -1}, r"seed must be an int >= 0, got -1"),
])
def test_made_constructor_refuses(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        MADE(*args, **kwargs)


def test_made_accepts_list_hidden_and_tensor_order():
    m = MADE(3, [8, 8], order=torch.tensor([2, 0, 1]))
    assert m.config["hidden"] == [8, 8] and m.config["order"] == [2, 0, 1]


def test_masked_linear_refuses_a_mask_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"mask must have shape \(out_features, in_features\) "
                                         r"= \(4, 3\), got \(3, 4\)"):
        MaskedLinear(3, 4, torch.ones(3, 4))


# -- checkpoints --------------------------------------------------------------------------------
@pytest.fixture(params=["MADE", "PixelCNN"])
def model_cls(request):
    return {"MADE": MADE, "PixelCNN": PixelCNN}[request.param]


def test_load_missing_garbage_and_foreign_files(tmp_path, model_cls):
    kind = model_cls.__name__
    with pytest.raises(FileNotFoundError, match=rf"nope.pt: no such file \(expected a paraprop "
                                                rf"{kind} checkpoint\)"):
        model_cls.load(tmp_path / "nope.pt")
    with pytest.raises(ValueError, match=rf"{tmp_path.name}: is a directory, not a paraprop "
                                         rf"{kind} checkpoint"):
        model_cls.load(tmp_path)
    (tmp_path / "garbage.pt").write_bytes(b"hello, this is not a checkpoint")
    with pytest.raises(ValueError, match=rf"garbage.pt: cannot be read as a paraprop {kind} "
                                         r"checkpoint: it is a text file \(it starts with "
                                         r"'hello, this is not a checkpoint'\) \(31 bytes\)"):
        model_cls.load(tmp_path / "garbage.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"empty.pt: cannot be read as a paraprop {kind} "
                                         r"checkpoint: it is empty \(0 bytes\)"):
        model_cls.load(tmp_path / "empty.pt")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(ValueError, match=rf"tensor.pt: not a paraprop {kind} checkpoint \(it "
                                         r"holds a Tensor without a model kind\)"):
        model_cls.load(tmp_path / "tensor.pt")
    torch.save({"kind": kind, "config": {}}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=rf"partial.pt: not a paraprop {kind} checkpoint "
                                         r"\(config or state_dict missing\)"):
        model_cls.load(tmp_path / "partial.pt")


def test_load_a_checkpoint_of_the_other_model(tmp_path):
    MADE(4, (8,)).save(tmp_path / "made.pt")
    PixelCNN(1, 4, hidden=4, layers=1, mixtures=1, levels=4).save(tmp_path / "pix.pt")
    with pytest.raises(ValueError, match=r"made.pt: not a paraprop PixelCNN checkpoint \(it "
                                         r"holds a MADE checkpoint\)"):
        PixelCNN.load(tmp_path / "made.pt")
    with pytest.raises(ValueError, match=r"pix.pt: not a paraprop MADE checkpoint \(it holds a "
                                         r"PixelCNN checkpoint\)"):
        MADE.load(tmp_path / "pix.pt")
    assert MADE.load(tmp_path / "made.pt").features == 4
    assert PixelCNN.load(tmp_path / "pix.pt").levels == 4


def test_load_a_bad_config_or_weights(tmp_path):
    torch.save({"kind": "PixelCNN", "config": {"levels": 1}, "state_dict": {}},
               tmp_path / "cfg.pt")
    with pytest.raises(ValueError, match=r"cfg.pt: bad PixelCNN config in the checkpoint: "
                                         r"levels must be >= 2 \(the discrete pixel values\), "
                                         r"got 1"):
        PixelCNN.load(tmp_path / "cfg.pt")
    torch.save({"kind": "MADE", "config": MADE(4, (8,)).config,
                "state_dict": MADE(5, (8,)).state_dict()}, tmp_path / "w.pt")
    with pytest.raises(ValueError, match=r"w.pt: the weights do not fit the MADE config: size "
                                         r"mismatch for .* \(and \d+ more\)"):
        MADE.load(tmp_path / "w.pt")


# -- MNIST --------------------------------------------------------------------------------------
def _write_idx(path, shape, code=0x08):
    header = bytes([0, 0, code, len(shape)]) + b"".join(int(n).to_bytes(4, "big") for n in shape)
    path.write_bytes(header + bytes(int(np.prod(shape))))


@pytest.mark.parametrize("shape,match", [
    ((0, 28, 28), r"t10k-images-idx3-ubyte: the header announces 0 images; expected at least 1"),
    ((3, 0, 28), r"t10k-images-idx3-ubyte: the header announces images of 0 x 28 pixels "
                 r"\(rows x cols\)"),
    ((3, 28, 0), r"t10k-images-idx3-ubyte: the header announces images of 28 x 0 pixels"),
])
def test_mnist_header_with_zero_images_rows_or_cols(tmp_path, shape, match):
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", shape)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", (shape[0],))
    with pytest.raises(IDXError, match=match):
        load_mnist(tmp_path)


def test_mnist_missing_directory_and_bad_split(tmp_path):
    with pytest.raises(IDXError, match=r"nowhere: no such MNIST directory \(from mnist_dir\)"):
        load_mnist(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"unknown split=\['test'\]; choose 'test' or 'train'"):
        load_mnist(tmp_path, split=["test"])
