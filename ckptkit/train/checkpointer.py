"""The recipes' checkpointer: reads the base model in any format and writes checkpoints
in the same format, file names and shard partition, atomically, with what resuming needs.

A checkpoint folder (``output_dir/epoch_N`` or ``output_dir/step_N``, numbers zero-padded
to the run's largest so that folders sort in training order) holds the model (for LoRA:
merged, by default only in the final checkpoint) laid out like the input with the input's
non-weight files, the LoRA adapter in PEFT's format in ``adapter/`` (a subfolder, so that
transformers loads the folder itself as the merged model), and, except in the final
checkpoint, ``recipe_state/recipe_state.pt`` (a subfolder, so that tools which take every
``.pth`` of a folder for the model, such as llama.cpp's converters, do not see it).
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptkit.checkpoint import Checkpoint, open_checkpoint
from ckptkit.errors import CkptkitError, ConfigError
from ckptkit.formats import formats_read_by, source_file_format, transformers_format
from ckptkit.formats.peft_adapter import ADAPTER_WEIGHTS
from ckptkit.formats.torch_writer import save_torch
from ckptkit.hub import hub_source, parse_ref
from ckptkit.io import publishing, retire, sweep
from ckptkit.models import ModelConfig
from ckptkit.plan import dequantized_checkpoint
from ckptkit.save_like import write_like
from ckptkit.train.config import config_path
from ckptkit.train.lora import lora_modules, model_config
from ckptkit.train.metrics import METRICS_FILE
from ckptkit.train.peft_io import copy_lora_weights, read_lora_weights, save_adapter
from ckptkit.train.recipe_state import RecipeState, RunProgress
from ckptkit.train.schema import CheckpointerConfig
from ckptkit.train.stacked_lora import stacked_modules

RECIPE_STATE = "recipe_state.pt"
RECIPE_STATE_DIR = "recipe_state"
ADAPTER_DIR = "adapter"
HF_BASE_DIR = "base_hf"
CHECKPOINT_NAME = re.compile(r"(epoch|step)_(\d+)")


class Checkpointer:
    """Configured by the ``checkpointer:`` section (see docs/training.md) plus
    ``resume_from_checkpoint``."""

    def __init__(self, conf: CheckpointerConfig, resume: bool = False, base_dtype: str = "float32"):
        if conf.output_dir is None:
            raise ConfigError("config is missing required key checkpointer.output_dir")
        self.checkpoint_dir, self.hub_id = self._local(conf.checkpoint_dir, conf.model_type)
        self.checkpoint_files = conf.checkpoint_files
        self.model_type = conf.model_type
        self.output_dir = Path(conf.output_dir)
        self.adapter_checkpoint = conf.adapter_checkpoint
        self.recipe_checkpoint = conf.recipe_checkpoint
        self.resume = resume
        self.keep_last = conf.keep_last_n_checkpoints
        self.hf_base_dir = conf.hf_base_dir
        self.torchtune_checkpointer = conf.torchtune_checkpointer
        self.async_save = conf.async_save
        self.dtypes: dict[str, str] = {}  # canonical name -> stored dtype name
        self.base_dtype = base_dtype  # what quantized base weights (block FP8, MXFP4) are dequantized to
        self.merge_dtype: str | None = None  # written dequantized in this dtype (None: quantized as read)
        sweep(self.output_dir)  # what killed runs left half-written
        self.loads_in_transformers = False
        self.quantized = False
        self.peft_base = ""  # base_model_name_or_path of the adapters written
        self.saved: list[Path] = []

    @staticmethod
    def _local(checkpoint_dir: str, model_type: str | None) -> tuple[Path, str]:
        """``checkpoint_dir`` on this disk, and the Hub repository it came from ("" if local):
        a Hub name (``org/name[@rev]``) is fetched into huggingface_hub's cache and checked."""
        if parse_ref(checkpoint_dir) is None:
            return Path(checkpoint_dir), ""
        with hub_source(checkpoint_dir, model_type=model_type) as got:
            assert got.ref is not None
            return got.path, got.ref.repo_id

    # --- checks before any weight is read --------------------------------------------
    def check_fresh(self) -> None:
        """Refuse an ``output_dir`` that holds another run (its checkpoint folders or its
        ``metrics.jsonl``), unless resuming a checkpoint of that very folder: the runs would
        mix, the old metrics be lost (a checkpoint of another folder resumes into an empty one)."""
        if not self.output_dir.is_dir():
            return
        if self.resume and (
            not self.recipe_checkpoint or self.resume_folder().resolve().parent == self.output_dir.resolve()
        ):
            return  # this folder's run goes on: its metrics appended to
        runs = [p for p in self.output_dir.iterdir() if p.name == METRICS_FILE or CHECKPOINT_NAME.fullmatch(p.name)]
        if not runs:
            return
        found = ", ".join(sorted(p.name for p in runs)[:4]) + (", ..." if len(runs) > 4 else "")
        saved = [p for p in runs if p.is_dir()]
        newest = max(saved, key=lambda p: p.stat().st_mtime_ns) if saved else None
        other, fix = "another run", "choose another checkpointer.output_dir, or delete it (it saved no checkpoint)"
        if newest is not None and self.holds_state(newest):
            fix = (
                f"resume it with resume_from_checkpoint=true checkpointer.recipe_checkpoint={newest}, "
                "or choose another checkpointer.output_dir"
            )
        elif newest is not None:
            other, fix = "a finished run", "choose another checkpointer.output_dir"
        raise CkptkitError(f"checkpointer.output_dir {self.output_dir} holds {other} ({found}); {fix}")

    def model_config(self) -> ModelConfig:
        """The base's config (metadata only), after checking its format and that it can be written back."""
        from ckptkit.formats.base import Options
        from ckptkit.plan import plan_conversion

        with open_checkpoint(self.base_path(), model_type=self.model_type) as ckpt:
            self.loads_in_transformers = ckpt.fmt.info.loads_in_transformers
            self.quantized = bool(ckpt.raw.lossy)  # a GGUF's Q8_0, k-quants: trained dequantized
            component = self.torchtune_checkpointer
            if component is not None and component not in ckpt.fmt.info.torchtune_checkpointers:
                raise CkptkitError(
                    f"{self.checkpoint_dir}: is a {ckpt.format} checkpoint but checkpointer._component_ names "
                    f"torchtune's checkpointer for {' or '.join(formats_read_by(component))}; ckptkit's reads any "
                    "format: drop _component_"
                )
            plan_conversion(ckpt, Options(ckpt.format))  # the checkpoints' own layout: fails now, not at save
            return dequantized_checkpoint(ckpt, self.base_dtype).config  # gpt-oss: MXFP4 experts read dequantized

    # --- reading -------------------------------------------------------------------
    def load_base(self) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
        """The base model as (canonical config, canonical state dict), stored dtypes."""
        with self.open_base() as ckpt:
            return ckpt.config, {k: v.get() for k, v in ckpt.tensors.items()}

    def resume_folder(self) -> Path:
        """The checkpoint folder that holds the recipe state being resumed (``recipe_checkpoint``
        names that folder, its ``recipe_state`` folder or the state file in either)."""
        path = Path(self.recipe_checkpoint or "")
        if path.is_file():
            path = path.parent
        return path.parent if path.name == RECIPE_STATE_DIR else path

    def recipe_state_path(self) -> Path:
        """``checkpointer.recipe_checkpoint``: the state file, or a checkpoint folder holding one."""
        path = Path(self.recipe_checkpoint or "")
        if path.is_dir():
            for candidate in (path / RECIPE_STATE_DIR / RECIPE_STATE, path / RECIPE_STATE):
                if candidate.is_file():
                    return candidate
        return path

    def base_path(self) -> Path:
        """``checkpointer.checkpoint_dir``; a one-line error naming the key when it is missing."""
        return config_path("checkpointer.checkpoint_dir", str(self.checkpoint_dir))

    def open_base(self) -> Checkpoint:
        """The base checkpoint opened lazily (tensors read by ``get()``), its files checked;
        quantized weights (block FP8, MXFP4) dequantized to ``base_dtype`` by the reference
        recipe as they are read (``dtypes`` keeps their stored dtype)."""
        ckpt = open_checkpoint(self.base_path(), model_type=self.model_type)
        if self.checkpoint_files:
            found = set(ckpt.raw.files)
            listed = {Path(f).name for f in self.checkpoint_files}
            if listed != found:
                ckpt.close()
                odd = sorted(listed ^ found)
                raise CkptkitError(
                    f"checkpointer.checkpoint_files does not match the weight files in {self.checkpoint_dir} "
                    f"({', '.join(odd[:3])}); leave it unset to use every weight file"
                )
        self.dtypes = {k: v.dtype for k, v in ckpt.tensors.items()}
        if ckpt.quant is not None:
            method = ckpt.quant.method
            for name in ckpt.quant.scales:
                self.dtypes[method.dequantized_as(name, ckpt.tensors[name].shape)[0]] = self.dtypes.pop(name)
        return dequantized_checkpoint(ckpt, self.base_dtype)

    def load_recipe_state(self) -> RecipeState | None:
        """The state to resume from, or None when not resuming; one-line errors name the key."""
        if not self.resume:
            return None
        if not self.recipe_checkpoint:
            raise CkptkitError(
                "resume_from_checkpoint is true but checkpointer.recipe_checkpoint is not set "
                f"(point it at the {RECIPE_STATE} of the checkpoint to resume)"
            )
        path = self.recipe_state_path()
        if not path.is_file():
            raise CkptkitError(
                f"{path}: recipe state not found; set checkpointer.recipe_checkpoint to an existing {RECIPE_STATE}"
            )
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # any unreadable file: the message below says which and why
            raise CkptkitError(
                f"{path}: not a readable recipe state ({type(e).__name__}); check checkpointer.recipe_checkpoint"
            ) from None
        missing = [k for k in RecipeState.flat_keys() if not isinstance(state, dict) or k not in state]
        if missing:
            raise CkptkitError(
                f"{path}: not a ckptkit recipe state (no {', '.join(missing[:3])}); "
                "check checkpointer.recipe_checkpoint"
            )
        return RecipeState.from_flat(state)

    def check_state(self, progress: RunProgress, seed: int, epochs: int, max_steps: int | None) -> None:
        """Refuse a recipe state written by a run with a different schedule."""
        saved = (("seed", progress.seed, seed), ("epochs", progress.total_epochs, epochs))
        for name, was, want in (*saved, ("max_steps_per_epoch", progress.max_steps_per_epoch, max_steps)):
            if was != want:
                raise CkptkitError(
                    f"{self.recipe_checkpoint}: was written with {name}={was} but the config says {want}; "
                    f"set {name} to match or point checkpointer.recipe_checkpoint at the right run"
                )

    def load_adapter_into(self, model: nn.Module) -> None:
        """Copy the adapter to resume from into the model's (already added) LoRA modules."""
        path = Path(self.adapter_checkpoint) if self.adapter_checkpoint else self.resume_folder()
        folder = path.parent if path.is_file() else path
        if not (folder / ADAPTER_WEIGHTS).is_file() and (folder / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file():
            folder = folder / ADAPTER_DIR  # the checkpoint folder was given
        if not (folder / ADAPTER_WEIGHTS).is_file():
            raise CkptkitError(f"{path}: no {ADAPTER_WEIGHTS} there; check checkpointer.adapter_checkpoint")
        fix = "check checkpointer.adapter_checkpoint, or set checkpointer.checkpoint_dir to the model"
        adapter = read_lora_weights(folder, model_config(model), str(self.checkpoint_dir), fix)
        modules = {*lora_modules(model), *stacked_modules(model)}
        if set(adapter.lora) != set(modules):
            odd = sorted(set(adapter.lora) ^ set(modules))
            raise CkptkitError(
                f"{folder / ADAPTER_WEIGHTS}: adapts other modules than the config's lora section "
                f"({', '.join(odd[:3])}); "
                "check checkpointer.adapter_checkpoint"
            )
        try:
            copy_lora_weights(model, adapter)
        except CkptkitError as e:
            raise CkptkitError(f"{folder / ADAPTER_WEIGHTS}: {e}; check checkpointer.adapter_checkpoint") from None

    def prepare_peft_base(self) -> None:
        """Set ``peft_base``: a base PEFT and llama.cpp can load, for ``base_model_name_or_path``
        of the adapters.

        An HF base is named as it is; any other (Meta, internal, GGUF) needs an HF copy:
        ``checkpointer.hf_base_dir`` when given (checked to be HF), else one converted once
        into ``output_dir/base_hf`` (reused while it was made from this same base; a quantized
        GGUF dequantized to float32).
        """
        if self.loads_in_transformers:  # a Hub base by its name, as PEFT loads it
            self.peft_base = self.hub_id or str(self.checkpoint_dir.resolve())
            return
        if self.hf_base_dir:
            folder = Path(self.hf_base_dir)
            with open_checkpoint(folder) as ckpt:
                if not ckpt.fmt.info.loads_in_transformers:
                    raise CkptkitError(f"{folder}: is {ckpt.format}, not HF; check checkpointer.hf_base_dir")
            self.peft_base = str(folder.resolve())
            return
        from ckptkit.convert import ConvertOptions, convert

        folder = self.output_dir / HF_BASE_DIR
        stamp = folder / ".ckptkit-source"
        source = str(self.checkpoint_dir.resolve())
        if not (stamp.is_file() and stamp.read_text() == source):
            convert(
                self.checkpoint_dir,
                folder,
                ConvertOptions(
                    transformers_format().name,
                    dtype="float32" if self.quantized else None,  # dequantized, as trained
                    model_type=self.model_type,
                    force=True,
                ),
            )
            stamp.write_text(source)
        self.peft_base = str(folder.resolve())

    # --- writing -------------------------------------------------------------------
    def save(
        self,
        name: str,
        model_state: dict[str, Any] | None,
        adapter_model: nn.Module | None = None,
        recipe_state: dict[str, Any] | None = None,
        extra: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write ``output_dir/name`` completely, or leave what was there before.

        ``model_state`` None writes no model (an adapter-only LoRA checkpoint).
        ``extra(folder)`` adds more to the folder before it is published (the distributed
        recipes write their sharded recipe state there).
        """
        final = self.output_dir / name
        with self.publishing(name) as tmp:
            if model_state is not None:
                self.write_model(tmp, model_state)
            if adapter_model is not None:
                self.write_adapter(adapter_model, tmp)
            if recipe_state is not None:
                (tmp / RECIPE_STATE_DIR).mkdir(parents=True)
                save_torch(recipe_state, tmp / RECIPE_STATE_DIR / RECIPE_STATE)
            if extra is not None:
                extra(tmp)
        return final

    @contextlib.contextmanager
    def publishing(self, name: str) -> Iterator[Path]:
        """A temporary folder to write checkpoint ``output_dir/name`` into; put in place
        atomically (replacing one of that name) when the block succeeds, removed if it fails."""
        final = self.output_dir / name
        placed: list[Path] = []
        try:
            with publishing(final, replace=True, placed=placed) as tmp:
                yield tmp
        finally:  # in place, also when a stop came right after: the summary lists it
            self.saved += placed

    def write_model(self, folder: Path, model_state: dict[str, Any]) -> None:
        """The model (canonical names -> tensors or :class:`~ckptkit.tensors.lazy.Lazy`, read one at a
        time) in the input's format, file names and shard partition, into ``folder``."""
        write_like(self.checkpoint_dir, model_state, self.model_in(folder), self.model_type, self.merge_dtype)

    def model_in(self, folder: Path) -> Path:
        """Where checkpoint folder ``folder`` holds the model: the folder itself, or, for a base
        that is one file (a GGUF: the merged model written back in GGUF), that file's name in it."""
        return folder / self.checkpoint_dir.name if source_file_format(self.checkpoint_dir) is not None else folder

    def write_adapter(self, model: nn.Module, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """The model's LoRA adapter (or ``weights``, gathered whole) in PEFT's format in ``folder/adapter``."""
        save_adapter(model, folder / ADAPTER_DIR, base_model_name_or_path=self.peft_base or None, weights=weights)

    def latest_resumable(self) -> Path | None:
        """The newest checkpoint written by this run that holds a recipe state."""
        return next((path for path in reversed(self.saved) if self.holds_state(path)), None)

    @staticmethod
    def holds_state(path: Path) -> bool:
        """Whether checkpoint folder ``path`` holds a recipe state (one device's file, or DCP shards)."""
        return (path / RECIPE_STATE_DIR / RECIPE_STATE).is_file() or (path / RECIPE_STATE_DIR / ".metadata").is_file()

    def prune(self, steps_per_epoch: int) -> list[Path]:
        """Delete all but the newest ``keep_last_n_checkpoints`` checkpoint folders of ``output_dir``.

        Folders are ordered by the global step they were written at (``epoch_N``: the end of
        epoch N); returns those deleted.
        """
        if not self.keep_last:
            return []

        def step(path: Path) -> int:
            kind, number = CHECKPOINT_NAME.fullmatch(path.name).groups()  # type: ignore[union-attr]
            return (int(number) + 1) * steps_per_epoch if kind == "epoch" else int(number)

        found = [p for p in self.output_dir.iterdir() if p.is_dir() and CHECKPOINT_NAME.fullmatch(p.name)]
        found.sort(key=lambda p: (step(p), p.name.startswith("epoch")))
        doomed = found[: max(0, len(found) - self.keep_last)]
        for path in doomed:
            retire(path)  # renamed away first: a kill never leaves a partial checkpoint under its name
        self.saved = [p for p in self.saved if p not in doomed]
        return doomed


def checkpoint_name(kind: str, number: int, largest: int) -> str:
    """``epoch_N`` / ``step_N`` zero-padded to ``largest``'s digits, so names sort in training order."""
    return f"{kind}_{number:0{len(str(largest))}d}"


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
