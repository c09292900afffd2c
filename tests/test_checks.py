"""The shared argument checks (paraprop.checks): what each accepts and the message it raises."""

import math

import pytest
import torch

from paraprop import checks


def test_is_int_and_is_number_refuse_bool():
    assert checks.is_int(3) and not checks.is_int(True) and not checks.is_int(3.0)
    assert checks.is_number(3) and checks.is_number(0.5)
    assert not checks.is_number(False) and not checks.is_number("1")


@pytest.mark.parametrize("value,kwargs,match", [
    (0, {}, r"^n must be a positive int, got 0$"),
    (2.0, {}, r"^n must be a positive int, got 2.0$"),
    (True, {}, r"^n must be a positive int, got True$"),
    (None, {}, r"^n must be a positive int, got None$"),
    (0, {"allow_none": True}, r"^n must be a positive int or None, got 0$"),
    (1, {"minimum": 2}, r"^n must be an int >= 2, got 1$"),
    ("3", {"minimum": 2, "allow_none": True}, r"^n must be an int >= 2 or None, got '3'$"),
])
def test_positive_int(value, kwargs, match):
    with pytest.raises(ValueError, match=match):
        checks.positive_int("n", value, **kwargs)


def test_positive_int_returns_the_value():
    assert checks.positive_int("n", 3) == 3
    assert checks.positive_int("n", None, allow_none=True) is None
    assert checks.positive_int("n", 2, minimum=2) == 2


def test_nonneg_int():
    assert checks.nonneg_int("levels", 0) == 0
    assert checks.nonneg_int("levels", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"^levels must be an int >= 0, got -1$"):
        checks.nonneg_int("levels", -1)
    with pytest.raises(ValueError, match=r"^levels must be an int >= 0 or None, got 1.5$"):
        checks.nonneg_int("levels", 1.5, allow_none=True)


@pytest.mark.parametrize("value,kwargs,match", [
    (-1, {}, r"^tol must be a number >= 0, got -1$"),
    (float("nan"), {}, r"^tol must be a number >= 0, got nan$"),
    ("1e-5", {}, r"^tol must be a number >= 0, got '1e-5'$"),
    (False, {}, r"^tol must be a number >= 0, got False$"),
    (-1.0, {"allow_none": True}, r"^tol must be a number >= 0 or None, got -1.0$"),
    (math.inf, {"finite": True}, r"^tol must be a finite number >= 0, got inf$"),
])
def test_nonneg_number(value, kwargs, match):
    with pytest.raises(ValueError, match=match):
        checks.nonneg_number("tol", value, **kwargs)


def test_nonneg_number_returns_the_value():
    assert checks.nonneg_number("tol", 0) == 0
    assert checks.nonneg_number("tol", math.inf) == math.inf
    assert checks.nonneg_number("tol", None, allow_none=True) is None


@pytest.mark.parametrize("value,kwargs,match", [
    (0, {}, r"^damping must be a number > 0, got 0$"),
    (-0.5, {}, r"^damping must be a number > 0, got -0.5$"),
    (True, {}, r"^damping must be a number > 0, got True$"),
    (None, {}, r"^damping must be a number > 0, got None$"),
    (0, {"allow_none": True}, r"^damping must be a number > 0 or None, got 0$"),
    (math.inf, {"finite": True}, r"^damping must be a finite number > 0, got inf$"),
    (float("nan"), {"finite": True}, r"^damping must be a finite number > 0, got nan$"),
])
def test_positive_number(value, kwargs, match):
    with pytest.raises(ValueError, match=match):
        checks.positive_number("damping", value, **kwargs)


def test_positive_number_returns_the_value():
    assert checks.positive_number("damping", 0.5) == 0.5
    assert checks.positive_number("damping", math.inf) == math.inf
    assert checks.positive_number("damping", 2, finite=True) == 2


def test_owner_prefix_is_part_of_the_name():
    with pytest.raises(ValueError, match=r"^JacobiGS: block_size must be a positive int or "
                                         r"None, got 0$"):
        checks.positive_int("JacobiGS: block_size", 0, allow_none=True)


def test_boolean():
    assert checks.boolean("throw", False) is False
    assert checks.boolean("native", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"^throw must be a bool, got 1$"):
        checks.boolean("throw", 1)
    with pytest.raises(TypeError, match=r"^throw must be a bool, got None$"):
        checks.boolean("throw", None)
    with pytest.raises(TypeError, match=r"^native must be a bool or None, got 'yes'$"):
        checks.boolean("native", "yes", allow_none=True)


def test_callable_arg():
    assert checks.callable_arg("fn", len) is len
    assert checks.callable_arg("callback", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"^fn must be callable, got int$"):
        checks.callable_arg("fn", 3)
    with pytest.raises(TypeError, match=r"^fn must be callable, got NoneType$"):
        checks.callable_arg("fn", None)
    with pytest.raises(TypeError, match=r"^cost must be callable or None, got str$"):
        checks.callable_arg("cost", "flops", allow_none=True)


def test_one_of():
    assert checks.one_of("method", "a", ("a", "b")) == "a"
    assert checks.one_of("conditional", "x", {"x": 1, "y": 2}) == "x"  # a dict: its keys
    with pytest.raises(ValueError, match=r"^unknown method='x'; choose one of a, b$"):
        checks.one_of("method", "x", ("a", "b"))
    with pytest.raises(ValueError, match=r"^unknown method=\['a'\]; choose one of a, b$"):
        checks.one_of("method", ["a"], ("a", "b"))  # unhashable: refused, not a TypeError
    with pytest.raises(ValueError, match=r"^unknown levels=True; choose one of 1, 2$"):
        checks.one_of("levels", True, (1, 2))
    assert checks.one_of("levels", 2, (1, 2)) == 2


def test_finite_names_the_first_bad_entry():
    t = torch.tensor([[1.0, 2.0], [float("nan"), float("inf")]])
    with pytest.raises(ValueError, match=r"^x must be finite; entry \(1, 0\) of shape \(2, 2\) "
                       r"is nan$"):
        checks.finite("x", t)
    ok = torch.ones(3)
    assert checks.finite("x", ok) is ok


def test_same_kind_names_dtype_then_device():
    ref = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^x has dtype torch.float32 but the model has "
                       r"torch.float64$"):
        checks.same_kind("x", torch.zeros(2), ref, "the model")
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match=r"^x is on cuda:0 but the model is on cpu$"):
            checks.same_kind("x", ref.cuda(), ref, "the model")
    meta = torch.zeros(2, dtype=torch.float64, device="meta")
    with pytest.raises(TypeError, match=r"^x is on meta but the model is on cpu$"):
        checks.same_kind("x", meta, ref, "the model")
    assert checks.same_kind("x", ref, ref, "the model") is ref
