"""Splitting a model into fragments for Streaming DiLoCo, in the trainer.

A fragment is an ``nn.Module`` that holds some of the model's submodules (shared, not copied),
so ``fragment.parameters()`` are the model's own parameters. Two ways to get them:

- ``fragments_from_fqns(model, [["tok_embeddings", "layers.0"], ["layers.1", "norm", ...]])``:
  explicit lists of module names;
- ``split_model(model, n)``: n fragments by contiguous ranges of ``model.layers`` (a ModuleDict or
  ModuleList, as in TorchTitan's llama3); modules before the layers in registration order (e.g.
  ``tok_embeddings``) join the first fragment, modules after them (``norm``, ``output``) the last.

Either way every parameter must land in exactly one fragment, else ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class ModelFragment(nn.Module):
    """A group of submodules of one model, synced together.

    Args:
        modules: the submodules, by their fully qualified name in the model.
    """

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.fqns: list[str] = list(modules)
        self.parts = nn.ModuleList(modules.values())

    def extra_repr(self) -> str:
        """Lists the module names of the fragment."""
        return f"fqns={self.fqns}"


def _check_partition(model: nn.Module, fragments: Sequence[nn.Module]) -> None:
    owner: dict[int, int] = {}
    for i, fragment in enumerate(fragments):
        for p in fragment.parameters():
            if id(p) in owner and owner[id(p)] != i:
                raise ValueError(f"a parameter is in fragments {owner[id(p)]} and {i}")
            owner[id(p)] = i
    missing = [name for name, p in model.named_parameters() if id(p) not in owner]
    if missing:
        raise ValueError(
            f"parameters in no fragment: {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )


def fragments_from_fqns(model: nn.Module, fqns: Sequence[Sequence[str]]) -> list[ModelFragment]:
    """One fragment per list of module names; every parameter must be in exactly one.

    Raises:
        ValueError: empty list, unknown module name, or a parameter in none or two fragments.
    """
    if not fqns:
        raise ValueError("fragment_fqns must hold at least one list of module names")
    fragments = []
    for names in fqns:
        if not names:
            raise ValueError("each fragment needs at least one module name")
        modules = {}
        for name in names:
            try:
                modules[name] = model.get_submodule(name)
            except AttributeError as e:
                raise ValueError(f"no module named {name!r} in the model") from e
        fragments.append(ModelFragment(modules))
    _check_partition(model, fragments)
    return fragments


def split_model(model: nn.Module, num_fragments: int) -> list[nn.Module]:
    """``num_fragments`` fragments of ``model`` by contiguous ranges of ``model.layers``.

    With one fragment, returns ``[model]``.

    Raises:
        ValueError: no ``layers`` ModuleDict/ModuleList, or fewer layers than fragments.
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if num_fragments == 1:
        return [model]
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict | nn.ModuleList):
        raise ValueError(
            "automatic fragments need a `layers` ModuleDict or ModuleList on the model "
            "(as in TorchTitan's llama3); pass explicit fragment_fqns otherwise"
        )
    layer_names = [f"layers.{name}" for name, _ in layers.named_children()]
    if len(layer_names) < num_fragments:
        raise ValueError(f"cannot split {len(layer_names)} layers into {num_fragments} fragments")
    top = [name for name, _ in model.named_children()]
    before = top[: top.index("layers")]
    after = top[top.index("layers") + 1 :]
    groups: list[list[str]] = []
    base, extra = divmod(len(layer_names), num_fragments)
    start = 0
    for i in range(num_fragments):
        size = base + (1 if i < extra else 0)
        groups.append(layer_names[start : start + size])
        start += size
    groups[0] = before + groups[0]
    groups[-1] = groups[-1] + after
    # Parameters registered directly on the model (not in a child module) have no module name.
    direct = [name for name, _ in model.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"parameters registered directly on the model ({direct}) cannot be assigned to a "
            "fragment automatically; pass explicit fragment_fqns"
        )
    return list(fragments_from_fqns(model, groups))
