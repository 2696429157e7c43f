"""Groups of config fields that several families have and the native decoder reads: a family's
:class:`~ckptkit.models.config.FamilyFields` inherits the groups it uses (experts:
:class:`ckptkit.models.moe.MoEFields`)."""

from __future__ import annotations

from dataclasses import dataclass

from ckptkit.models.config import FamilyFields
from ckptkit.models.fields import optional, positive_float, positive_int


@dataclass
class SlidingWindow(FamilyFields):
    """Attention in a window of ``sliding_window`` tokens, in the layers the family says
    (:meth:`~ckptkit.models.family.Family.sliding_windows`; None: no window)."""

    checks = {"sliding_window": optional(positive_int)}

    sliding_window: int | None = None


@dataclass
class SoftCapping(FamilyFields):
    """Gemma 2's attention: scale ``query_pre_attn_scalar ** -0.5``, scores and output logits
    capped as ``cap * tanh(x / cap)`` (None: the default scale, no cap)."""

    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


@dataclass
class LocalRope(FamilyFields):
    """A rope base of their own for the sliding-window layers (Gemma 3)."""

    local_rope_theta: float | None = None


@dataclass
class PartialRotary(FamilyFields):
    """Rope on this fraction of ``head_dim`` only (Phi-3)."""

    checks = {"partial_rotary_factor": positive_float}
    partial_rotary_factor: float = 1.0
