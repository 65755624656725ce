"""LoRARequest: which adapter a request runs under (vLLM's ``vllm.lora.request``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name``: how clients call it; ``lora_int_id``: its id, >= 1, unique per adapter
    (it keys the adapter's prefix-cache blocks); ``lora_path``: a PEFT adapter directory
    (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, "
                             f"got {self.lora_name!r}")
        i = self.lora_int_id
        if not isinstance(i, int) or isinstance(i, bool) or i < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {i!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a path, got {self.lora_path!r}")
