"""Named model configs, deterministic random init, and parameter counts.

``PRESETS`` are the shapes ``tinyloop init`` knows by name: ``tiny`` and ``tiny-ouro`` for tests
(one of each published family), ``small`` (~10M parameters) and ``base100m`` (~100M).

Models are built on the meta device first (``empty_model``) so that neither loading nor init
pays for, or draws global RNG state for, torch's default initialisation. ``state_shapes`` works
out a config's tensors by arithmetic alone, so a file is checked against its config before any
module is built.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tinyloop.model.config import VALUE_GATE_CHANNELS, ModelConfig
from tinyloop.model.layers import MLP, Attention, rope_for
from tinyloop.model.looped import LoopedLM
from tinyloop.vocabulary import ExitRule

__all__ = ["PRESETS", "empty_model", "init_model", "param_count", "state_shapes"]

_TINY_DIMS: dict[str, Any] = dict(vocab_size=4096, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  max_loops=16, max_position=2048, default_loops=4)

PRESETS: dict[str, ModelConfig] = {
    # Huginn-style: prelude, looped core with concat adapter injection, coda, random initial state.
    "tiny": ModelConfig(**_TINY_DIMS, n_prelude=1, n_core=2, n_coda=1, block_style="sandwich",
                        injection="concat_linear", state_init="randn"),
    # Ouro-style: the whole stack looped, the state normed and fed back, an exit gate.
    "tiny-ouro": ModelConfig(**_TINY_DIMS, n_prelude=0, n_core=2, n_coda=0, block_style="peri_ln",
                             injection="none", state_init="embed", loop_norm="every_loop",
                             tie_embeddings=False, exit=ExitRule("gate", 0.9)),
    "small": ModelConfig(vocab_size=4096, hidden=256, heads=4, kv_heads=2, head_dim=64,
                         intermediate=1024, n_prelude=2, n_core=6, n_coda=2, default_loops=4,
                         max_loops=32, max_position=4096, block_style="sandwich",
                         injection="concat_linear", state_init="randn"),
    "base100m": ModelConfig(vocab_size=32768, hidden=768, heads=12, kv_heads=12, head_dim=64,
                            intermediate=3072, n_prelude=2, n_core=4, n_coda=2, default_loops=4,
                            max_loops=32, max_position=4096, block_style="sandwich",
                            injection="concat_linear", state_init="randn"),
}

_INIT_STD = 0.02


class _Uninitialised(TorchFunctionMode):
    """While a model is built: ``torch.nn.init`` is skipped and, with ``meta``, parameter
    factories (``empty``, ``zeros``, ``ones``) go to the meta device.

    Not ``with torch.device("meta")``: meta ``arange``/``normal_``/``empty_like`` run through
    ``torch._refs``, which imports ``torch._dynamo`` and sympy: seconds on the first model of
    every process. A parameter made by another factory stays real: memory, not correctness.
    """

    _FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones})

    def __init__(self, *, meta: bool) -> None:
        super().__init__()
        self.meta = meta

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        if self.meta and func in self._FACTORIES:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def empty_model(config: ModelConfig, device: torch.device | str = "cpu") -> LoopedLM:
    """A ``LoopedLM`` whose parameters live on the meta device, its RoPE tables (built on first
    use) on ``device``.

    For ``load_state_dict(..., assign=True)``: no weight is allocated or initialised twice.
    """
    with _Uninitialised(meta=True):
        model = LoopedLM(config)
    model.rope = rope_for(config, device)
    return model


def _block_shapes(config: ModelConfig, value_embed: bool = False) -> dict[str, tuple[int, ...]]:
    """One ``Block``'s parameters in ``state_dict`` order (a module's own parameters before its
    children's); ``value_embed``: the block's attention adds value embeddings."""
    c, h = config, config.hidden
    out: dict[str, tuple[int, ...]] = {}
    if c.block_style != "post_ln":
        out |= {"attn_norm.weight": (h,), "mlp_norm.weight": (h,)}
    if c.block_style != "pre_ln":
        out |= {"attn_post_norm.weight": (h,), "mlp_post_norm.weight": (h,)}
    if c.qk_bias:
        out |= {"attn.q_bias": (c.heads, c.head_dim), "attn.k_bias": (c.kv_heads, c.head_dim)}
    if c.fused_qkv:
        out["attn.qkv.weight"] = (c.q_dim + 2 * c.kv_dim, h)
    else:
        out |= {"attn.q.weight": (c.q_dim, h), "attn.k.weight": (c.kv_dim, h), "attn.v.weight": (c.kv_dim, h)}
    if c.qk_norm:
        out |= {"attn.q_norm.weight": (c.q_dim,), "attn.k_norm.weight": (c.kv_dim,)}
    out["attn.o.weight"] = (h, c.q_dim)
    if value_embed:
        out |= {"attn.value_table.weight": (c.vocab_size, c.kv_dim),
                "attn.value_gate.weight": (c.kv_heads, VALUE_GATE_CHANNELS)}
    fc = c.intermediate if c.mlp == "relu2" else 2 * c.intermediate
    out |= {"mlp.fc.weight": (fc, h), "mlp.proj.weight": (h, c.intermediate)}
    return out


def state_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``LoopedLM(config).state_dict()``'s names and shapes, in its order, without building a
    module (the model's ``__init__`` is the reference: a test checks the two agree)."""
    c = config
    out: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, c.hidden)}
    layer = 0  # counted on through prelude, core and coda (value_embeds' numbering)
    for stack, count in (("prelude", c.n_prelude), ("core", c.n_core), ("coda", c.n_coda)):
        for i in range(count):
            block = _block_shapes(c, layer in c.value_embeds)
            out |= {f"{stack}.{i}.{name}": shape for name, shape in block.items()}
            layer += 1
    if c.prelude_norm:
        out["prelude_norm.weight"] = (c.hidden,)
    if c.injection == "concat_linear":
        out["adapter.weight"] = (c.hidden, 2 * c.hidden)
    elif c.injection == "diagonal":
        out |= {"adapter.A_log": (c.hidden,), "adapter.dt_bias": (c.hidden,), "adapter.B": (c.hidden, c.hidden)}
    if c.loop_output == "linear":
        out["loop_out.weight"] = (c.hidden, c.hidden)
    out["final_norm.weight"] = (c.hidden,)
    if not c.tie_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden)
    if c.has_exit_gate:
        out |= {"exit_gate.weight": (1, c.hidden), "exit_gate.bias": (1,)}
    return out


