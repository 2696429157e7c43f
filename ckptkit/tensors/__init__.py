"""Tensors as ckptkit handles them between formats: lazy tensors that say where their bytes
lie (``lazy``), the reversible transforms between native and canonical layouts
(``transforms``), dtype names (``dtypes``) and the ``--dtype`` casts that refuse to lose
values silently (``casting``)."""
