"""LoRA fine-tuning on several devices or nodes: FSDP2 launched by torchrun.

Run it as ``ckptkit run --nproc-per-node N lora_finetune_distributed --config CONFIG [key=value ...]``
or as ``torchrun --nproc-per-node N -m ckptkit.train.recipes.lora_finetune_distributed --config ...``.

The training loop (:mod:`ckptkit.train.loop`) with LoRA adapters on a frozen base
(:class:`~ckptkit.train.trainable.LoRAAdapters`), sharded with FSDP2
(:class:`~ckptkit.train.placement.FSDP2`): ``batch_size`` is per rank, merged weights are
gathered and merged one tensor at a time, ``recipe_state/`` is a DCP checkpoint.
"""

from ckptkit.train.loop import entry_point

recipe_main = entry_point("lora_finetune_distributed", __name__, __doc__)
