"""Full fine-tuning on one device (CPU or CUDA).

Run it as ``ckptkit run full_finetune --config CONFIG [key=value ...]`` or as
``python full_finetune.py --config CONFIG [key=value ...]`` after ``ckptkit cp``.

The training loop (:mod:`ckptkit.train.loop`) with every weight trainable
(:class:`~ckptkit.train.trainable.FullWeights`) on one device
(:class:`~ckptkit.train.placement.SingleDevice`). Checkpoints are in the input's format,
file names and shard partition; resuming ends bitwise where an uninterrupted run does.
"""

from ckptkit.train.loop import entry_point

recipe_main = entry_point("full_finetune", __name__, __doc__)
