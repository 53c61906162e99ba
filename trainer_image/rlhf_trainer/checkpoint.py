"""Checkpoints with torch.distributed.checkpoint (DCP), safe against a kill at any point.

Layout under `<output>/checkpoints/`:
  step-N/            DCP files of {"<part>": {"model", "optim"}} for each trained part
                     ("policy", and "critic" for PPO) as each part's engine gives
                     them (engine/: `dcp_state`; FSDP2: the sharded state of every rank,
                     trainable parameters only, with LoRA the adapters); an engine
                     with files of its own (DeepSpeed) writes them in step-N/<part>/,
                     trainer_state.json (step, data position), rng-rank<R>.pt
  step-N/COMPLETE    written LAST, after every rank finished, atomically (temporary
                     file, fsync, rename, fsync of the directory); only then does the
                     checkpoint count (`rlhf_contract.outputs` reads this layout; a
                     COMPLETE that cannot be read counts as incomplete: the one before
                     is resumed)
Loading trusts no pickle: `rng-rank<R>.pt` holds tensors and Python's RNG state as a tuple
of ints and is read with `weights_only=True`, DCP's `.metadata` with an unpickler that
knows only DCP's own metadata classes (`SafeReader`); a checkpoint that fails either is
set aside at resume like a damaged one. DeepSpeed's own files (engine/zero.py) are read
by DeepSpeed with `torch.load` held to `weights_only=True` (`data_only_loads`).
The final model goes to `<output>/final/` in Hugging Face format (written to a temporary
directory and renamed, so `final/` is never half-written).
"""

from __future__ import annotations

import copy
import enum
import errno
import io
import json
import logging
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader

from rlhf_contract.outputs import (MARKER, checkpoint_step as _step_of, complete_checkpoints, damage, latest_checkpoint,
                                   manifest)

from .storage.files import write_atomic


__all__ = ["complete_checkpoints", "latest_checkpoint", "load_checkpoint", "resume_checkpoint", "save_checkpoint",
           "save_final"]


log = logging.getLogger(__name__)

class Part(Protocol):
    """What a checkpoint asks of a trained part: its training engine (engine/base.py)."""

    def dcp_state(self) -> dict[str, Any] | None: ...

    def load_dcp_state(self, state: dict[str, Any]) -> None: ...

    def save_files(self, directory: Path, tag: str) -> None: ...

    def load_files(self, directory: Path, tag: str) -> None: ...


Parts = dict[str, Part]
"""The trained parts of a run by checkpoint name ("policy", "critic")."""


def _dcp_state(parts: Parts) -> dict[str, Any]:
    """The state every part saves with torch.distributed.checkpoint, by part name."""
    return {name: state for name, engine in parts.items() if (state := engine.dcp_state()) is not None}


def save_checkpoint(output_dir: str | Path, step: int, parts: Parts, trainer_state: dict[str, Any], *, keep: int) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    rank = dist.get_rank()
    root = Path(output_dir) / "checkpoints"
    path = root / f"step-{step}"
    if (path / MARKER).exists():
        return path  # already saved (e.g. a resumed run that ends where it resumed)
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # a partial one left by a crash
    dist.barrier()
    try:
        state = _dcp_state(parts)
        if state:
            dcp.save(state, checkpoint_id=str(path))
        for name, engine in parts.items():  # an engine's own files (DeepSpeed: `<step-N>/<part>/`)
            engine.save_files(path, name)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        buffer = io.BytesIO()
        torch.save(rng, buffer)
        write_atomic(path / f"rng-rank{rank}.pt", buffer.getvalue())
        dist.barrier()
        if rank == 0:
            write_atomic(path / "trainer_state.json", json.dumps({**trainer_state, "step": step}))
            write_atomic(path / MARKER, json.dumps({"files": manifest(path)}))  # last, whole or not at all
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        usage = shutil.disk_usage(root)
        # torch.save reports a full disk as a short write ("unexpected pos"), not ENOSPC
        if _out_of_space(err) or usage.free < LOW_SPACE_BYTES:
            raise CheckpointError(
                f"checkpoint {path}: no space left on the output volume ({_size(usage.free)} free of "
                f"{_size(usage.total)}); the partial checkpoint is not used (it has no {MARKER}): free space "
                "or give output.claimName a larger volume, and lower output.keepCheckpoints") from err
        raise
    if rank == 0:
        _prune(root, keep)
    dist.barrier()
    return path


