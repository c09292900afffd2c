"""paraprop.determinism: the one train-mode check of every entry point that calls a user's
module (issue 27, stochastic models)."""

import re

import pytest
import torch
from torch import nn

import paraprop
from paraprop.determinism import own_part, require_deterministic, stochastic_parts


class FunctionalDropout(nn.Module):
    """Dropout applied through an attribute, as transformers' attention classes do."""

    def __init__(self, p):
        super().__init__()
        self.attention_dropout = p
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return nn.functional.dropout(self.lin(x), self.attention_dropout, self.training)


class RouterJitter(nn.Module):
    """Multiplicative router noise in train mode, as Mixtral's sparse block applies it."""

    def __init__(self, jitter):
        super().__init__()
        self.jitter_noise = jitter
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1 - self.jitter_noise, 1 + self.jitter_noise)
        return self.lin(x)


@pytest.mark.parametrize("make, layer", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), "'1' (Dropout)"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.AlphaDropout(0.3)), "'1' (AlphaDropout)"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.RReLU()), "'1' (RReLU)"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), "'1' (BatchNorm1d)"),
    (lambda: nn.Sequential(nn.Linear(4, 4), FunctionalDropout(0.2)),
     "'1' (FunctionalDropout) applies dropout in train mode (attention_dropout=0.2)"),
    (lambda: nn.LSTM(4, 4, num_layers=2, dropout=0.5), "LSTM"),
    (lambda: nn.Sequential(nn.Linear(4, 4), RouterJitter(0.3)),
     "'1' (RouterJitter) draws random numbers in train mode (jitter_noise=0.3)"),
])
def test_stochastic_train_mode_modules_are_refused_and_eval_accepted(make, layer):
    m = make()
    # the refused module really is stochastic (or batch-dependent) in train mode
    x = torch.randn(8, 4) if not isinstance(m, nn.LSTM) else torch.randn(5, 8, 4)
    out = lambda: m(x)[0] if isinstance(m, nn.LSTM) else m(x)   # noqa: E731
    if not isinstance(m[-1] if isinstance(m, nn.Sequential) else m, nn.BatchNorm1d):
        torch.manual_seed(0)
        a = out()
        b = out()
        assert not torch.equal(a, b)
    with pytest.raises(paraprop.StochasticModelError, match=rf"decoding.generate: net .*"
                                                            rf"{re.escape(layer)}.*call "
                                                            r"net.eval\(\)"):
        require_deterministic(m, argument="net", entry="decoding.generate")
    require_deterministic(m.eval(), argument="net")       # eval mode: accepted
    assert stochastic_parts(m) == []


def test_inactive_layers_and_non_modules_pass():
    require_deterministic(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))   # p = 0
    require_deterministic(nn.InstanceNorm1d(4))          # per-sample statistics only
    require_deterministic(lambda x: x)                   # not a module: the solvers verify
    assert own_part(nn.Linear(2, 2)) is None
    # norms=False: only the layers that draw random numbers
    bn = nn.Sequential(nn.BatchNorm1d(2))
    assert stochastic_parts(bn, norms=False) == []
    assert [p[1] for p in stochastic_parts(bn)] == ["BatchNorm1d"]


def test_the_module_itself_and_a_bound_method_are_named():
    d = nn.Dropout(0.2)
    with pytest.raises(ValueError, match=r"model \(Dropout\) is in train mode and draws random "
                                         r"numbers at every call p=0.2"):
        require_deterministic(d)
    seq = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Dropout(0.5))
    with pytest.raises(ValueError, match=r"its layer '1' \(Dropout\).*\(and 1 more such "
                                         r"layers\)"):
        require_deterministic(seq.forward)                # a bound method counts as its module


def test_transformers_router_jitter_is_refused():
    """Mixtral's sparse block keeps config.router_jitter_noise as `jitter_noise`, PhiMoE as
    `router_jitter_noise` and `input_jitter_noise`: train-mode noise, refused up front."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    kw = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
              num_experts_per_tok=1, router_jitter_noise=0.2)
    for config, model, attr in (
            (transformers.MixtralConfig, transformers.MixtralForCausalLM, "jitter_noise=0.2"),
            (transformers.PhimoeConfig, transformers.PhimoeForCausalLM,
             "router_jitter_noise=0.2")):
        m = model(config(**kw)).train()
        with pytest.raises(paraprop.StochasticModelError, match=rf"\({attr}\).*call "
                                                                r"model.eval\(\)"):
            require_deterministic(m)
        require_deterministic(m.eval())


def test_noise_amplitudes_of_any_size_are_refused_as_random_draws():
    class Router(nn.Module):
        def __init__(self, amplitude):
            super().__init__()
            self.jitter_noise = amplitude      # a noise amplitude, not a probability

    for amplitude in (0.01, 1.0, 2.5):
        with pytest.raises(ValueError, match=rf"draws random numbers in train mode "
                                             rf"\(jitter_noise={amplitude}\)"):
            require_deterministic(Router(amplitude))
    require_deterministic(Router(0.0))
    require_deterministic(Router(2.5).eval())
