"""Runtime and server settings: one dataclass, filled from ``TINYLOOP_*`` variables and flags.

Each field's metadata names its environment variable and its help text; ``tinyloop serve`` turns
the same table into command-line flags, so a variable and its flag cannot drift apart. A flag
beats the variable; the variable beats the default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, get_args, get_type_hints

from tinyloop.errors import ConfigError
from tinyloop.vocabulary import KVMode

__all__ = ["Settings", "BUNDLED_MODEL", "usable_cores"]

BUNDLED_MODEL = "demo.tinyloop"  # in tinyloop/data/, served when no model path is set
DEFAULT_CONTEXT = 2048  # TINYLOOP_MAX_SEQ_LEN's floor when it is not set


def _opt(default: Any, env: str, help: str) -> Any:
    return field(default=default, metadata={"env": env, "help": help})


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a runtime and its server can be configured with."""

    model_path: str | None = _opt(None, "TINYLOOP_MODEL_PATH",
                                  "path to the .tinyloop artifact or a Hugging Face model directory "
                                  "(default: the bundled demo model)")
    cache_dir: str | None = _opt(None, "TINYLOOP_CACHE_DIR",
                                 "where a Hugging Face model directory given as the model is kept once "
                                 "converted (default: $XDG_CACHE_HOME/tinyloop or ~/.cache/tinyloop)")
    max_tokenizer_mb: float = _opt(64.0, "TINYLOOP_MAX_TOKENIZER_MB",
                                   "the largest tokenizer.json a Hugging Face model directory may hold, in MiB")
    max_json_mb: float = _opt(16.0, "TINYLOOP_MAX_JSON_MB",
                              "the largest of a model directory's other JSON files (config.json, "
                              "tokenizer_config.json, generation_config.json, the shard index), in MiB")
    chat_template_timeout: float = _opt(5.0, "TINYLOOP_CHAT_TEMPLATE_TIMEOUT",
                                        "seconds one chat-template render may take (then a 500 "
                                        "chat_template_error)")
    served_model_name: str | None = _opt(None, "TINYLOOP_SERVED_MODEL_NAME",
                                         "model id shown to clients (default: the artifact's file name)")
    max_seq_len: int | None = _opt(None, "TINYLOOP_MAX_SEQ_LEN",
                                   "max prompt + generated tokens per request (default: the model's context, "
                                   "at least 2048, down to what the KV cache holds for one sequence at the "
                                   "default loops)")
    default_loops: int | None = _opt(None, "TINYLOOP_DEFAULT_LOOPS",
                                     "loops a request runs at when it names none; a request's own loops still "
                                     "win (default: the model's default_loops; at most its max_loops)")
    device: str = _opt("cpu", "TINYLOOP_DEVICE", "cpu or cuda")
    engines: int = _opt(1, "TINYLOOP_ENGINES",
                        "engines under the one scheduler, each with its own batch, KV pool and prefix cache "
                        "(on CPU they share the weights and split the cores)")
    devices: str | None = _opt(None, "TINYLOOP_DEVICES",
                               "comma-separated CUDA device indices, one engine on each (sets engines)")
    threads: int | None = _opt(None, "TINYLOOP_THREADS",
                               "torch threads each CPU engine computes on (default: the usable cores less "
                               "one, which the HTTP event loop keeps, split among the CPU engines; at least 1)")
    kernel_threads: int | None = _opt(None, "TINYLOOP_KERNEL_THREADS",
                                      "threads the CPU C kernels split products of several rows and decode "
                                      "attention over (default: the usable cores, split among the CPU engines; "
                                      "a helper takes work only while its core is free, so the event loop's "
                                      "core is lent, not taken)")
    dtype: str | None = _opt(None, "TINYLOOP_DTYPE", "float32, bfloat16 or float16 (default: the artifact's)")
    kv_cache_mb: float | None = _opt(None, "TINYLOOP_KV_CACHE_MB", "KV cache budget in MiB")
    kv_block_size: int = _opt(16, "TINYLOOP_KV_BLOCK_SIZE", "tokens per KV block")
    kv_int4: bool = _opt(False, "TINYLOOP_KV_INT4", "store KV as 4-bit with per-group scales")
    kv_h_mode: bool = _opt(False, "TINYLOOP_KV_H_MODE", "store the attention input h and recompute K,V")
    h_mode_fp16_attn_qkv: bool = _opt(False, "TINYLOOP_H_MODE_FP16_ATTN_QKV",
                                      "with h-mode: store h and recompute K,V in fp16 "
                                      "(bfloat16 on CPU)")
    prefill_chunk: int = _opt(512, "TINYLOOP_PREFILL_CHUNK", "prompt tokens per prefill step")
    max_batch_size: int = _opt(8, "TINYLOOP_MAX_BATCH_SIZE", "sequences decoded together (1 = one at a time)")
    max_queue_depth: int = _opt(128, "TINYLOOP_MAX_QUEUE_DEPTH", "queued requests before 503")
    default_slo_ms: float | None = _opt(None, "TINYLOOP_DEFAULT_SLO_MS",
                                        "SLO for requests that name none; admission rejects past it")
    priority_aging_ms: float = _opt(1000.0, "TINYLOOP_PRIORITY_AGING_MS",
                                    "a queued request gains one priority level per this many ms (0 = off)")
    downgrade_on_admission: bool = _opt(False, "TINYLOOP_DOWNGRADE_ON_ADMISSION",
                                        "admit at fewer loops instead of rejecting for the SLO")
    downgrade_min_loops: int = _opt(1, "TINYLOOP_DOWNGRADE_MIN_LOOPS", "the lowest loops a downgrade may pick")
    kv_aging_ms: float = _opt(2000.0, "TINYLOOP_KV_AGING_MS",
                              "a request waiting for KV lets later ones that fit start first for at "
                              "most this many ms, then nothing starts before it")
    max_draft_nodes: int = _opt(64, "TINYLOOP_MAX_DRAFT_NODES",
                                "speculative draft tokens per engine step, shared by its sequences")
    draft_min_prob: float = _opt(0.2, "TINYLOOP_DRAFT_MIN_PROB",
                                 "a speculative chain stops at a draft token the draft gives less than this "
                                 "probability (0 = always draft_ahead)")
    decode_burst: int = _opt(8, "TINYLOOP_DECODE_BURST",
                             "tokens a lone greedy request decodes per engine step in one C call (1-64; 1: one "
                             "a step); a request arriving meanwhile waits for the burst")
    draft_weights: str = _opt("int8", "TINYLOOP_DRAFT_WEIGHTS",
                              "weights speculative drafts run on: int8 (a quantized twin of a float32 CPU "
                              "model's linear weights, a quarter more weight memory; the verify keeps the "
                              "model's weights, so outputs do not change) or same (the model's)")
    prefix_caching: bool = _opt(True, "TINYLOOP_PREFIX_CACHING",
                                "keep full KV blocks of ended requests for reuse by shared prompt prefixes")
    prefix_pool_capacity: int = _opt(16, "TINYLOOP_PREFIX_POOL_CAPACITY", "entries in the prefix pool (LRU)")
    pack_weights: bool = _opt(True, "TINYLOOP_PACK_WEIGHTS",
                              "float32 CPU weights re-laid for fast decode, plus a blocked copy for batches "
                              "(twice the weights' memory)")
    cpu_kernels: bool = _opt(True, "TINYLOOP_CPU_KERNELS",
                             "CPU decode attention on a C kernel built with the system C compiler on first use "
                             "(cached); torch ops where there is no compiler, or with 0")
    cuda_kernels: bool = _opt(False, "TINYLOOP_CUDA_KERNELS",
                              "on a CUDA device, RMSNorm (fused with the residual adds), SwiGLU, RoPE, the KV "
                              "write and paged decode attention on the CuPy kernels (tinyloop/cuda; the cuda "
                              "extra); off: torch ops")
    cuda_graphs: bool = _opt(False, "TINYLOOP_CUDA_GRAPHS",
                             "on a CUDA device, decode steps captured as CUDA graphs (per batch bucket and "
                             "largest loop count, rows of any loops and window, on first use) and replayed")
    weights: str = _opt("float", "TINYLOOP_WEIGHTS",
                        "linear weights at load: float (as stored), int8 (per channel), int4 (groups of 32) "
                        "or bf16 (a bfloat16 model's default on the CPU with the C kernels); CPU, float32 "
                        "activations")
    host: str = _opt("127.0.0.1", "TINYLOOP_HOST", "address to bind")
    port: int = _opt(8000, "TINYLOOP_PORT", "port to bind")
    api_key: str | None = _opt(None, "TINYLOOP_API_KEY",
                               "require 'Authorization: Bearer KEY' (all but /healthz and /health)")
    cors_origins: str | None = _opt(None, "TINYLOOP_CORS_ORIGINS", "comma-separated origins allowed by CORS")
    max_body_bytes: int = _opt(4 * 2**20, "TINYLOOP_MAX_BODY_BYTES", "largest request body accepted (413 past it)")
    max_prompt_chars: int = _opt(1_000_000, "TINYLOOP_MAX_PROMPT_CHARS",
                                 "characters of prompt text (all messages together) a request may carry "
                                 "(413 past it)")
    max_messages: int = _opt(4096, "TINYLOOP_MAX_MESSAGES", "chat messages a request may carry (413 past it)")
    graceful_timeout: float = _opt(30.0, "TINYLOOP_GRACEFUL_TIMEOUT", "seconds in-flight requests get on shutdown")
    commit: str | None = _opt(None, "TINYLOOP_COMMIT", "commit string reported in LM Studio's runtime.commit")
    keep_alive_timeout: float = _opt(30.0, "TINYLOOP_KEEP_ALIVE_TIMEOUT",
                                     "seconds an idle keep-alive connection stays open")
    send_timeout: float = _opt(60.0, "TINYLOOP_SEND_TIMEOUT",
                               "seconds a response waits for its client to take more of it (nginx's send_timeout); "
                               "then the request is cancelled and the connection reset")
    allowed_hosts: str | None = _opt(None, "TINYLOOP_ALLOWED_HOSTS",
                                     "comma-separated Host names accepted besides localhost names "
                                     "and the bound address (* accepts any)")
    access_log: bool = _opt(False, "TINYLOOP_ACCESS_LOG",
                             "log one line per HTTP request to stderr: client, method, path, status and "
                             "duration in ms")

    def __post_init__(self) -> None:
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ConfigError("max_seq_len must be >= 1")
        for name in ("kv_block_size", "prefill_chunk", "max_batch_size", "engines",
                     "max_queue_depth", "prefix_pool_capacity", "downgrade_min_loops", "max_body_bytes",
                     "max_draft_nodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.default_loops is not None and self.default_loops < 1:
            raise ConfigError("default_loops must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be >= 1")
        if self.kernel_threads is not None and self.kernel_threads < 1:
            raise ConfigError("kernel_threads must be >= 1")
        if min(self.max_prompt_chars, self.max_messages) < 1:
            raise ConfigError("max_prompt_chars and max_messages must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port must be in 0..65535")
        if self.priority_aging_ms < 0 or self.graceful_timeout < 0 or self.kv_aging_ms < 0:
            raise ConfigError("priority_aging_ms, kv_aging_ms and graceful_timeout must be >= 0")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.devices is not None:
            indices = self.devices.split(",")
            if not all(i.strip().isdigit() for i in indices) or len(set(indices)) != len(indices):
                raise ConfigError(f"devices must be distinct CUDA device indices such as 0,1, got {self.devices!r}")
        if (self.cuda_kernels or self.cuda_graphs) and self.device == "cpu" and self.devices is None:
            raise ConfigError("cuda_kernels and cuda_graphs need a CUDA device (--device cuda or --devices)")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.keep_alive_timeout <= 0:
            raise ConfigError("keep_alive_timeout must be > 0")
        if not self.send_timeout > 0:
            raise ConfigError("send_timeout must be > 0")
        for name in ("max_tokenizer_mb", "max_json_mb", "chat_template_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if not 0 <= self.draft_min_prob <= 1:
            raise ConfigError("draft_min_prob must be in [0, 1]")
        if not 1 <= self.decode_burst <= 64:
            raise ConfigError("decode_burst must be in 1..64")
        if self.draft_weights not in ("same", "int8"):
            raise ConfigError(f"draft_weights must be same or int8, got {self.draft_weights!r}")
        if self.weights not in ("float", "int8", "int4", "bf16"):
            raise ConfigError(f"weights must be float, int8, int4 or bf16, got {self.weights!r}")
        _ = self.kv_mode  # ConfigError for an impossible combination (fp16 qkv without h-mode)

    @staticmethod
    def fields() -> list[dataclasses.Field[Any]]:
        return list(dataclasses.fields(Settings))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``TINYLOOP_*`` variables, then ``overrides`` (flags) on top."""
        environ = os.environ if environ is None else environ
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in cls.fields():
            raw = environ.get(f.metadata["env"])
            if raw is not None and raw != "":
                values[f.name] = _parse(raw, hints[f.name], f.metadata["env"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def context_for(self, config_max_position: int) -> int | None:
        """The ``max_seq_len`` to load a model with: the one set, else at least the seeds' 2048
        for a model built for less (its RoPE table is extended) and None (the model's own
        context, which the engine fits to the KV cache) for one built for more."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return DEFAULT_CONTEXT if config_max_position < DEFAULT_CONTEXT else None

    def resolve_model_path(self) -> Path:
        """``model_path``, or the bundled demo model when none is set."""
        if self.model_path:
            return Path(self.model_path)
        path = Path(str(files("tinyloop") / "data" / BUNDLED_MODEL))
        if not path.exists():
            raise ConfigError(f"no model given and the bundled demo model is missing ({path}); "
                              "set TINYLOOP_MODEL_PATH or pass --model")
        return path

    @property
    def engine_devices(self) -> list[str]:
        """The device of each engine: ``cuda:i`` for each index of ``devices``, else ``engines``
        times ``device``."""
        if self.devices is not None:
            return [f"cuda:{int(i)}" for i in self.devices.split(",")]
        return [self.device] * self.engines

    @property
    def cpu_threads(self) -> int:
        """The torch threads of each CPU engine: ``threads``, else the usable cores
        (``usable_cores``) less one (the event loop's: HTTP, SSE and the actors run on it while
        an engine steps) split among the CPU engines, at least 1."""
        if self.threads is not None:
            return self.threads
        return max(1, (usable_cores() - 1) // self._cpu_engines)

    @property
    def cpu_kernel_threads(self) -> int:
        """The threads of the CPU C kernels (one pool in the process): ``kernel_threads``, else
        the usable cores split among the CPU engines, at least 1. Unlike torch's threads they
        include the event loop's core: a kernel's helper claims work only when it runs, so a
        busy event loop delays no product (``cpu.kernels.set_threads``)."""
        if self.kernel_threads is not None:
            return self.kernel_threads
        return max(1, usable_cores() // self._cpu_engines)

    @property
    def _cpu_engines(self) -> int:
        """The engines on the CPU (at least 1: what the CPU's threads are split among)."""
        return max(1, sum(1 for d in self.engine_devices if d == "cpu"))

    @property
    def kv_mode(self) -> KVMode:
        """The KV cache mode the three KV flags select (they combine)."""
        return KVMode(int4=self.kv_int4, h_mode=self.kv_h_mode, fp16_qkv=self.h_mode_fp16_attn_qkv)

    @property
    def kv_cache_mode(self) -> str:
        """The KV mode name reported as ``model_info.kv_cache_mode``: ``full``, ``int4``,
        ``h-mode``, ``h-mode+int4``, ``h-mode-fp16-qkv``, ``h-mode-fp16-qkv+int4``."""
        return self.kv_mode.name


def usable_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may compute on: its CPU affinity, capped by a cgroup CPU quota (a
    container's ``--cpus``, a Kubernetes CPU limit: v2's ``cpu.max``, v1's ``cpu.cfs_quota_us``),
    rounded down, at least 1."""
    cores = len(os.sched_getaffinity(0))
    quota = _cpu_quota(cgroup)
    return max(1, min(cores, int(quota))) if quota is not None else cores


def _cpu_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time the cgroup allows per period; None where unlimited or unreadable."""
    try:
        v2 = cgroup / "cpu.max"
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = cgroup / "cpu"
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        return None if quota_us < 0 else quota_us / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def _parse(raw: str, kind: Any, env: str) -> Any:
    base = next((a for a in get_args(kind) if a is not type(None)), kind)
    try:
        if base is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return base(raw)
    except ValueError:
        raise ConfigError(f"{env}={raw!r} is not a valid {base.__name__}") from None
