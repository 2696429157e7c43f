"""The config schema of each recipe: every key, its type, range and default.

``parse_config(raw, FullFinetuneConfig)`` (or ``LoRAFinetuneConfig``) runs before any
work and gives the typed config the recipe reads; see :mod:`ckptkit.train.config` for
the error format and torchtune spellings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from ckptkit.formats import torchtune_checkpointers
from ckptkit.models import model_types
from ckptkit.train.config import (
    Bool,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    Text,
)
from ckptkit.train.data import DatasetConfig
from ckptkit.train.lora import TARGETS

# torchtune's ModelType names for the families ckptkit knows.
_TORCHTUNE_MODEL_TYPES = {"phi3_mini": "phi3"}


def _model_type(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    name = _TORCHTUNE_MODEL_TYPES.get(value.lower(), value.lower())
    if name not in model_types():
        raise ValueError(f"unknown model type {value!r}; supported: {', '.join(model_types())}")
    return name


def _tokenizer(value: Any) -> Any:
    """torchtune's ``tokenizer: {_component_: ..., path: FILE}`` means the tokenizer at FILE."""
    if isinstance(value, dict):
        extra = sorted(set(value) - {"_component_", "path", "max_seq_len"})
        if extra or "path" not in value or value.get("max_seq_len") is not None:
            raise ValueError(
                "a tokenizer section takes only _component_ and path (truncation is dataset.max_seq_len); "
                "or give the tokenizer directory as a string"
            )
        return value["path"]
    return value


def _torchtune_checkpointer(value: str | None) -> str | None:
    if value is not None and value not in torchtune_checkpointers():
        raise ValueError(f"{value!r} is no torchtune checkpointer of a format ckptkit reads")
    return value


Fraction = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
if TYPE_CHECKING:
    LoRATarget = str
else:  # the short names and the canonical ones, checked by pydantic
    LoRATarget = Literal[tuple([*TARGETS, *TARGETS.values()])]


class CheckpointerConfig(Section):
    """Where the base model is read and checkpoints are written (see docs/training.md).

    ``_component_`` may name ckptkit's checkpointer (any format) or a torchtune checkpointer
    that some format declares it is read by (``CheckpointFormat.torchtune_checkpointers``):
    the base must then be in a format that checkpointer reads."""

    OWN: ClassVar[str] = "ckptkit.train.checkpointer.Checkpointer"
    checkpoint_dir: Text
    checkpoint_files: list[Text] | None = None
    model_type: Annotated[str | None, BeforeValidator(_model_type)] = None
    output_dir: Text | None = None
    adapter_checkpoint: Text | None = None
    recipe_checkpoint: Text | None = None
    keep_last_n_checkpoints: PositiveInt | None = None
    hf_base_dir: Text | None = None
    async_save: Bool = False  # the distributed recipes: write checkpoints while the next steps run
    torchtune_checkpointer: Annotated[Text | None, AfterValidator(_torchtune_checkpointer)] = None  # by _component_

    @classmethod
    def component_keys(cls, name: str) -> dict[str, Any] | None:
        if name == cls.OWN:
            return {}
        return {"torchtune_checkpointer": name} if name in torchtune_checkpointers() else None

    @classmethod
    def accepted_components(cls) -> list[str]:
        return [*torchtune_checkpointers(), cls.OWN]


class OptimizerConfig(Section):
    """AdamW."""

    components: ClassVar[dict[str, dict[str, Any]]] = {"torch.optim.AdamW": {}}
    lr: PositiveFloat = 2e-5
    weight_decay: NonNegativeFloat = 0.0
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    fused: Bool | None = None  # null: the fused kernel where torch has one for the device (CPU, CUDA)


class SchedulerConfig(Section):
    """Linear warmup, then cosine decay to ``lr * min_lr_ratio``."""

    components: ClassVar[dict[str, dict[str, Any]]] = {
        "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup": {},
    }
    warmup_steps: NonNegativeInt = 0
    min_lr_ratio: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0

    @model_validator(mode="before")
    @classmethod
    def _torchtune_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and "num_warmup_steps" in data and "warmup_steps" not in data:
            data = {("warmup_steps" if k == "num_warmup_steps" else k): v for k, v in data.items()}
        return data


class WandbConfig(Section):
    """Weights & Biases logging: on when ``project`` is set (needs ``pip install wandb``)."""

    project: Text | None = None
    entity: Text | None = None
    name: Text | None = None
    group: Text | None = None
    mode: Literal["online", "offline"] | None = None


