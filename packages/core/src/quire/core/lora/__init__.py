"""LoRA adapters served beside their base model: the request type (``LoRARequest``), the adapter's
torch-free description (``adapter_config``), and, in the worker, the layers and slots that apply them
(``layers``, ``manager``)."""

from quire.core.lora.request import LoRARequest

__all__ = ["LoRARequest"]