LOW_SPACE_BYTES = 16 << 20
"""A checkpoint write that fails with less than this free on the volume failed for space."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (it is not used; the run's earlier ones are kept)."""


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _out_of_space(err: BaseException | None, depth: int = 0) -> bool:
    """Whether ENOSPC is behind `err` (DCP wraps each rank's failure; torch.save a C++ error)."""
    if err is None or depth > 8:
        return False
    if getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err):
        return True
    failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    nested = list(failures.values()) if isinstance(failures, dict) else []
    return any(_out_of_space(e, depth + 1) for e in [err.__cause__, err.__context__, *nested]
               if isinstance(e, BaseException))


def _prune(root: Path, keep: int) -> None:
    done = sorted((p for p in root.glob("step-*") if (p / MARKER).exists()), key=_step_of)
    newest = _step_of(done[-1]) if done else -1
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for partial in root.glob("step-*"):
        if not (partial / MARKER).exists() and _step_of(partial) < newest:
            shutil.rmtree(partial, ignore_errors=True)


def resume_checkpoint(output_dir: str | Path) -> Path | None:
    """Rank 0: the newest complete checkpoint that is whole. A damaged one (a shard truncated
    or missing since it was written) is renamed `damaged-step-N`, kept for inspection, and the
    one before it is used, saying so."""
    for path in reversed(complete_checkpoints(output_dir)):
        problem = damage(path) or unsafe(path)
        if problem is None:
            return path
        aside = path.with_name(f"damaged-{path.name}")
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        log.warning("checkpoint %s is damaged (%s): set aside as %s; resuming from an earlier one",
                    path, problem, aside.name)
    return None


def load_checkpoint(path: Path, parts: Parts) -> dict[str, Any]:
    """Collective: restore every part's model and optimizer, and the RNG; returns the
    trainer state."""
    for name, engine in parts.items():
        engine.load_files(path, name)
    state = _dcp_state(parts)
    if state:
        SafeReader(path).read_metadata()  # a refusal as our error, not wrapped in DCP's
        dcp.load(state, storage_reader=SafeReader(path))
    for name, part in state.items():
        parts[name].load_dcp_state(part)
    rng_file = path / f"rng-rank{dist.get_rank()}.pt"
    if rng_file.exists():
        rng = _load_rng(rng_file)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / "trainer_state.json").read_text())


def _load_rng(path: Path) -> dict[str, Any]:
    """An RNG file read with `weights_only=True` (tensors, ints, tuples: no code runs)."""
    try:
        rng = torch.load(path, weights_only=True)
        random.Random().setstate(rng["python"])  # its shape checked on a throwaway generator
        if not isinstance(rng["torch"], torch.Tensor):
            raise TypeError("its torch state is not a tensor")
    except (pickle.UnpicklingError, RuntimeError, KeyError, TypeError, ValueError, IndexError, EOFError) as err:
        lines = str(err).splitlines()
        why = next((line.strip() for line in lines if "unsupported global" in line.lower()), lines[0] if lines else "")
        raise CheckpointError(f"checkpoint file {path} is refused: it is not a plain RNG state (tensors and ints "
                              f"read with weights_only=True, no code run): {why[:300]}") from None
    return rng


_DCP_MODULE = "torch.distributed.checkpoint."
_SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                 ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("builtins", "set"), ("builtins", "frozenset")}


