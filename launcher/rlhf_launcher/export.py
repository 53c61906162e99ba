"""`rlhfctl export CHECKPOINT OUT`: any complete `checkpoints/step-N/` as a Hugging Face
model directory, as the run's `final/` is written (same code: `save_final`), so an
intermediate step can be evaluated or served like the final model.

The checkpoint holds the trained weights (DCP, sharded as the trainer saved them); the
architecture, tokenizer and export dtype come from the model the run started from: the
`--model` directory, else the run's own record of it (`<output>/job.json`, or
`trainer.json`; a built-in model is rebuilt from its name and the run's seed, or taken
from `<output>/builtin-model/` where local mode wrote it). Only the policy is exported; the
optimizer state is not read, except under `trainer.engine: deepspeed`, whose ZeRO files
(`step-N/policy/`) keep the fp32 weights in the optimizer's partitions: the engine that
wrote the checkpoint reads it (rlhf_trainer/engine `checkpoint_engine`). A LoRA run's checkpoint holds the adapters: they are put on
that model and exported merged, with `adapter/` in peft's format, as the run's `final/`.
"""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
from pathlib import Path

from rlhf_contract.outputs import MARKER, checkpoint_step


class ExportError(RuntimeError):
    """The checkpoint or the model cannot be exported; the message says what to change."""


def _run_model(output_dir: Path) -> tuple[str, int, dict | None]:
    """The model path, seed and `model.lora` (or None) the run recorded."""
    job_file, trainer_file = output_dir / "job.json", output_dir / "trainer.json"
    if job_file.exists():
        spec = json.loads(job_file.read_text())["spec"]
        return spec["model"]["path"], int(spec.get("schedule", {}).get("seed", 0)), spec["model"].get("lora")
    if trainer_file.exists():
        config = json.loads(trainer_file.read_text())
        return config["modelPath"], int(config.get("schedule", {}).get("seed", 0)), config.get("lora")
    raise ExportError(f"{output_dir} has neither job.json nor trainer.json: give the model the run started from "
                      "with --model DIR")


def _policy_state(checkpoint: Path) -> dict:
    """The policy's trained tensors in `checkpoint`, whole, by Hugging Face name, as the
    engine that wrote them reads them (rlhf_trainer/engine: DCP files, or ZeRO's merged by
    DeepSpeed's own reader)."""
    from rlhf_trainer.engine import checkpoint_engine

    return checkpoint_engine(checkpoint, "policy").read_trained(checkpoint, "policy")


def export_checkpoint(checkpoint: str | Path, out: str | Path, model: str | None = None,
                      overwrite: bool = False) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainer.checkpoint import save_final

    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / MARKER).exists():
        raise ExportError(f"{checkpoint} is not a complete checkpoint (no {MARKER}): give a "
                          "<output>/checkpoints/step-N directory the trainer finished")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty: choose another directory or pass --overwrite")
    output_dir = checkpoint.parent.parent
    with tempfile.TemporaryDirectory(prefix="rlhfctl-export-") as tmp:
        recorded = _run_model(output_dir) if (output_dir / "job.json").exists() or (output_dir / "trainer.json").exists() \
            else None
        if model is None:
            if recorded is None:
                _run_model(output_dir)  # raises, naming --model
            path, seed, _ = recorded
            if path.startswith("builtin://"):
                written = output_dir / "builtin-model"
                if (written / "config.json").exists():
                    path = str(written)
                else:
                    from rlhf_trainer.models.builtin import materialize

                    path = str(materialize(path, tmp, seed=seed))
            model = path
        if not (Path(model) / "config.json").exists():
            raise ExportError(f"{model} is not a Hugging Face model directory (no config.json): give the model the "
                              "run started from with --model DIR")
        config = AutoConfig.from_pretrained(model)
        from rlhf_trainer.checkpoint import CheckpointError

        try:
            state = _policy_state(checkpoint)
        except (pickle.UnpicklingError, CheckpointError) as err:  # a planted file: nothing in it ran
            raise ExportError(f"{checkpoint} is refused: a file in it is not plain data ({err})") from None
        if not state:
            raise ExportError(f"{checkpoint} holds no policy weights (keys policy.model.*, or ZeRO files in policy/)")
        lora = None
        if any(".lora_A." in key for key in state):  # adapters only: the base is the run's model
            if recorded is None or recorded[2] is None:
                raise ExportError(f"{checkpoint} holds LoRA adapters but the run's record (job.json / trainer.json "
                                  f"in {output_dir}) with its model.lora is missing")
            from rlhf_contract.api.models import LoraSpec
            from rlhf_trainer.models.lora import add_adapters, file_key

            base = recorded[0] if str(model).startswith(tmp) else str(model)  # not a temporary directory
            lora = (LoraSpec.model_validate(recorded[2]), base)
            net = add_adapters(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), lora[0])
            frozen = {k for k in net.state_dict() if file_key(k) is not None}
        else:
            net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            frozen = set()
        missing, unexpected = net.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied - frozen or unexpected:
            raise ExportError(f"{checkpoint} does not fit {model}: missing {sorted(set(missing) - tied)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]}; give the model the run started from with --model")
        source_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(source_dtype, str):
            source_dtype = getattr(torch, source_dtype, None)
        net._rlhf_export_dtype = source_dtype if isinstance(source_dtype, torch.dtype) else torch.float32
        written = save_final(tmp, net, AutoTokenizer.from_pretrained(model), lora=lora)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(written), str(out))
    (out / "rlhf-export.json").write_text(json.dumps({"checkpoint": str(checkpoint.resolve()),
                                                      "step": checkpoint_step(checkpoint), "model": str(model)}) + "\n")
    return out
