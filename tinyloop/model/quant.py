"""Weight-only quantisation of the linear layers for CPU decode: int8 and int4, grouped.

A batch-1 decode streams every weight once per token (once per loop for the core), so its speed
is the bytes it reads: int8 weights read a quarter of float32's, int4 an eighth. The products run
on torch's packed CPU kernels with the activations rounded to bfloat16 for the product (the
kernels' float32-activation variants run 15-30x slower here: 3.9 ms against 0.25 ms for a
6144 x 768 int8 product of one row); inputs and outputs of a layer stay float32:

- ``int8``: symmetric, ``w ~ q * scale`` (``q`` in [-127, 127]), a scale per output channel
  (``torch.ops.aten._weight_int8pack_mm``), or per group of 32 inputs where the C kernels
  run (``quantize_linears``: llama.cpp's q8_0 weights, the scales fp16).
- ``int4``: asymmetric per group of ``group`` inputs, ``w ~ (q - 8) * scale + zero`` (``q`` in
  [0, 15], torch's convention); ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the weight
  packed by ``_convert_weight_to_int4pack_for_cpu``.
- ``bf16``: the weight rounded to bfloat16 (half of float32's bytes; what published looped
  checkpoints ship): ``Engine`` picks it for a bfloat16 model on the CPU, whose activations then
  run in float32; torch's bfloat16 ``F.linear`` without the C kernels, ``kernels.matmul_bf16``
  (AVX-512 BF16 ``vdpbf16ps`` where the CPU has it) with them.

With the C kernels (``tinyloop/cpu``), a quantized weight also gets its codes laid out in
16-column panels and its products run on ``kernels.matmul_q8`` / ``matmul_q4`` (qmatmul.c):
the activations are quantised to int8 per block of 32 inputs (llama.cpp's q8_0 rule: max|x| /
127, rounded) and each weight byte goes straight into an integer dot product (AVX-512 VNNI,
AVX2, or portable C), so a one-row product reads the codes at the memory's speed where widening
them to float32 was bound by the vector unit (twice to three times faster,
``bench/vs_llamacpp.py``). The result is the dequantised weight times the dequantised
activations; int4's scales and shifts are held as fp16 in the panels (5 bits a weight in all),
as are grouped int8's scales (8.5 bits a weight).
An int4 weight keeps its codes a second time (``codes4``, half a byte a weight) to lay them out.

``quantize_linears(model, "int8" | "int4" | "bf16")`` swaps every float32 ``nn.Linear`` for a
``QuantLinear`` (the exit gate, one output wide, stays as it is, as do a linear marked
``keep_float`` (Parcae's value gate, Inkling-2's controllers) and an int4 layer whose input
width is not a multiple of the group). Its ``weight`` is the
dequantized matrix, made on demand (h-mode's K, V recompute reads it), so code that reads a
layer's weight still works, at float32 cost. The embedding stays float32 (a lookup reads one
row); a tied LM head gets its own quantized copy (``LoopedLM.packed_head``). The head is int8 in
``int4`` mode too, with its activations in two int8 terms (``quantize_linears``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tinyloop.cpu import kernels
from tinyloop.model.layers import HookFree

__all__ = ["DRAFT_WEIGHTS", "WEIGHT_MODES", "QuantWeight", "QuantLinear", "bf16_weights_on_cpu", "draft_copy",
           "int8_group", "quantize_linears", "quant_available", "quant_weights"]

WEIGHT_MODES = ("float", "int8", "int4", "bf16")
_INT4_GROUP = 32
INT8_GROUP = 32  # int8 weights on the C kernels: inputs a scale (q8_0's blocks; without them one per output)


def quant_available(mode: str) -> bool:
    """Whether this torch build has the kernels of ``mode`` (``int8``, ``int4`` or ``bf16``)."""
    ops = {"bf16": (), "int8": ("_weight_int8pack_mm",),
           "int4": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")}[mode]
    return all(hasattr(torch.ops.aten, op) for op in ops)


class QuantWeight:
    """One ``[N, K]`` float32 weight quantized to ``mode``; ``linear`` multiplies by it."""

    __slots__ = ("mode", "shape", "group", "q", "scales", "scales16", "panels", "codes4", "terms")

    def __init__(self, weight: torch.Tensor, mode: str, group: int | None = None) -> None:
        """``group``: int4's inputs a scale (default 32); int8's, 0 (the default) for one scale per
        output, else a multiple of 32 dividing the input width (fp16 scales, q8_0's layout at 32)."""
        if mode not in ("int8", "int4", "bf16"):
            raise ValueError(f"weight mode must be int8, int4 or bf16, got {mode!r}")
        n, k = weight.shape
        group = (_INT4_GROUP if mode == "int4" else 0) if group is None else group
        if mode == "int8" and group and (group < 0 or group % 32 or k % group):
            raise ValueError(f"an int8 group must be a multiple of 32 dividing the input width {k}, got {group}")
        self.mode, self.shape, self.group = mode, (n, k), group
        # the C kernels' activations in 1 or 2 int8 terms (``kernels.matmul_q8``): 2 for the head
        self.terms = 1
        self.codes4: torch.Tensor | None = None  # int4: the codes, two a byte, for ``set_panels``
        w = weight.detach() if mode == "bf16" else weight.detach().float()  # (bf16: no float32 copy)
        if mode == "bf16":  # the weight itself, rounded to bfloat16 (no scales)
            self.q = w.to(torch.bfloat16).contiguous()
            self.scales = torch.empty(0)
        elif mode == "int8" and group:  # a scale per group of inputs, rounded to the fp16 the panels hold
            wg = w.reshape(n, k // group, group)
            scale = (wg.abs().amax(-1) / 127).clamp(2.0**-24, 65504.0).half().float()  # [N, G]
            self.q = torch.round(wg / scale[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k).contiguous()
            self.scales = scale
        elif mode == "int8":
            scale = (w.abs().amax(1) / 127).clamp_min(1e-12)  # [N]
            self.q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
            self.scales = scale
        else:
            if k % group:
                raise ValueError(f"int4 needs the input width {k} divisible by the group {group}")
            wg = w.reshape(n, k // group, group)
            lo, hi = wg.amin(-1), wg.amax(-1)
            scale = ((hi - lo) / 15).clamp_min(1e-12)  # [N, G]
            codes = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
            self.q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(n, k), 1)
            flat = codes.reshape(n, k).to(torch.uint8)
            self.codes4 = (flat[:, 0::2] | (flat[:, 1::2] << 4)).contiguous()  # [N, K/2]
            zero = lo + 8 * scale  # w = (q - 8) * scale + zero
            self.scales = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [G, N, 2]
        self.scales16 = self.scales.to(torch.bfloat16)  # what the fast kernels take
        # the C kernels' layout (``set_panels``): int8 codes, or int4 codes and their group parameters
        self.panels: torch.Tensor | None = None

    def set_panels(self, on: bool) -> None:
        """Lay the codes out in panels for ``kernels.matmul_q8`` / ``matmul_q4`` (the C kernels
        built), or drop them."""
        if not on:
            self.panels = None
        elif self.panels is not None:
            return
        elif self.mode == "bf16":
            self.panels = kernels.pack_bf16(self.q)
        elif self.mode == "int8":
            self.panels = kernels.pack_q8(self.q, self.scales, self.group)
        else:  # scales [G, N, 2]: (scale, zero) per group and output
            assert self.codes4 is not None
            self.panels = kernels.pack_q4(self.codes4, self.scales[..., 0], self.scales[..., 1], self.group)

    @property
    def nbytes(self) -> int:
        """What a product reads: the codes and the bfloat16 scales."""
        return self.q.numel() * self.q.element_size() + self.scales16.numel() * self.scales16.element_size()

    def _product(self, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if self.mode == "bf16":
            out = torch.nn.functional.linear(rows, self.q)
        elif self.mode == "int8" and self.group:  # (no torch kernel: the weight dequantised, slow)
            out = torch.nn.functional.linear(rows, self.dequantize().to(rows.dtype))
        elif self.mode == "int8":
            out = torch.ops.aten._weight_int8pack_mm(rows, self.q, scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.q, self.group, scales)
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for x ``[..., K]``, W the dequantized weight: float32 rows on
        the integer kernels where there are panels (x quantised per block of 32), else x
        rounded to bfloat16 for torch's product; the result in x's dtype."""
        k = x.shape[-1]
        if self.panels is not None and x.dtype is torch.float32 and x.numel():
            flat = x.reshape(-1, k).contiguous()
            if self.mode == "bf16":
                out = kernels.matmul_bf16(flat, self.panels, self.shape[0], bias)
            elif self.mode == "int4":
                out = kernels.matmul_q4(flat, self.panels, self.shape[0], self.group, bias, self.terms)
            else:
                out = kernels.matmul_q8(flat, self.panels, self.shape[0], self.scales, bias, self.terms, self.group)
            return out.view(*x.shape[:-1], self.shape[0])
        flat = x.reshape(-1, k).to(torch.bfloat16).contiguous()
        out = self._product(flat, self.scales16).to(x.dtype).view(*x.shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` matrix of the codes and float32 scales (one float32 product
        with the identity: slow, for the rare reader of a quantized layer's weight)."""
        if self.mode == "bf16":
            return self.q.float()
        if self.mode == "int8" and self.group:
            n, k = self.shape
            return (self.q.view(n, k // self.group, self.group).float() * self.scales[..., None]).view(n, k)
        eye = torch.eye(self.shape[1], dtype=torch.float32)
        return self._product(eye, self.scales).t().contiguous()


class QuantLinear(HookFree):
    """A bias-or-not linear layer on a ``QuantWeight``; ``weight`` is dequantized on demand."""

    def __init__(self, linear: nn.Linear, mode: str, group: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quant = QuantWeight(linear.weight, mode, group)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.quant.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant.linear(x, self.bias)


def _quantizable(weight: torch.Tensor, mode: str) -> bool:
    """A float32 CPU matrix (or bfloat16, for bf16) whose input width the mode's groups divide
    and, for int4, whose outputs torch's int4 packing takes (a multiple of 16; others stay
    float: Parcae's value gates have one output per KV head)."""
    dtypes = (torch.float32, torch.bfloat16) if mode == "bf16" else (torch.float32,)
    return (weight.dim() == 2 and weight.dtype in dtypes and weight.device.type == "cpu"
            and (mode != "int4" or (weight.shape[1] % _INT4_GROUP == 0 and weight.shape[0] % 16 == 0)))


def int8_group(mode: str, weight: torch.Tensor, grouped: bool = True) -> int | None:
    """An int8 weight's group: ``INT8_GROUP`` where it is ``grouped`` and the group divides its
    input width, else 0 (a scale per output); None (the mode's default) for the other modes."""
    if mode != "int8":
        return None
    return INT8_GROUP if grouped and INT8_GROUP and weight.shape[-1] % INT8_GROUP == 0 else 0


def bf16_weights_on_cpu(model: nn.Module, weights: str, cpu_kernels: bool) -> str:
    """The weights mode an engine uses: ``bf16`` for a bfloat16 model on the CPU left at
    ``float`` where the C kernels build (its linear weights stay bfloat16 on ``matmul_bf16``,
    the rest runs in float32: torch's bfloat16 ops on the CPU run 4-5x slower than float32's at
    decode sizes, bench/vs_llamacpp.py), else ``weights`` as asked."""
    param = next(model.parameters())
    if (weights == "float" and cpu_kernels and param.dtype == torch.bfloat16 and param.device.type == "cpu"
            and kernels.available()):
        return "bf16"
    return weights


def quantize_linears(model: nn.Module, mode: str, grouped: bool = True) -> int:
    """Swap every float32 CPU ``nn.Linear`` of ``model`` wider than one output for a
    ``QuantLinear`` of ``mode``, and quantize the weight ``model.head_weight`` names into
    ``model.packed_head``; returns how many weights were quantized. ``bf16`` takes bfloat16
    layers too, then turns the model's other bfloat16 parameters to float32.

    int8 weights get a scale per group of ``INT8_GROUP`` (32) inputs where they are ``grouped``
    and the C kernels build (torch's int8 kernel, the one without them, takes one per output):
    q8_0's weights, 8.5 bits a weight. Against one scale per output that took top-1 agreement
    with float32 on the bench's random-weights model (64 prompts, loops 1 / 4) from 0.968 / 0.964
    to 0.975 / 0.972 (llama.cpp's q8_0 there: 0.971 / 0.968), for 6% more bytes.

    The head is where quantisation error decides the pick: for ``int8`` and ``int4`` it is int8
    with its activations in two int8 terms (``QuantWeight.terms``; about 1% of a batch-1 step),
    which took top-1 agreement with float32 at loops 4 from 0.963 to 0.977 (int8) and 0.883 to
    0.918 (int4) on the demo model (``bench/vs_llamacpp.py``'s quality table). int4's int8
    head is llama.cpp's q4_0 mix too (its output matrix stays q6_K)."""
    if mode == "float":
        return 0
    if not quant_available(mode):
        raise RuntimeError(f"this torch build has no {mode} weight kernels")
    head_mode = "bf16" if mode == "bf16" else "int8"
    lm_head = getattr(model, "lm_head", None)
    grouped = grouped and kernels.available()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            layer_mode = head_mode if child is lm_head else mode
            if (isinstance(child, nn.Linear) and child.out_features > 1 and _quantizable(child.weight, layer_mode)
                    and not getattr(child, "keep_float", False)):  # (tiny ones a C step reads as float32)
                setattr(parent, name, QuantLinear(child, layer_mode, int8_group(layer_mode, child.weight, grouped)))
                count += 1
    lm_head = getattr(model, "lm_head", None)  # (now the QuantLinear, where it was quantized)
    head = getattr(model, "head_weight", None)
    packed: QuantWeight | None = None
    if isinstance(lm_head, QuantLinear):  # untied: the head layer is quantized already
        packed = lm_head.quant
    elif isinstance(head, torch.Tensor) and _quantizable(head, head_mode):
        packed = QuantWeight(head, head_mode, int8_group(head_mode, head, grouped))
        count += 1
    if packed is not None:
        packed.terms = 1 if mode == "bf16" else 2
        setattr(model, "packed_head", packed)  # noqa: B010
    if mode == "bf16":  # what stays of a bfloat16 model (norms, embedding) computes in float32
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                if tensor.dtype == torch.bfloat16:
                    tensor.data = tensor.data.float()
    return count


def quant_weights(model: nn.Module) -> list[QuantWeight]:
    """Every ``QuantWeight`` of ``model`` (its quantized linears' and its head's), each once."""
    weights: list[object] = [m.quant for m in model.modules() if isinstance(m, QuantLinear)]
    weights.append(getattr(model, "packed_head", None))
    return list({id(w): w for w in weights if isinstance(w, QuantWeight)}.values())


DRAFT_WEIGHTS = ("same", "int8")


def draft_copy(model: nn.Module, mode: str) -> nn.Module:
    """The model speculative drafts run on: ``model`` itself (``same``), or a twin whose linear
    weights are ``int8`` (``quantize_linears``) and which shares every other parameter and buffer
    with ``model`` (the embedding, norms, RoPE tables): a draft reads half the bytes or less per
    token, while the verify, and so every emitted token, stays on ``model``'s weights. Costs the
    int8 weights' memory (a quarter of the float32 ones). ``model`` itself when nothing would be
    quantized (no int8 kernels, weights on a GPU or not float32). Call it before ``pack_linears``."""
    if mode not in DRAFT_WEIGHTS:
        raise ValueError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {mode!r}")
    if mode == "same" or not quant_available(mode):
        return model
    twin = copy.deepcopy(model, memo={id(t): t for t in (*model.parameters(), *model.buffers())})
    return twin if quantize_linears(twin, mode) else model
