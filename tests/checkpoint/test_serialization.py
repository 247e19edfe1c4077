"""The JSON header tree: round trips, unsupported leaves, malformed headers."""

from collections import OrderedDict

import pytest
import torch

from torchtitan_ft.checkpoint._serialization import Header, TensorSpec, flatten, layout, unflatten


def test_round_trip_keeps_structure_and_plain_values() -> None:
    w = torch.randn(2, 3)
    state = OrderedDict(
        model={"w": w},
        optim={"state": {0: {"step": 3}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        extra=[None, True, 7, -1.5, "s", b"\x00\xff", torch.Size([2, 3]), float("inf")],
    )
    tree, tensors = flatten(state)
    header = Header(step=4, tree=tree, tensors=layout(tensors), snapshot_id="x")
    parsed = Header.from_bytes(header.to_bytes())
    out = unflatten(parsed.tree, tensors)
    assert out["model"]["w"] is w
    assert list(out) == ["model", "optim", "extra"]
    assert out["optim"]["state"] == {0: {"step": 3}}  # int keys stay ints
    assert out["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert out["extra"] == state["extra"]
    assert type(out["extra"][6]) is torch.Size
    assert parsed.tensors == (TensorSpec(torch.float32, (2, 3), 0, 24),)
    assert parsed.step == 4 and parsed.snapshot_id == "x"


def test_layout_packs_tensors_back_to_back() -> None:
    specs = layout([torch.zeros(3, dtype=torch.int16), torch.zeros(0), torch.zeros(2)])
    assert [(s.offset, s.nbytes) for s in specs] == [(0, 6), (6, 0), (6, 8)]


def test_unsupported_leaf_names_its_path() -> None:
    with pytest.raises(TypeError, match=r"state_dict\['a'\]\[1\] has type object"):
        flatten({"a": [1, object()]})


def test_malformed_headers_raise_value_error() -> None:
    with pytest.raises(ValueError, match="malformed"):
        Header.from_bytes(b"not json")
    bad_dtype = (
        b'{"version":1,"step":1,"snapshot_id":"","tree":null,'
        b'"tensors":[{"dtype":"Tensor","shape":[1],"offset":0,"nbytes":4}]}'
    )
    with pytest.raises(ValueError, match="unknown dtype"):
        Header.from_bytes(bad_dtype)
    bad_size = bad_dtype.replace(b'"Tensor"', b'"float32"').replace(b'"nbytes":4', b'"nbytes":8')
    with pytest.raises(ValueError, match="is not 8 bytes"):
        Header.from_bytes(bad_size)
    gap = bad_dtype.replace(b'"Tensor"', b'"float32"').replace(b'"offset":0', b'"offset":4')
    with pytest.raises(ValueError, match="not packed"):
        Header.from_bytes(gap)
    with pytest.raises(ValueError, match="malformed"):
        unflatten({"T": 3}, [])


def test_real_model_optimizer_and_scheduler_state_dicts_are_supported() -> None:
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 0.5**step)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    sched.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "lr": sched.state_dict()}
    tree, tensors = flatten(state)
    header = Header.from_bytes(Header(step=1, tree=tree, tensors=layout(tensors)).to_bytes())
    out = unflatten(header.tree, tensors)
    model2 = torch.nn.Linear(4, 3)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(optim2, lambda step: 0.5**step)
    model2.load_state_dict(out["model"])
    optim2.load_state_dict(out["optim"])
    sched2.load_state_dict(out["lr"])
    assert optim2.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    assert sched2.state_dict() == sched.state_dict()
    assert torch.equal(model2.weight, model.weight)
