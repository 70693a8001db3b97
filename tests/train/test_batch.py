"""prepare_batch in one process: containers keep their type, tensors land on the device, only floats are cast."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch

from qaccel import Accelerator
from qaccel.train.batch import prepare_batch

CPU = torch.device("cpu")
Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Inner:
    x: torch.Tensor
    tag: str = "inner"


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    labels: torch.Tensor
    rows: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", len(self.labels))


def test_facade_moves_and_casts_floats_only():
    acc = Accelerator(compute_setup="cpu", dtype=torch.float64)
    out = acc.prepare_batch({"x": torch.ones(2, 3), "y": torch.tensor([0, 1]), "mask": torch.tensor([True, False])})
    assert out["x"].dtype == torch.float64 and out["x"].device == acc.device
    assert out["y"].dtype == torch.int64 and out["y"].tolist() == [0, 1]
    assert out["mask"].dtype == torch.bool and out["mask"].tolist() == [True, False]


def test_the_facade_gives_a_list_batch_back_as_a_tuple_as_qadence_does():
    acc = Accelerator(compute_setup="cpu", dtype=torch.float64)
    x, labels = torch.ones(2, 3), torch.tensor([0, 1])
    out = acc.prepare_batch([x, [labels], {"y": labels}])
    assert type(out) is tuple and type(out[1]) is list and type(out[2]) is dict, "only the outer list"
    assert out[0].dtype == torch.float64 and out[1][0] is labels
    assert type(acc.prepare_batch([x.double(), labels])) is tuple, "a batch already in place too"
    assert type(acc.prepare_batch((x,))) is tuple and type(acc.prepare_batch({"x": x})) is dict


def test_container_types_are_kept():
    x = torch.ones(1)
    ordered = OrderedDict([("b", x), ("a", x)])
    counts = defaultdict(list, {"x": x})
    out = prepare_batch(
        {"d": {"x": x}, "o": ordered, "dd": counts, "l": [x, x], "t": (x,), "p": Pair(x, [x, (x,)])},
        CPU,
        torch.float64,
    )
    assert type(out["o"]) is OrderedDict and list(out["o"]) == ["b", "a"]
    assert type(out["dd"]) is defaultdict and out["dd"].default_factory is list and out["dd"]["new"] == []
    assert "new" not in counts, "the input mapping must not be modified"
    assert type(out["l"]) is list and type(out["t"]) is tuple
    assert type(out["p"]) is Pair and type(out["p"].y) is list and type(out["p"].y[1]) is tuple
    assert out["p"].y[1][0].dtype == torch.float64 and out["d"]["x"].dtype == torch.float64
    assert ordered["b"].dtype == torch.float32, "the input's tensors must be left as they were"


def test_nested_dataclasses_are_rebuilt_with_their_type():
    batch = Outer(Inner(torch.ones(3)), torch.tensor([1, 2, 3]))
    out = prepare_batch(batch, CPU, torch.float64)
    assert type(out) is Outer and type(out.inner) is Inner and out is not batch
    assert out.inner.x.dtype == torch.float64 and out.inner.tag == "inner"
    assert out.labels is batch.labels and out.rows == 3
    assert batch.inner.x.dtype == torch.float32


@pytest.mark.parametrize(
    ("dtype", "real_in", "real_out", "complex_in", "complex_out"),
    [
        (torch.float64, torch.float32, torch.float64, torch.complex64, torch.complex64),
        (torch.float16, torch.float64, torch.float16, torch.complex128, torch.complex128),
        (torch.complex128, torch.float32, torch.float64, torch.complex64, torch.complex128),
        (torch.complex64, torch.float64, torch.float32, torch.complex128, torch.complex64),
        (torch.complex32, torch.float32, torch.float16, torch.complex64, torch.complex32),
    ],
)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_float_and_complex_casts(dtype, real_in, real_out, complex_in, complex_out):
    out = prepare_batch([torch.ones(2, dtype=real_in), torch.ones(2, dtype=complex_in)], CPU, dtype)
    assert [t.dtype for t in out] == [real_out, complex_out]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128, None])
def test_integer_and_bool_tensors_keep_their_dtype(dtype):
    labels, mask, small = torch.tensor([3, 7]), torch.tensor([True]), torch.tensor([1], dtype=torch.uint8)
    out = prepare_batch((labels, mask, small), CPU, dtype)
    assert [t.dtype for t in out] == [torch.int64, torch.bool, torch.uint8]
    assert out[0] is labels, "an integer tensor already on the device is not copied"


def test_dtype_none_casts_nothing():
    tensors = [torch.ones(1, dtype=dt) for dt in (torch.float16, torch.float32, torch.complex64, torch.int32)]
    out = prepare_batch(tensors, CPU, None)
    assert all(a is b for a, b in zip(out, tensors))


def test_tensor_already_in_place_is_the_same_object():
    x = torch.ones(4, dtype=torch.float64)
    assert prepare_batch(x, CPU, torch.float64) is x
    assert prepare_batch({"x": x}, torch.device("cpu"), torch.float64)["x"] is x
    assert prepare_batch(x, CPU, torch.complex128) is x


def test_batch_already_in_place_keeps_its_tensors_in_a_new_mutable_container():
    x, labels = torch.ones(2), torch.tensor([1, 2])
    for data in ([x, labels], (x, labels), {"x": x, "y": labels}):
        out = prepare_batch(data, CPU, torch.float32)
        assert type(out) is type(data)
        assert (out is data) == (type(data) is tuple), "a list or dict comes back as a new one, as when moved"
        values = list(out.values()) if isinstance(out, dict) else list(out)
        assert values[0] is x and values[1] is labels
    out = prepare_batch([x, labels], CPU, torch.float64)  # one tensor to cast: the rest is still kept
    assert out[0].dtype == torch.float64 and out[1] is labels


def test_non_tensor_leaves_are_the_same_objects():
    leaves = ["text", 3, 2.5, None, np.ones(3, dtype=np.float32), object()]
    out = prepare_batch({"leaves": leaves, "x": torch.ones(1)}, CPU, torch.float64)
    assert all(a is b for a, b in zip(out["leaves"], leaves))
    assert out["leaves"][4].dtype == np.float32
    assert prepare_batch("text", CPU, torch.float64) == "text"
