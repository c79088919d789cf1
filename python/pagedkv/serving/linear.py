"""Linear layers of the model through oneDNN with prepacked weights (CPU), or ``F.linear``.

PyTorch's default CPU float32 matmul (``F.linear`` -> MKL sgemm) reaches a fraction of what
oneDNN's own kernels reach on the same CPU, with weights reordered once into the kernel's blocked
layout ("prepacked", what ``torch.compile``'s inductor does under freezing:
``torch.ops.mkldnn._reorder_linear_weight`` then ``torch.ops.mkldnn._linear_pointwise``). A
``LinearGroup`` holds the ``nn.Linear`` layers that read the same input (q/k/v, gate/up, or one
layer alone); packed, it runs them as one matmul over their concatenated weights and splits the
result. The ``nn.Linear`` modules keep their parameters (state dicts, ``.to``, autograd); the
packed weight is a copy, rebuilt when a weight changes (a load, an in-place edit, a move).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import InvalidArgumentError

__all__ = ["LinearGroup", "onednn_dtypes"]


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN's prepacked linear runs on this machine's CPU: float32 when
    PyTorch was built with oneDNN (and it is enabled), bfloat16 too where the CPU has native
    bfloat16 arithmetic (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``, e.g. AVX-512 BF16 or
    AMX); empty otherwise."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def check_packable(device: torch.device, dtype: torch.dtype) -> None:
    """Raises InvalidArgumentError, naming the reason, unless weights of ``dtype`` on ``device``
    can be prepacked."""
    if device.type != "cpu":
        raise InvalidArgumentError(
            f"prepack: oneDNN's prepacked linear runs on the CPU; the model is on {device}")
    supported = onednn_dtypes()
    if dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported) or "none"
        raise InvalidArgumentError(
            f"prepack: dtype {str(dtype).removeprefix('torch.')} is not supported by oneDNN's "
            f"linear on this CPU (supported here: {names}; bfloat16 needs native bfloat16 "
            "arithmetic, e.g. AVX-512 BF16 or AMX)")


class LinearGroup(nn.Module):
    """``nn.Linear`` layers of one input: ``group(x)`` is ``tuple(linear(x) for each)``.

    After ``pack(dtype)`` the layers run as one oneDNN matmul over a prepacked copy of their
    concatenated weights (computed in ``dtype``, the outputs in ``x``'s dtype); the outputs are
    column slices of one ``[T, sum of out_features]`` tensor. Without a pack, or when autograd
    needs the weights' gradients, each layer runs ``F.linear``. The group owns no parameters
    (the layers are its owner's), so it adds nothing to a state dict; the packed copy is not a
    buffer either.
    """

    def __init__(self, *linears: nn.Linear) -> None:
        super().__init__()
        if not linears or any(lin.in_features != linears[0].in_features for lin in linears):
            raise InvalidArgumentError("LinearGroup needs nn.Linear layers of one input size")
        self.linears = tuple(linears)  # a tuple: not registered as submodules
        self.sizes = [lin.out_features for lin in linears]
        self.dtype: torch.dtype | None = None
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._key: tuple = ()

    @property
    def packed(self) -> bool:
        return self.dtype is not None

    def pack(self, dtype: torch.dtype) -> None:
        """Prepack the weights for oneDNN in ``dtype`` (float32, or bfloat16 where supported)."""
        check_packable(self.linears[0].weight.device, dtype)
        self.dtype = dtype
        self._repack()

    def unpack(self) -> None:
        self.dtype, self._packed, self._bias, self._key = None, None, None, ()

    def _weights_key(self) -> tuple:
        return tuple((p.data_ptr(), p._version, p.dtype, p.device)
                     for lin in self.linears for p in (lin.weight, lin.bias) if p is not None)

    def _repack(self) -> None:
        with torch.no_grad():
            weight = torch.cat([lin.weight for lin in self.linears]).to(self.dtype)
            check_packable(weight.device, self.dtype)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            biases = [lin.bias for lin in self.linears]
            self._bias = (None if biases[0] is None
                          else torch.cat(biases).to(self.dtype).contiguous())
        self._key = self._weights_key()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x ``[T, in_features]`` -> one ``[T, out_features]`` tensor per layer."""
        if not self.packed or (torch.is_grad_enabled() and any(
                p.requires_grad for lin in self.linears for p in lin.parameters())):
            return tuple(F.linear(x, lin.weight, lin.bias) for lin in self.linears)
        if self._key != self._weights_key():
            self._repack()
        dtype = self.dtype
        y = torch.ops.mkldnn._linear_pointwise(x.to(dtype), self._packed, self._bias, "none",
                                               [], "").to(x.dtype)
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


def pack_groups(groups: Sequence[LinearGroup], dtype: torch.dtype | None) -> None:
    """Pack every group in ``dtype`` (None: unpack), after checking all of them can be."""
    if dtype is not None:
        for group in groups:
            check_packable(group.linears[0].weight.device, dtype)
    for group in groups:
        group.pack(dtype) if dtype is not None else group.unpack()
