"""``FusedStep``: a looped model's whole plain decode step as one C call (``block.c``'s
``tl_decode_model``).

With every block fused (``cpu.block.FusedBlock``), a batch-1 decode step of a ~100M model still
spent 1-2 ms between its C calls: the embedding, three stack calls, the initial state, each
loop's adapter, the norms and the head are each a few Python and torch calls, on a step whose
int8 weights stream in ~8 ms. Here they are one call, running the same kernels in the same order
on the same inputs (so the logits are the step through ``LoopedLM.forward``'s modules).

It covers ``LoopedLM.forward`` of one new token a row where every row runs the same loops in the
same window, with no exit rule, no warm state and no given positions, on a plain decode context
(``PagedContext.decode_slots``), for a model whose blocks are all fused and stackable (no value
embeddings), whose injection is ``concat_linear`` (the adapter on the kernels) or ``none``, with
no loop output projection, and whose head is on the kernels (``packed_head`` with panels). The
initial state comes from ``LoopedLM.initial_state`` (zeros or each row's noise; ``embed``: made in
C from the prelude's output). Anything else runs ``forward``'s modules. ``use_cpu_kernels`` gives
the model one (``LoopedLM.fused_step``).

``burst`` runs up to T such steps of one row in one call (``tl_decode_burst``), each feeding the
greedy pick of the step before: a lone greedy sequence's next T tokens with no Python between
them (``LoopedLM.decode_burst``, ``Engine(decode_burst=...)``).
"""

from __future__ import annotations

import ctypes
from typing import cast

import torch

from tinyloop.cpu import kernels
from tinyloop.cpu.block import FusedBlock, Weight, check_code, held_weight, kv_struct, module_weight, stack_index
from tinyloop.model.context import PagedContext
from tinyloop.model.layers import AttentionContext, RMSNorm
from tinyloop.model.looped import Burst, LoopedLM

__all__ = ["FusedStep"]

_I64, _P = ctypes.c_int64, ctypes.c_void_p


class _Model(ctypes.Structure):  # block.c's tl_model
    _fields_ = [("hidden", _I64), ("vocab", _I64), ("n_prelude", _I64), ("n_core", _I64), ("n_coda", _I64),
                ("prelude", _P), ("core", _P), ("coda", _P), ("embed", _P), ("embed_row", _I64), ("embed_col", _I64),
                ("embed_scale", ctypes.c_float),
                ("prelude_norm", _P), ("concat", _I64), ("adapter", Weight), ("init_embed", _I64),
                ("every_loop", _I64), ("norm_first", _I64), ("norm_last", _I64), ("final_norm", _P),
                ("eps", ctypes.c_float), ("head", Weight)]


def _float_rows(t: torch.Tensor) -> bool:
    return t.dtype is torch.float32 and t.is_contiguous() and t.device.type == "cpu"


