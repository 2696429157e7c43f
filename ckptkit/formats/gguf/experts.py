"""Mixture-of-experts tensors in GGUF: a layer's experts merged into one 3-D tensor per
projection, as llama.cpp's model classes merge them, and the rules that read them back.

llama.cpp writes ``blk.N.ffn_{gate,up,down}_exps.weight`` [E, rows, cols]: the experts'
HF matrices stacked in expert order, nothing transposed (the canonical shapes come from the
config, so two equal dims never swap), and the router as ``blk.N.ffn_gate_inp.weight``.
A class that reads only one tensor per expert merges a layer once its last expert tensor
has been read (its :class:`~ckptkit.models.gguf_spec.GGUFExperts` ``order``); one that reads
transformers' stacked ``gate_up_proj`` / ``down_proj`` writes them where they come. Writing
needs one merged tensor in memory at a time, never the model.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptkit.errors import CkptkitError
from ckptkit.models.moe import MoEFields, is_moe_layer
from ckptkit.models.spec import Rule
from ckptkit.tensors.transforms import STACKED

if TYPE_CHECKING:
    import torch

    from ckptkit.formats.base import OpenedCheckpoint
    from ckptkit.io import Span
    from ckptkit.models import ModelConfig
    from ckptkit.models.gguf_spec import GGUFExperts, GGUFSpec
    from ckptkit.tensors.lazy import Lazy

EXPERT = re.compile(r"layers\.(\d+|\{i\})\.mlp\.experts\.(\d+)\.(w[123])\.weight")
PROJECTION = {"w1": "FFN_GATE_EXP", "w3": "FFN_UP_EXP", "w2": "FFN_DOWN_EXP"}  # gguf.MODEL_TENSOR names
Maker = Callable[[], "torch.Tensor"]
Merged = tuple[str, tuple[int, ...], Maker]  # GGUF name, shape, make


# an expert of an MTP layer past num_hidden_layers (canonical ``mtp.{j}.`` + its HF name)
MTP_EXPERT = re.compile(r"mtp\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_MTP_PROJECTION = {"gate": "w1", "up": "w3", "down": "w2"}


def _layer_and_projection(found: re.Match[str], layers: int) -> tuple[int, str]:
    """The block (an MTP layer's: ``layers + j``) and projection of an expert's canonical name."""
    if found.re is MTP_EXPERT:
        return layers + int(found.group(1)), _MTP_PROJECTION[found.group(3)]
    return int(found.group(1)), found.group(3)


def merged_name(layer: int | str, w: str) -> str:
    """``blk.{layer}.ffn_{gate,up,down}_exps.weight``, from the ``gguf`` package's names."""
    import gguf

    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, PROJECTION[w])].replace("{bid}", str(layer)) + ".weight"


def per_expert(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with one tensor per expert: the HF layout a GGUF's experts are read through."""
    return cfg.replace_fields(experts_layout="per-expert")


# --- writing --------------------------------------------------------------------------------------


def takes_dense_layers(spec: GGUFSpec) -> bool:
    """Whether llama.cpp's architecture of ``spec`` has a dense MLP for layers without experts."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == spec.arch)
    return gguf.MODEL_TENSOR.FFN_GATE in gguf.MODEL_TENSORS[arch]


# what the support matrix says a model of such an architecture needs (a refusal below otherwise)
EXPERTS_EVERYWHERE = "experts in every layer (llama.cpp's {arch} has no dense MLP; its converter refuses one)"


def refuse_dense_layers(ckpt: OpenedCheckpoint, spec: GGUFSpec) -> None:
    """One line where ``spec``'s architecture has experts in every layer and ``ckpt`` has dense ones."""
    cfg = ckpt.config
    dense = [i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i)]
    if dense and not takes_dense_layers(spec):
        raise CkptkitError(
            f"{ckpt.path}: llama.cpp's {spec.arch} has experts in every layer, but layer(s) "
            f"{', '.join(map(str, dense))} of this {ckpt.family.name} model have a dense MLP; "
            "llama.cpp cannot write it as GGUF"
        )


