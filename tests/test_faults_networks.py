"""paraprop.networks under real conditions (issue 27): stochastic models refused at conversion
and again at every bind (a model switched to train mode after conversion, a stochastic layer
found by type or by a functional-dropout attribute, a recurrence built by hand), and the
sequential result bitwise in bf16 / fp16 at ``tol=0``, on the device fixture."""

import pytest
import torch
from torch import nn

import paraprop
from paraprop.networks import LayerRecurrence, Step, as_recurrence, evaluate

pytestmark = pytest.mark.usefixtures("one_thread")


class AttentionLike(nn.Module):
    """Functional dropout through an attribute, as transformers' attention classes apply it."""

    def __init__(self, width=8, p=0.1):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.attention_dropout = p

    def forward(self, u):
        return nn.functional.dropout(torch.tanh(self.proj(u)), self.attention_dropout,
                                     self.training)


def net(width=8, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 5))


# -- 1. stochastic models ------------------------------------------------------------------------
@pytest.mark.parametrize("layer,kind,does", [
    (lambda: nn.Dropout(0.2), "Dropout", r"draws random numbers at every call p=0.2"),
    (lambda: nn.RReLU(), "RReLU", r"draws random numbers at every call"),
    (lambda: nn.BatchNorm1d(8), "BatchNorm1d", r"normalises with batch statistics"),
    (lambda: AttentionLike(), "AttentionLike", r"applies dropout in train mode "
                                               r"\(attention_dropout=0.1\)"),
], ids=["dropout", "rrelu", "batchnorm", "attention-dropout"])
def test_stochastic_layers_are_refused_at_conversion(layer, kind, does):
    model = nn.Sequential(nn.Linear(4, 8), layer(), nn.Linear(8, 5))
    with pytest.raises(paraprop.StochasticModelError,
                       match=rf"networks.as_recurrence: model is in train mode, and its layer "
                             rf"'1' \({kind}\) {does}.* call model.eval\(\) first"):
        as_recurrence(model)
    model.eval()
    x = torch.randn(3, 4)
    out, sol = evaluate(model, x, method="jacobi", tol=0, metric="max_abs")
    with torch.no_grad():
        assert torch.equal(out, model(x)) and sol.converged


def test_train_mode_after_conversion_is_refused_at_every_bind():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 5)).eval()
    rec = as_recurrence(model)
    x = torch.randn(3, 4)
    rec.bind(x)
    model.train()                       # switched after conversion
    match = (r"networks.bind: step 0 \('0\.\.2'\) is in train mode, and its layer '2' "
             r"\(Dropout\) draws random numbers .* call model.eval\(\) first")
    with pytest.raises(paraprop.StochasticModelError, match=match):
        rec.bind(x)
    with pytest.raises(paraprop.StochasticModelError, match=match):
        evaluate(rec, x, tol=0, metric="max_abs")
    model[2].p = 0.0                    # an inactive dropout is the identity: accepted
    out, _ = evaluate(rec, x, tol=0, metric="max_abs")
    with torch.no_grad():
        assert torch.equal(out, model(x))


def test_hand_built_recurrence_with_a_stochastic_step_is_refused():
    steps = [Step("lin", nn.Linear(4, 8), (-1,)),
             Step("attn", AttentionLike(), (0,)),
             Step("head", nn.Linear(8, 5), (1,))]
    rec = LayerRecurrence(steps)
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"step 1 \('attn'\) is in train mode, and its module "
                             r"\(AttentionLike\) applies dropout in train mode"):
        rec.bind(torch.randn(2, 4))
    steps[1].module.eval()
    rec.bind(torch.randn(2, 4))


class NoisyLinear(nn.Linear):
    """Gaussian noise from torch.randn_like in training mode: no layer a list could know."""

    def forward(self, u):
        out = super().forward(u)
        return out + 0.1 * torch.randn_like(out) if self.training else out


@pytest.mark.parametrize("method", ["jacobi", "gs_jacobi"])
def test_a_random_operation_in_a_layer_is_named_not_blamed_on_the_map(method):
    steps = [Step("lin", nn.Linear(4, 8), (-1,)),
             Step("noisy", NoisyLinear(8, 8), (0,)),
             Step("head", nn.Linear(8, 5), (1,))]
    rec = LayerRecurrence(steps)
    x = torch.randn(3, 4)
    with pytest.raises(paraprop.StochasticModelError,
                       match=r"networks.evaluate: a layer drew random numbers during the solve "
                             r".*Call model.eval\(\) if it draws only in training mode"):
        evaluate(rec, x, method=method, tol=0, metric="max_abs")
    steps[1].module.eval()
    out, sol = evaluate(rec, x, method=method, tol=0, metric="max_abs")
    assert sol.converged and sol.stats["bitwise_equal"]


# -- 2. the device fixture and low precision: tol=0 is bitwise the sequential network ------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "fp16"])
@pytest.mark.parametrize("method", ["jacobi", "jacobi_gs", "gs_jacobi", "sliding_jacobi"])
def test_tol_zero_is_bitwise_the_network_in_every_dtype(method, dtype, device):
    model = net().eval().to(device, dtype)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    out, sol = evaluate(model, x, method=method, tol=0, metric="max_abs")
    with torch.no_grad():
        ref = model(x)
    assert out.dtype == dtype and torch.equal(out, ref)
    assert sol.converged and sol.stats["bitwise_equal"]