class FusedStep:
    """A covered model's plain decode step in one call; ``for_model`` is None for a model it does
    not cover. Rebuilt by ``use_cpu_kernels``; ``current`` says whether the model still has the
    fused blocks, weights and panels it was built from."""

    __slots__ = ("model", "_struct", "_stacks", "_fused", "_watch", "_slots")

    def __init__(self, model: LoopedLM, struct: _Model, stacks: list[ctypes.Array[ctypes.c_void_p]],
                 fused: tuple[FusedBlock, ...], watch: tuple[tuple[object, str, object], ...]) -> None:
        self.model, self._struct, self._stacks, self._fused = model, struct, stacks, fused  # (_stacks: pointed at)
        self._watch = watch  # (holder, attribute, value) each still holds: the weights the struct points at
        self._slots: dict[tuple[int, int], ctypes.Array[ctypes.c_int64]] = {}

    @classmethod
    def for_model(cls, model: LoopedLM) -> FusedStep | None:
        c = model.config
        if not kernels.available() or c.injection not in ("concat_linear", "none") or c.loop_output != "none":
            return None
        stacks = [[getattr(b, "fused", None) for b in blocks] for blocks in (model.prelude, model.core, model.coda)]
        fused = tuple(f for stack in stacks for f in stack if isinstance(f, FusedBlock) and f.stackable)
        if len(fused) != sum(map(len, stacks)) or c.n_core == 0:
            return None
        head = model.packed_head
        head_w = None if head is None else held_weight(head)
        adapter_w = module_weight(model.adapter) if c.injection == "concat_linear" else None
        if head_w is None or (c.injection == "concat_linear" and adapter_w is None):
            return None
        prelude_norm: RMSNorm | None = model.prelude_norm if c.prelude_norm else None
        norms = [n.weight for n in (model.final_norm, prelude_norm) if n is not None]
        embed = model.embed.weight
        if not all(_float_rows(t) for t in norms) or embed.dtype is not torch.float32 or embed.device.type != "cpu":
            return None  # (the table may be column-major: a tied head's layout, cpu_linear)
        arrays = [(_P * len(stack))(*(cast(FusedBlock, f).address for f in stack)) for stack in stacks]
        none = Weight(0, 0, 0, 0, None, None)
        struct = _Model(c.hidden, embed.shape[0], c.n_prelude, c.n_core, c.n_coda,
                        *(ctypes.addressof(a) for a in arrays), embed.data_ptr(), *embed.stride(), c.embed_scale,
                        None if prelude_norm is None else prelude_norm.weight.data_ptr(),
                        int(adapter_w is not None), none if adapter_w is None else adapter_w[0],
                        int(c.state_init == "embed"), int(c.loop_norm == "every_loop"),
                        int(c.loop_norm == "final_only"), int(c.n_coda > 0 or c.loop_norm == "none"),
                        model.final_norm.weight.data_ptr(), model.final_norm.eps, head_w[0])
        watch: list[tuple[object, str, object]] = [(model, "packed_head", head), (head, "panels", head_w[1])]
        if adapter_w is not None:
            holder = getattr(model.adapter, "packed", None) or getattr(model.adapter, "quant", None)
            watch += [(model._modules, "adapter", model.adapter), (holder, "panels", adapter_w[1])]
        watch += [(model.embed, "weight", embed), (model.final_norm, "weight", model.final_norm.weight)]
        if prelude_norm is not None:
            watch.append((prelude_norm, "weight", prelude_norm.weight))
        return cls(model, struct, arrays, fused, tuple(watch))

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        """A copied model runs its modules until ``use_cpu_kernels`` gives it its own step."""
        return None

    def current(self) -> bool:
        """Whether the model still has the fused blocks, weights and panels this was built from."""
        m = self.model
        blocks = (*m.prelude, *m.core, *m.coda)
        if len(blocks) != len(self._fused) or any(b.fused is not f for b, f in zip(blocks, self._fused)):
            return False
        if not all(f.current() for f in self._fused):
            return False
        for holder, name, value in self._watch:
            held = holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)
            if held is not value:
                return False
        return True

    def _core_slots(self, loops: int, window: int) -> ctypes.Array[ctypes.c_int64]:
        slots = self._slots.get((loops, window))
        if slots is None:
            c = self.model.config
            slots = (ctypes.c_int64 * loops)(*(c.n_prelude + (r % window) * c.n_core for r in range(loops)))
            self._slots[loops, window] = slots
        return slots

    def run(self, tokens: torch.Tensor, ctx: AttentionContext, loops: int, window: int,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step of ``tokens`` ``[B, 1]`` through ``loops`` loops in ``window`` slots from the
        initial ``state`` ``[B, 1, H]`` (overwritten): logits ``[B, 1, V]`` and the last loop's
        state ``[B, 1, H]``; None where the call is not one this covers."""
        if not isinstance(ctx, PagedContext) or loops < 1 or window < 1 or not self.current():
            return None
        found = stack_index(ctx)
        if found is None:
            return None
        (write, keys, n_keys, cos, sin), kv = found
        c = self.model.config
        coda_slot = c.n_prelude + window * c.n_core
        if coda_slot + c.n_coda > write.shape[0]:  # (every core slot lies below the coda's)
            return None
        b = tokens.shape[0]
        if not _float_rows(state) or state.shape != (b, 1, c.hidden):
            return None
        ids = tokens.reshape(-1).to(torch.int64).contiguous()
        logits = torch.empty(b, 1, self._struct.head.n, dtype=torch.float32, device="cpu")
        code = kernels.load().tl_decode_model(
            ctypes.byref(self._struct), ids.data_ptr(), b, loops, self._core_slots(loops, window), coda_slot,
            state.data_ptr(), logits.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], ctypes.byref(kv),
            write.data_ptr(), keys.data_ptr(), keys.shape[2], n_keys.data_ptr())
        if code == 3:
            raise IndexError(f"a token id is outside the embedding of {self._struct.vocab} rows")
        check_code(code, kv)
        return logits, state

    def burst(self, token: int, ctx: AttentionContext, loops: int, window: int, init: torch.Tensor | None,
              limit: int, stops: tuple[int, ...], min_prob: float = 0.0) -> Burst | None:
        """One row's greedy steps over ``ctx``'s T new positions (``PagedContext.burst_slots``):
        the first feeds ``token``, each later one the id the step before picked (the first
        maximum of its logits below ``limit``), ending after a pick in ``stops`` or one whose
        softmax probability is below ``min_prob`` (a speculative draft's stop). ``init``
        ``[T, H]``: each step's initial state (its noise), or None (zeros, or made in C for
        ``embed``). None where the call is not one this covers."""
        if not isinstance(ctx, PagedContext) or loops < 1 or window < 1 or not self.current():
            return None
        found = ctx.burst_slots()
        kv = None if found is None else kv_struct(ctx.pool.store.fields)
        if found is None or kv is None:
            return None
        write, keys, cos, sin = found
        c = self.model.config
        n, slots = write.shape
        coda_slot = c.n_prelude + window * c.n_core
        if coda_slot + c.n_coda > slots:
            return None
        if init is not None and (not _float_rows(init) or init.shape != (n, c.hidden)):
            return None
        if not 0 <= token < self._struct.vocab:
            raise IndexError(f"a token id is outside the embedding of {self._struct.vocab} rows")
        state = torch.empty(c.hidden, dtype=torch.float32, device="cpu")  # (scratch: the C steps' core state)
        logits = torch.empty(self._struct.head.n, dtype=torch.float32, device="cpu")
        out = (ctypes.c_int64 * n)()
        made = ctypes.c_int64(0)
        stop_ids = (ctypes.c_int64 * max(len(stops), 1))(*stops)
        code = kernels.load().tl_decode_burst(
            ctypes.byref(self._struct), token, n, loops, self._core_slots(loops, window), coda_slot,
            None if init is None else init.data_ptr(), state.data_ptr(), logits.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), cos.shape[-1], ctypes.byref(kv), write.data_ptr(), slots, keys.data_ptr(), keys.shape[-1],
            ctx.burst_start, limit, stop_ids, len(stops), min_prob, out, ctypes.byref(made))
        if code == 3:
            raise IndexError(f"a token id is outside the embedding of {self._struct.vocab} rows")
        if code == 4:
            raise ValueError(f"a burst of {n} steps from {ctx.burst_start} over {keys.shape[-1]} keys, limit {limit}")
        if code != 5:
            check_code(code, kv)
        return Burst(list(out[:made.value]), code == 5)