def llama_cpp_view(ckpt: OpenedCheckpoint, spec: GGUFSpec, experts: GGUFExperts) -> tuple[OpenedCheckpoint, bool]:
    """``ckpt`` as llama.cpp's class reads it, and whether it was regrouped: a class that
    takes no stacked experts reads a stacked checkpoint as the per-expert HF copy that
    ``--to hf --experts per-expert`` writes (its files, and so its tensor order)."""
    cfg = ckpt.config
    refuse_dense_layers(ckpt, spec)
    if experts.takes_stacked or cfg.fields(MoEFields).experts_layout == "per-expert":
        return ckpt, False
    view = copy.copy(ckpt)  # the same tensors, named one per expert
    view.config = per_expert(cfg)
    return view, True


class ExpertMerger:
    """Walks the tensor names llama.cpp reads, in its order, and says which merged tensors
    each one completes (None: not an expert tensor; ``[]``: held until its layer is complete)."""

    def __init__(self, ckpt: OpenedCheckpoint, experts: GGUFExperts) -> None:
        self.tensors = ckpt.tensors
        self.order = experts.order
        self.n = ckpt.config.fields(MoEFields).num_experts
        self.parts: dict[str, tuple[int, list[str]]] = {}  # HF name -> (layer, canonical parts)
        self.experts: dict[tuple[int, str], list[str]] = {}  # (layer, w1/w3/w2) -> canonical, expert order
        layers = ckpt.config.num_layers
        for rule in ckpt.family.hf_layout(ckpt.config).expand(layers):
            found = [EXPERT.fullmatch(c) or MTP_EXPERT.fullmatch(c) for c in rule.canonical]
            if found and all(found):
                layer, w = _layer_and_projection(found[0], layers)  # type: ignore[arg-type]
                self.parts[rule.native] = (layer, list(rule.canonical))
                for c, m in zip(rule.canonical, found, strict=True):
                    self.experts.setdefault(_layer_and_projection(m, layers), []).append(c)  # type: ignore[arg-type]
        self.pending: dict[int, set[str]] = {}

    def take(self, name: str) -> list[Merged] | None:
        if name not in self.parts:
            return None
        layer, canonical = self.parts[name]
        if len(canonical) > 1:  # a stacked tensor, read as it comes: its projections in order
            ws = list(dict.fromkeys(EXPERT.fullmatch(c).group(3) for c in canonical))  # type: ignore[union-attr]
            return [self._merged(layer, w) for w in ws]
        held = self.pending.setdefault(layer, set())
        held.add(name)
        if len(held) < 3 * self.n:
            return []
        del self.pending[layer]
        return [self._merged(layer, w) for w in self.order]

    def _merged(self, layer: int, w: str) -> Merged:
        lazies = [self.tensors[c] for c in self.experts[(layer, w)]]
        return merged_name(layer, w), (self.n, *lazies[0].shape), stacked(lazies)

    def check_done(self) -> None:
        if self.pending:  # pragma: no cover - the layout names every expert of a layer
            raise CkptkitError(f"experts of layer(s) {sorted(self.pending)} are incomplete")


class MergedMaker:
    """Makes a merged [E, ...] tensor (``make()``) and says where its bytes lie in the source
    files: ``source`` is the same tensor as [E * rows, ...] (the bytes in the same order),
    whose spans (None where a part is not stored as it is) let the GGUF writer copy it a
    chunk at a time, never the whole tensor in memory (as it writes a dense one)."""

    def __init__(self, make: Maker, shape: tuple[int, ...], dtype: str, spans: Callable[[], list[Span] | None]) -> None:
        from ckptkit.tensors.lazy import Lazy

        self.make = make
        flat = (shape[0] * shape[1], *shape[2:])
        self.source = Lazy(flat, dtype, lambda: make().reshape(flat), spans=spans)

    def __call__(self) -> torch.Tensor:
        return self.make()


def source_of(make: Maker) -> Lazy | None:
    """Where the bytes of a merged expert tensor that ``make`` makes lie (None: made by torch)."""
    return make.source if isinstance(make, MergedMaker) else None


def stacked(lazies: list[Lazy]) -> MergedMaker:
    """The maker of the experts' tensors ``lazies`` stacked as one [E, ...] tensor: their spans
    end to end (where each has them, all of one dtype), else :func:`stack`."""

    def spans() -> list[Span] | None:
        if any(lazy.dtype != lazies[0].dtype for lazy in lazies):
            return None
        out: list[Span] = []
        for lazy in lazies:
            if (part := lazy.spans()) is None:
                return None
            out += part
        return out

    return MergedMaker(lambda: stack(lazies), (len(lazies), *lazies[0].shape), lazies[0].dtype, spans)