class RecipeConfig(Section):
    """Keys every recipe takes."""

    seed: NonNegativeInt = 0
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    dtype: Literal["fp32", "bf16"] = "fp32"
    output_dir: Text | None = None  # torchtune's spelling of checkpointer.output_dir
    checkpointer: CheckpointerConfig
    resume_from_checkpoint: Bool = False
    tokenizer: Annotated[Text | None, BeforeValidator(_tokenizer)] = None
    dataset: DatasetConfig = DatasetConfig()
    epochs: PositiveInt = 1
    batch_size: PositiveInt = 4
    gradient_accumulation_steps: PositiveInt = 1
    max_steps_per_epoch: PositiveInt | None = None
    optimizer: OptimizerConfig = OptimizerConfig()
    lr_scheduler: SchedulerConfig = SchedulerConfig()
    clip_grad_norm: PositiveFloat | None = None
    enable_activation_checkpointing: Bool = False
    enable_activation_offloading: Bool = False  # saved activations to pinned CPU memory (CUDA) or disk (CPU)
    compile: Bool = False
    # mixture-of-experts models: weight of the router's load-balancing loss (null: config.json's)
    router_aux_loss_coef: NonNegativeFloat | None = None
    eval_every_n_steps: PositiveInt | None = None
    log_every_n_steps: PositiveInt = 1
    save_every_n_steps: PositiveInt | None = None
    quiet: Bool = False
    wandb: WandbConfig = WandbConfig()

    @model_validator(mode="after")
    def _output_dir(self) -> RecipeConfig:
        ours, theirs = self.checkpointer.output_dir, self.output_dir
        if ours is None and theirs is None:
            raise ValueError("missing required key checkpointer.output_dir (or torchtune's top-level output_dir)")
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError(f"output_dir ({theirs}) and checkpointer.output_dir ({ours}) differ; set one of them")
        self.checkpointer.output_dir = self.output_dir = ours or theirs
        return self


class FullFinetuneConfig(RecipeConfig):
    """``full_finetune``: every weight trains."""

    @model_validator(mode="before")
    @classmethod
    def _no_lora(cls, data: Any) -> Any:
        if isinstance(data, dict) and "lora" in data:
            raise ValueError(
                "this config has a lora section: it is a lora_finetune config "
                "(run it with `ckptkit run lora_finetune`, or delete the lora section)"
            )
        return data


def _quantize_base(value: Any) -> Any:
    """``nf4``, torchtune's ``true`` (NF4), or ``false``/``null`` (none)."""
    if value is True or value == "nf4":
        return "nf4"
    if value is False or value is None:
        return None
    raise ValueError(f"quantize_base must be nf4, true or false, not {value!r}")


QuantizeBase = Annotated[Literal["nf4"] | None, BeforeValidator(_quantize_base)]


class LoRAConfig(Section):
    """Low-rank adapters: where, how large, and what the checkpoints hold."""

    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: Fraction = 0.0
    targets: Annotated[list[LoRATarget], Field(min_length=1)] = ["q", "v"]
    use_dora: Bool = False  # DoRA: a trained magnitude per output row (PEFT's use_dora); on NF4 too (QDoRA)
    # final: intermediate checkpoints adapter-only, the last one merged too; every: all merged; never: none
    save_merged: Literal["final", "every", "never"] = "final"
    # QLoRA (ckptkit.train.nf4): nf4 (or true) keeps the decoder layers' frozen linears in NF4
    quantize_base: QuantizeBase = None
    # the base a merged save adds the adapter to: nf4 (dequantized, as trained) or original (16-bit)
    merge_base: Literal["nf4", "original"] = "nf4"
    # a quantized base (block FP8, MXFP4): null writes the merged model quantized as the input is, bf16 dequantized
    merge_dtype: Literal["bf16"] | None = None


class LoRAFinetuneConfig(RecipeConfig):
    """``lora_finetune``: adapters train, the base stays frozen."""

    lora: LoRAConfig

    @model_validator(mode="before")
    @classmethod
    def _lora_section(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "lora" not in data:
            raise ValueError(
                "this config has no lora section: it is a full_finetune config "
                "(run it with `ckptkit run full_finetune`, or add a lora section)"
            )
        if "quantize_base" in data:  # also accepted at the top level: quantize_base=nf4
            data = dict(data)
            quantize = data.pop("quantize_base")
            if isinstance(data["lora"], dict):
                data["lora"] = {**data["lora"], "quantize_base": quantize}
        if "save_adapter_weights_only" in data:  # torchtune's spelling of lora.save_merged=never
            data = dict(data)
            only = data.pop("save_adapter_weights_only")
            if not isinstance(only, bool):
                raise ValueError(f"save_adapter_weights_only must be true or false, not {only!r}")
            if only and isinstance(data["lora"], dict):
                data["lora"] = {**data["lora"], "save_merged": "never"}
        return data


class MixedPrecisionConfig(Section):
    """FSDP2 ``MixedPrecisionPolicy`` of the distributed recipes (None: ``dtype``)."""

    param_dtype: Literal["fp32", "bf16"] | None = None
    reduce_dtype: Literal["fp32", "bf16"] | None = None


class FullFinetuneDistributedConfig(FullFinetuneConfig):
    """``full_finetune_distributed``: ``full_finetune``'s keys (``batch_size`` per rank) plus FSDP2's."""

    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()


class LoRAFinetuneDistributedConfig(LoRAFinetuneConfig):
    """``lora_finetune_distributed``: ``lora_finetune``'s keys (``batch_size`` per rank) plus FSDP2's."""

    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
