"""Context managers owning every hook and temporary change FeatCal makes to a model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .streams import StopForward, module_input


class InputCapture(dict):
    """Module name → the input tensor of its last call. `order` lists the names in the order they were
    called in the last forward; with `stop_after` set, the forward is cut short (`StopForward`) right
    after that module's input is stored."""

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []
        self.stop_after: str | None = None


@contextlib.contextmanager
def capture_module_inputs(block: nn.Module, names: Iterable[str]) -> Iterator[InputCapture]:
    """While active, every call of the named submodules of `block` stores its input tensor in the
    yielded `InputCapture`. Hooks are removed on exit, also on error."""
    store = InputCapture()
    handles = []
    try:
        for name in names:
            module = block.get_submodule(name)

            def hook(mod: nn.Module, args: tuple, kwargs: dict, _name: str = name) -> None:
                if _name in store.order:  # a new forward began
                    store.order.clear()
                store[_name] = module_input(args, kwargs)
                store.order.append(_name)
                if store.stop_after == _name:
                    raise StopForward

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        yield store
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def attention_out_proj_called(root: nn.Module) -> Iterator[None]:
    """While active, every `nn.MultiheadAttention` in `root` computes its attention with the output
    projection as an explicit `out_proj(context)` call, so hooks on `out_proj` see its input
    (torch's own forward uses `out_proj.weight` without calling the module). Same result: the
    context is computed by `F.multi_head_attention_forward` with an identity output projection,
    which is exact. The original forwards are restored on exit, also on error."""
    patched = [m for m in root.modules() if isinstance(m, nn.MultiheadAttention)]
    try:
        for module in patched:
            module.forward = _forward_calling_out_proj(module)  # an instance attribute shadows the method
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


def _forward_calling_out_proj(mha: nn.MultiheadAttention):
    def forward(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if mha.batch_first:  # F.multi_head_attention_forward takes (sequence, batch, features)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        identity = torch.eye(mha.embed_dim, dtype=query.dtype, device=query.device)
        separate = not mha._qkv_same_embed_dim
        context, weights = F.multi_head_attention_forward(
            query, key, value, mha.embed_dim, mha.num_heads, mha.in_proj_weight, mha.in_proj_bias,
            mha.bias_k, mha.bias_v, mha.add_zero_attn, mha.dropout, identity, None,
            training=mha.training, key_padding_mask=key_padding_mask, need_weights=need_weights,
            attn_mask=attn_mask, use_separate_proj_weight=separate,
            q_proj_weight=mha.q_proj_weight, k_proj_weight=mha.k_proj_weight, v_proj_weight=mha.v_proj_weight,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
        )
        out = mha.out_proj(context.transpose(0, 1))  # batch-first, so captured inputs are (batch, tokens, features)
        return (out if mha.batch_first else out.transpose(0, 1)), weights

    return forward


@contextlib.contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Put modules in eval mode (no dropout) and restore each submodule's training flag on exit."""
    flags = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        yield
    finally:
        for module, training in flags:
            module.training = training


@contextlib.contextmanager
def restore_on_failure(model: nn.Module, parameter_names: Iterable[str], parameters: Any = None) -> Iterator[None]:
    """If the body raises, put `model` back exactly as it was: every parameter and buffer, also those
    outside the blocks, as the same tensor objects in the same modules, with their values, devices and
    dtypes (a CPU copy of each is kept while the body runs), whatever the body did — e.g. a move to
    the meta device, which replaces the tensor objects. Tensors accelerate had offloaded (on the meta
    device before the body) keep their hooks' placement; of those, the named parameters' values are
    restored through `parameters` (a `ModelParameters`), which reaches the offloaded copy."""
    if parameters is None:
        from .offload import ModelParameters

        parameters = ModelParameters(model)
    # (module, "_parameters" / "_buffers", attribute) → the tensor object there now
    slots = [
        (module, kind, attr, tensor)
        for module in model.modules()
        for kind in ("_parameters", "_buffers")
        for attr, tensor in getattr(module, kind).items()
        if tensor is not None and not tensor.is_meta
    ]
    saved = {id(t): (t.device, t.dtype, t.detach().to("cpu", copy=True)) for _, _, _, t in slots}
    placement = {name: t.device for name, t in _named_tensors(model)}
    offloaded = {
        name: parameters.read(name).to("cpu", copy=True)
        for name in parameter_names
        if placement.get(name) == torch.device("meta")
    }
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for module, kind, attr, tensor in slots:
                getattr(module, kind)[attr] = tensor
            for tensor in {id(t): t for _, _, _, t in slots}.values():
                device, dtype, value = saved[id(tensor)]
                if tensor.is_meta or tensor.device != device or tensor.dtype != dtype or tensor.shape != value.shape:
                    tensor.data = value.to(device=device, dtype=dtype)
                else:
                    tensor.copy_(value)
            for name, value in offloaded.items():
                parameters.write(name, value)
        raise


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()