def stack(lazies: list[Lazy]) -> torch.Tensor:
    """The experts' tensors as one [E, ...] tensor, read one expert at a time into it."""
    import torch

    first = lazies[0].get()
    out = torch.empty((len(lazies), *first.shape), dtype=first.dtype)
    out[0] = first
    del first
    for e, lazy in enumerate(lazies[1:], 1):
        out[e] = lazy.get()
    return out


# --- reading --------------------------------------------------------------------------------------


def merged_rules(rules: tuple[Rule, ...], rename: Callable[[Rule], Rule | None]) -> tuple[Rule, ...]:
    """A per-expert HF layout's rules in GGUF names: the rules of one layer's projection
    (one per expert) become one ``ffn_*_exps`` rule whose canonical parts, in expert order,
    are stacked on dim 0; every other rule goes through ``rename``."""
    out: list[Rule | tuple[str, str]] = []
    groups: dict[tuple[str, str], list[str]] = {}
    for rule in rules:
        found = EXPERT.fullmatch(rule.canonical[0]) if len(rule.canonical) == 1 else None
        if found is None:
            if (new := rename(rule)) is not None:
                out.append(new)
            continue
        key = (found.group(1), found.group(3))
        if key not in groups:
            groups[key] = []
            out.append(key)
        groups[key].append(rule.canonical[0])
    return tuple(Rule(merged_name(*r), tuple(groups[r]), STACKED) if isinstance(r, tuple) else r for r in out)


# --- gpt-oss and Llama 4: transformers' stacked experts, written transposed ---------------------

STACKED_EXPERTS = re.compile(r"(.*\.(?:mlp|feed_forward)\.experts\.)(gate_up_proj|down_proj)(_bias)?")


def interleaved_experts(hf_name: str, lazy: Lazy, tmap: Any, halves: bool = False) -> list[Merged] | None:
    """llama.cpp's tensors of ``hf_name`` when it is a stacked expert tensor (else None):
    ``down_proj`` [E, rows, cols] transposed; ``gate_up_proj`` transposed and split into its
    gate and up rows: gpt-oss's even and odd ones (its bias split the same way), or with
    ``halves`` Llama 4's first and second halves; biases kept as they are."""
    found = STACKED_EXPERTS.fullmatch(hf_name)
    if found is None:
        return None
    prefix, proj, bias = found.group(1).replace("language_model.", ""), found.group(2), found.group(3) is not None
    suffix = ".bias" if bias else ".weight"
    shape = lazy.shape if bias else (lazy.shape[0], lazy.shape[2], lazy.shape[1])
    half = (*shape[:-1], shape[-1] // 2) if bias else (shape[0], shape[1] // 2, shape[2])

    def part(i: int, whole: bool = False) -> Callable[[], torch.Tensor]:
        """Part ``i`` (0 gate, 1 up) of the transposed tensor (``whole``: all of it)."""
        rows = slice(None) if whole else slice(i * half[1], (i + 1) * half[1]) if halves else slice(i, None, 2)

        def make() -> torch.Tensor:
            t = lazy.get()
            return t[..., rows] if bias else t.transpose(-1, -2)[:, rows, :]

        return make

    def named(hf: str) -> str:
        return expert_gguf_name(tmap, prefix + hf + suffix)

    if proj == "down_proj":
        return [(named("down_proj"), shape, part(0, whole=True))]
    return [(named("gate_proj"), half, part(0)), (named("up_proj"), half, part(1))]


def expert_gguf_name(tmap: Any, hf_name: str) -> str:
    """llama.cpp's GGUF name of one projection of stacked experts (``hf_name``, e.g.
    ``model.layers.0.mlp.experts.gate_proj.weight``) in the gguf package's name map ``tmap``."""
    found: str | None = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if found is None:  # pragma: no cover - the gguf package names each for gpt-oss and llama4
        raise CkptkitError(f"llama.cpp has no GGUF name for {hf_name}")
    return found


def stacked_experts(spec: GGUFSpec, hf_name: str, lazy: Lazy, tmap: Any) -> list[Merged] | None:
    """:func:`interleaved_experts` for the specs that write stacked experts transposed (else None)."""
    if not (spec.interleaved_experts or spec.halved_experts):
        return None
    return interleaved_experts(hf_name, lazy, tmap, spec.halved_experts)
