"""What every quantization method answers: the protocol of one ``quant_method``, and the
registry that picks the method a ``quantization_config`` names.

A method is one module (``fp8.py``; compressed-tensors, MXFP4, NVFP4 and Mistral's
``qscale`` each one more) with a :class:`QuantMethod` subclass registered by the
``quant_method`` values it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ckptkit.errors import CkptkitError

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    import torch

    from ckptkit.tensors.lazy import Lazy


class Stored(Protocol):
    """A stored tensor's metadata (a format's ``TensorInfo``)."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def file(self) -> str: ...


class QuantMethod:
    """One ``quant_method``: which stored tensors are quantized weights and which their
    scales, and the arithmetic (dequantize, re-quantize with given scales, quantize).

    Attributes:
        name: the ``quant_method`` value it writes.
        stored: the dtype name its quantized weights are stored in.
        config: the ``quantization_config`` as the checkpoint carries it.
    """

    name: ClassVar[str]
    stored: str  # a class attribute, or set per config
    skip_key = "modules_to_not_convert"  # the config's list of modules left unquantized
    keepable = True  # whether formats that hold quantized weights may carry it as stored
    ggml_type: ClassVar[str | None] = None  # the GGML type llama.cpp's converter keeps it in (repacked)

    def __init__(self, config: Mapping[str, Any], where: Path) -> None:
        self.config = dict(config)
        self.where = where

    @classmethod
    def for_config(cls, config: Mapping[str, Any], where: Path) -> QuantMethod:
        """The method reading ``config`` (a ``quant_method`` may have variants: modelopt's ``quant_algo``)."""
        return cls(config, where)

    def scale_name(self, weight: str) -> str:
        """The name of ``weight``'s scale tensor (native or canonical names alike)."""
        raise NotImplementedError

    def scale_names(self, weight: str) -> tuple[str, ...]:
        """The names of all of ``weight``'s scale tensors, :meth:`scale_name` first (NVFP4 has two)."""
        return (self.scale_name(weight),)

    def stored_name(self, weight: str) -> str:
        """The name weight ``weight`` is stored under (compressed-tensors' packed ``X.weight_packed``);
        by default its own."""
        return weight

    def model_name(self, stored: str) -> str | None:
        """The weight a tensor stored as ``stored`` is (:meth:`stored_name`'s inverse), or None:
        not a renamed weight."""
        return None

    def combined(self, scales: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The one scale tensor the arithmetic takes, of a weight's :meth:`scale_names` tensors."""
        return scales[0]

    def weight_of_scale(self, name: str) -> str | None:
        """The weight a tensor of this name is the scale of, or None: not a scale name."""
        raise NotImplementedError

    def is_activation_scale(self, name: str) -> bool:
        """Whether ``name`` is an activation-only scale (no weight; dropped on read)."""
        raise NotImplementedError

    def keeps_unquantized(self, name: str) -> bool:
        """Whether the config leaves weight ``name`` unquantized (``modules_to_not_convert``)."""
        raise NotImplementedError

    def reads_as_quantized(self, native: str) -> bool:
        """Whether a quantized weight stored under the name ``native`` is read back as one
        (a method that finds each weight's scheme by module name needs the config to name it)."""
        return True

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the scale of a weight of ``shape``."""
        raise NotImplementedError

    def check_pair(self, weight: Stored, scale: Stored) -> None:
        """A one-line error unless ``scale`` has the shape and dtype ``weight``'s scale must have."""
        raise NotImplementedError

    def check_scale_values(self, scale: torch.Tensor, name: str) -> None:
        """A one-line error naming ``name`` for a scale no dequantization may use (NaN, inf);
        by default :meth:`check_scale_array` of its values."""
        import torch

        from ckptkit.tensors.dtypes import dtype_name

        self.check_scale_array(scale.to(torch.float32).numpy(), dtype_name(scale.dtype), name)

    def check_scale_array(self, values: np.ndarray, stored: str, name: str) -> None:
        """:meth:`check_scale_values` of a scale stored as ``stored``, given as float32 values
        (:func:`ckptkit.tensors.float_bits.as_float32`)."""
        raise NotImplementedError

    @property
    def checks_arrays(self) -> bool:
        """Whether :meth:`check_scale_array` is the whole check of a scale (no torch needed):
        the method gives it and checks nothing more."""
        cls = type(self)
        return (
            cls.check_scale_values is QuantMethod.check_scale_values
            and cls.check_scale_array is not QuantMethod.check_scale_array
        )

    def settle(self, pairs: Mapping[str, tuple[Stored, ...]], read: Callable[[str], torch.Tensor]) -> None:
        """Settle what the stored shapes leave open from the values of the weights' small
        companion tensors ``pairs`` (weight -> its scales' metadata; ``read`` by stored name),
        before any shape is shown: by default nothing is open."""

    def block_rows(self) -> int:
        """How many rows one scale covers (a row permutation within such groups keeps the scales)."""
        raise NotImplementedError

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The reference dequantization of ``weight`` with its ``scale``, in ``dtype``."""
        raise NotImplementedError

    def model_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the model config implies for a weight stored in ``shape`` under its own
        name (NVFP4: two values a byte); by default the same."""
        return tuple(shape)

    def dequantized_as(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """The name and shape weight ``name`` of stored ``shape`` has once dequantized
        (:meth:`loaded`'s result): by default the same."""
        return name, shape

    def loaded(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight as the model holds it (:meth:`dequantize`'s by default)."""
        return self.dequantize(weight, scale, dtype)

    def loaded_pieces(
        self, weight: Lazy, scales: tuple[Lazy, ...], dtype: str, lead: int = 0
    ) -> Iterator[torch.Tensor | memoryview]:
        """:meth:`loaded`'s result in ``dtype`` flat, in order, a piece at a time (a tensor,
        or its bytes), each valid until the one after the next is asked for (written while
        the next is made), of the stored ``weight`` with its ``scales`` (:meth:`scale_names`
        order; read whole, or a piece at a time where the method can); by default one piece.
        ``lead``: where in a page the output's first byte goes (:attr:`Lazy.pieces`)."""
        from ckptkit.tensors.dtypes import to_torch

        yield self.loaded(weight.get(), self.scale_of(scales), to_torch(dtype)).reshape(-1)

    def scale_of(self, scales: tuple[Lazy, ...]) -> torch.Tensor:
        """:meth:`combined` of the stored ``scales``, read."""
        return self.combined(tuple(s.get() for s in scales))

    def unloaded(self, values: torch.Tensor) -> torch.Tensor:
        """:meth:`loaded`'s layout back to :meth:`dequantize`'s (the same by default)."""
        return values

    def requantize(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``values`` quantized with the given ``scale`` (the inverse of :meth:`dequantize`)."""
        raise NotImplementedError

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(quantized weight, scale) of ``values``, as the method's releases are made."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What ``inspect`` shows: method, block shape, stored and scale dtypes."""
        raise NotImplementedError


METHODS: dict[str, type[QuantMethod]] = {}


E8M0_NAN = 0xFF  # the one NaN code of float8 e8m0 (no inf, no sign)


def check_e8m0_codes(codes: np.ndarray, name: str) -> None:
    """A one-line error naming ``name`` when the e8m0 scale bytes ``codes`` (uint8) hold NaN codes."""
    e8m0_nans(int((codes == E8M0_NAN).sum()), name)


def e8m0_nans(count: int, name: str) -> None:
    """A one-line error naming ``name`` when ``count`` e8m0 scales are NaN (the code 0xFF)."""
    if count:
        raise CkptkitError(f"{name}: {count} scale(s) are the e8m0 NaN code 0xFF; the checkpoint is corrupt")


def check_finite_nonnegative(values: np.ndarray, name: str, what: str) -> None:
    """A one-line error naming ``name`` when float ``values`` hold NaN, inf or negative values
    (``what``: the kind of tensor it should be)."""
    import numpy as np

    finite = np.isfinite(values)
    if not finite.all():
        raise CkptkitError(f"{name}: {int((~finite).sum())} scale(s) are NaN or infinite; the checkpoint is corrupt")
    if (values < 0).any():
        raise CkptkitError(f"{name}: negative scales; not a {what}")


def register_method(cls: type[QuantMethod], *names: str) -> None:
    for name in names or (cls.name,):
        METHODS[name] = cls


def method_for(config: Any, where: Path) -> QuantMethod:
    """The method ``quantization_config`` ``config`` names; one line for an unknown one."""
    if not isinstance(config, dict):
        raise CkptkitError(f"{where}: quantization_config is not a JSON object")
    name = config.get("quant_method")
    cls = METHODS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CkptkitError(
            f"{where}: quantization_config names quant_method {name!r}, which ckptkit does not read "
            f"(it reads {', '.join(sorted(METHODS))}); nothing converted"
        )
    return cls.for_config(config, where)
