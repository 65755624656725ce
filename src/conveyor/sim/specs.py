"""Hardware and model specs for the simulator: dataclasses, loaded from YAML files.

Built-in specs live in ``conveyor/sim/specs/{hardware,models}/<name>.yaml`` (package data);
``load_hardware`` / ``load_model`` also accept a path to a YAML file of the same shape.
Every field is checked on load; a bad file raises ``ValueError`` naming the file and field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from conveyor.model.shape import ModelShape

GB = 1e9  # datasheets quote decimal gigabytes (memory size and bandwidth)


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or this CPU) as the cost model sees it.

    Peak rates are datasheet (or measured) numbers; the ``*_efficiency`` factors are the
    fraction of peak a real kernel reaches, so ``peak * efficiency`` is what the model uses.
    """

    name: str
    memory_gb: float  # device memory (decimal GB)
    peak_matrix_tflops: float  # dense bf16/fp16 matrix rate
    memory_bandwidth_gbs: float  # device memory bandwidth (GB/s)
    description: str = ""
    interconnect_bandwidth_gbs: float = 0.0  # per GPU, per direction (NVLink / PCIe); 0: no TP
    interconnect_latency_us: float = 0.0  # fixed cost of one all-reduce
    host_link_bandwidth_gbs: float = 16.0  # device <-> host, for KV swap
    matmul_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    step_overhead_ms: float = 0.0  # fixed cost of one engine step (launches, Python, sampling)
    per_seq_overhead_us: float = 0.0  # per-sequence bookkeeping cost of one step
    memory_utilization: float = 0.9  # share of memory the engine may use (weights + KV + reserve)
    activation_reserve_gb: float = 0.0  # memory kept for activations / workspace
    max_tp: int = 1  # largest tensor-parallel group one node of this hardware offers
    # Steps of 1..low_bit_max_tokens tokens read the layers' matmul weights at
    # low_bit_weight_bytes per parameter instead of the model's dtype (Conveyor's CPU engine
    # keeps a GGUF's 4-bit blocks for matmuls of <= 4 rows: 0.625 B/param with scales).
    low_bit_max_tokens: int = 0
    low_bit_weight_bytes: float = 0.0
    source: str = ""  # where the numbers come from

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GB


@dataclass
class ModelSpec(ModelShape):
    """A Llama-family decoder (Llama, Qwen2/3, SmolLM2; Gemma 3 with its sliding-window layers):
    its shape (``ModelShape``'s fields, keyword-only) and the bytes the engine holds it in,
    which FLOPs and bytes depend on."""

    name: str
    weight_bytes: float = 2.0  # bytes per parameter as the engine holds them (bf16: 2)
    kv_cache_bytes: float = 2.0  # bytes per K or V element
    description: str = ""
    source: str = ""

    @property
    def num_params(self) -> int:
        embeddings = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.matmul_params + embeddings + norms

    @property
    def weight_bytes_total(self) -> float:
        return self.num_params * self.weight_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token across all layers."""
        return self.kv_elements_per_token * self.kv_cache_bytes


_REQUIRED_POSITIVE = {
    HardwareSpec: ("memory_gb", "peak_matrix_tflops", "memory_bandwidth_gbs"),
    ModelSpec: ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "weight_bytes",
                "kv_cache_bytes"),
}
_FRACTIONS = ("matmul_efficiency", "attention_efficiency", "memory_efficiency",
              "memory_utilization")


def _spec_dir(kind: str):
    return resources.files("conveyor.sim").joinpath("specs", kind)


def list_specs(kind: str) -> list[str]:
    """Names of the built-in specs of ``kind`` ("hardware" or "models")."""
    return sorted(p.name[:-5] for p in _spec_dir(kind).iterdir() if p.name.endswith(".yaml"))


def _read(kind: str, name_or_path: str | Path) -> tuple[dict, str]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ValueError(f"{kind} spec file not found: {path}")
        text, where = path.read_text(), str(path)
    else:
        entry = _spec_dir(kind).joinpath(f"{name_or_path}.yaml")
        if not entry.is_file():
            raise ValueError(f"unknown {kind} spec {str(name_or_path)!r}; built-in: "
                             f"{', '.join(list_specs(kind))} (or a path to a .yaml file)")
        text, where = entry.read_text(), f"{kind}/{name_or_path}.yaml"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of field: value, got {type(data).__name__}")
    return data, where


def _build(cls, data: dict, where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(fields)}")
    missing = [n for n, f in fields.items()
               if n not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: missing required field(s) {', '.join(missing)}")
    values = {}
    for name, value in data.items():
        kind = fields[name].type
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError(f"{where}: field {name} must be a string, got {value!r}")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{where}: field {name} must be true or false, got {value!r}")
        elif kind == "int":
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{where}: field {name} must be an integer, got {value!r}")
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{where}: field {name} must be a number, got {value!r}")
            value = float(value)
        values[name] = value
    values = {n: f.default for n, f in fields.items()
              if f.default is not dataclasses.MISSING} | values
    for name in _REQUIRED_POSITIVE[cls]:
        if values[name] <= 0:
            raise ValueError(f"{where}: field {name} must be > 0, got {values[name]!r}")
    for name, value in values.items():
        if isinstance(value, float) and value < 0:
            raise ValueError(f"{where}: field {name} must be >= 0, got {value!r}")
        if name in _FRACTIONS and not 0 < value <= 1:
            raise ValueError(f"{where}: field {name} must be in (0, 1], got {value!r}")
    if cls is ModelSpec:
        for name in ("sliding_window", "sliding_window_pattern"):
            if values[name] < 0:
                raise ValueError(f"{where}: field {name} must be >= 0, got {values[name]!r}")
    if cls is ModelSpec and values["num_heads"] % values["num_kv_heads"]:
        raise ValueError(f"{where}: num_heads ({values['num_heads']}) must be a multiple of "
                         f"num_kv_heads ({values['num_kv_heads']})")
    if cls is HardwareSpec and values["max_tp"] < 1:
        raise ValueError(f"{where}: field max_tp must be >= 1, got {values['max_tp']!r}")
    return cls(**values)


def load_hardware(name_or_path: str | Path) -> HardwareSpec:
    data, where = _read("hardware", name_or_path)
    return _build(HardwareSpec, data, where)


def load_model(name_or_path: str | Path) -> ModelSpec:
    data, where = _read("models", name_or_path)
    return _build(ModelSpec, data, where)