def _enum_member(cls: Any, name: str) -> Any:
    """`getattr` as an Enum member is pickled by some Pythons (3.11.2's `Enum.__reduce_ex__`
    gives `getattr(cls, name)`): only a member of one of DCP's own Enums, nothing else."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__.startswith(_DCP_MODULE) \
            and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not allowed "
                                 "in a checkpoint's metadata")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` pickle with nothing but its own classes: DCP's metadata classes and
    the members of its Enums, torch dtypes and sizes (a planted `__reduce__` names anything
    else and is refused)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_DCP_MODULE) and isinstance(found := super().find_class(module, name), type):
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """torch.distributed.checkpoint's file reader, its metadata read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, AttributeError, EOFError, ImportError) as err:
                raise CheckpointError(f"checkpoint {self.path} is refused: its metadata is not DCP's ({err})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def unsafe(path: Path) -> str | None:
    """Why loading the checkpoint at `path` would run code from it (its RNG files or DCP
    metadata are not plain data); None when every file reads as data."""
    try:
        for rng_file in sorted(path.glob("rng-rank*.pt")):
            _load_rng(rng_file)
        if (path / ".metadata").is_file():
            SafeReader(path).read_metadata()
    except CheckpointError as err:
        return str(err)
    return None



MAX_SHARD_BYTES = 5 * 1024**3
"""Largest safetensors file of the final export (Hugging Face's default shard size)."""


def save_final(output_dir: str | Path, model: torch.nn.Module, tokenizer: Any,
               max_shard_bytes: int = MAX_SHARD_BYTES, *, lora: tuple[Any, str] | None = None,
               tensors: tuple[list, Any] | None = None, gather: Any = None, name: str = "final") -> Path | None:
    """Collective: write the model as a Hugging Face directory, in the dtype its source
    checkpoint declared (`model._rlhf_export_dtype`, set when it was loaded; else fp32).

    Streams tensor by tensor: every rank takes part in gathering each full tensor, rank 0
    keeps at most one safetensors shard (`max_shard_bytes`) in host memory and writes it,
    then `model.safetensors.index.json` when there are several. A tied output embedding is
    stored once, as Hugging Face does.

    A model with LoRA adapters is written merged (models/lora.py: W + scaling x B A), and,
    given `lora` = (the `model.lora` spec, the base model's path), its adapters in peft's
    format under `final/adapter/`. `tensors`: (specs, whole tensors) as a training engine
    gathers them (engine/base.py `full_tensors`), with its `gather` for the adapters; by
    default the model's state dict, merged. `name`: the directory under `output_dir`
    (`final`; `hub/step-N` for an `output.hub.every` push)."""
    from safetensors.torch import save_file

    from .models.lora import merged_tensors, save_adapter

    rank0 = dist.get_rank() == 0 if dist.is_initialized() else True
    final = Path(output_dir) / name
    tmp = Path(output_dir) / f"{name}.tmp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    dtype = getattr(model, "_rlhf_export_dtype", None) or torch.float32
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, files, total = 0, [], 0

    def flush() -> None:
        nonlocal size
        if shards[-1]:
            name = f"part-{len(files):05d}.safetensors"
            save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
            files.append((name, list(shards[-1])))
        shards[-1], size = {}, 0

    specs, whole = tensors if tensors is not None else merged_tensors(model, model.state_dict().items())
    for (name, _, _), full in zip(specs, whole):  # collective for DTensors: every rank gathers each
        if not rank0 or (tied and name == "lm_head.weight"):
            continue
        full = full.detach().to("cpu", dtype, copy=True).contiguous()
        nbytes = full.numel() * full.element_size()
        if size and size + nbytes > max_shard_bytes:
            flush()
        shards[-1][name] = full
        size += nbytes
        total += nbytes
    if rank0:
        flush()
        if len(files) == 1:
            (tmp / files[0][0]).rename(tmp / "model.safetensors")
        else:
            renamed = {}
            for i, (name, keys) in enumerate(files):
                new_name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                (tmp / name).rename(tmp / new_name)
                renamed.update({k: new_name for k in keys})
            index = {"metadata": {"total_size": total}, "weight_map": renamed}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    if lora is not None:
        save_adapter(tmp / "adapter", model, *lora, **({"full": gather} if gather is not None else {}))
    if rank0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    if dist.is_initialized():
        dist.barrier()
    return final if rank0 else None