def _gate_bias(config: ModelConfig) -> float:
    """A per-loop exit probability whose cumulative CDF reaches the threshold at ``default_loops``.

    With a constant probability p per loop, the CDF after L loops is ``1 - (1 - p)^L``; solving
    for the threshold at L = default_loops means a random model neither exits at once nor never.
    """
    loops = max(config.default_loops, config.exit.min_loops)
    p = 1.0 - (1.0 - config.exit.threshold) ** (1.0 / loops)
    p = min(max(p, 1e-4), 1.0 - 1e-4)
    return math.log(p / (1.0 - p))


@torch.no_grad()
def init_model(config: ModelConfig, seed: int = 0) -> LoopedLM:
    """A float32 CPU model with deterministic random weights: the same (config, seed), the same bits.

    Weights ~ N(0, 0.02); the residual-branch output projections are scaled by
    ``1/sqrt(2 * L_eff)`` (GPT-2), with ``L_eff`` the layers a token passes through at the
    default loop count; norms at 1; q/k biases at 0; the exit gate's bias from ``_gate_bias``.
    The global torch RNG is untouched.
    """
    with _Uninitialised(meta=False):
        model = LoopedLM(config)  # uninitialised CPU memory, every parameter is written below
    generator = torch.Generator().manual_seed(seed)
    depth = config.n_prelude + config.n_core * config.default_loops + config.n_coda
    out_std = _INIT_STD / math.sqrt(2 * depth)
    out_projections = set()
    for module in model.modules():
        if isinstance(module, Attention):
            out_projections.add(id(module.o.weight))
        elif isinstance(module, MLP):
            out_projections.add(id(module.proj.weight))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(("q_bias", "k_bias")):
            param.zero_()
        elif name == "exit_gate.bias":
            param.fill_(_gate_bias(config))
        else:
            std = out_std if id(param) in out_projections else _INIT_STD
            param.normal_(0.0, std, generator=generator)
    return model.eval()


def param_count(config: ModelConfig) -> int:
    """Parameters stored for ``config`` (a tied head counts once)."""
    return sum(math.prod(shape) for shape in state_shapes(config).values())
