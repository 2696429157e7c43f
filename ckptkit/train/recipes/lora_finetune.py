"""LoRA fine-tuning on one device (CPU or CUDA).

Run it as ``ckptkit run lora_finetune --config CONFIG [key=value ...]`` or as
``python lora_finetune.py --config CONFIG [key=value ...]`` after ``ckptkit cp``.

The training loop (:mod:`ckptkit.train.loop`) with LoRA adapters on a frozen base
(:class:`~ckptkit.train.trainable.LoRAAdapters`) on one device
(:class:`~ckptkit.train.placement.SingleDevice`). Checkpoints hold the adapter in PEFT's
format and, per ``lora.save_merged``, the merged model in the input's format.
"""

from ckptkit.train.loop import entry_point

recipe_main = entry_point("lora_finetune", __name__, __doc__)
