"""LoRA adapters: the request that names one (``request.py``) and reading PEFT's files
(``adapter.py``). The model applies them (``model/layers/lora.py``); the scheduler keys prefix
blocks by them and limits how many run at once (``SchedulerConfig.max_loras``)."""
