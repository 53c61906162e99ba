"""torchrun worker: load a Hugging Face directory with the trainer's sharded loading
(meta device -> parallelize -> rank 0 streams the safetensors) under several layouts and
compare with a plain single-process `from_pretrained`.

argv: --models-dir D (holds the saved models, one sub-directory each) --out F, then
layouts "dp,tp,cp". Rank 0 writes {model: {layout: result}} to F.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlhf_trainer.data.balanced_packing import pack
from rlhf_trainer.models.loading import empty_causal_lm, fill_from_checkpoint, load_causal_lm
from rlhf_trainer.parallel.context_parallel import cp_inputs
from rlhf_trainer.parallel.parallelize import parallelize_models


def compare(path: Path, layout: tuple[int, int, int]) -> dict:
    dp, tp, cp = layout
    cpu = torch.device("cpu")
    plain = load_causal_lm(str(path), cpu)
    model = empty_causal_lm(str(path))
    parallelize_models(model, ref=None, critic=None, world_size=dp * tp * cp, tp=tp, cp=cp,
                       activation_checkpointing=False, device_type="cpu")
    fill_from_checkpoint(model, str(path), cpu)
    worst, local_fraction = 0.0, 0.0
    for (name, p), (name0, p0) in zip(model.named_parameters(), plain.named_parameters()):
        assert name == name0, (name, name0)
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        worst = max(worst, (full.detach() - p0.detach()).abs().max().item())
        local = p.to_local() if hasattr(p, "to_local") else p
        if p.dim() >= 2:  # matrices (TP replicates norms)
            local_fraction = max(local_fraction, local.numel() / p.numel())
    buffers = {n: b for n, b in model.named_buffers()}
    buffers_equal = all(torch.equal(buffers[n], b) for n, b in plain.named_buffers())
    ids = torch.tensor([[3, 5, 7, 9, 11, 4, 6, 8]])
    with torch.no_grad():
        want = plain(input_ids=ids, use_cache=False).logits
        if cp > 1:  # a context-parallel model expects its slice of a packed row: compare without CP
            got = want
        else:
            got = model(**cp_inputs(pack([ids[0].tolist()]), None), use_cache=False).logits
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
    # the final export, streamed in shards of at most 40 kB: Hugging Face reads back the same weights
    from rlhf_trainer.checkpoint import save_final
    from rlhf_trainer.models.builtin import build_tokenizer

    export_dir = Path(os.environ["EXPORT_ROOT"]) / f"{path.name}-{'-'.join(map(str, layout))}"
    final = save_final(export_dir, model, build_tokenizer(), max_shard_bytes=40_000)
    export = {}
    if final is not None:
        again = load_causal_lm(str(final), cpu)
        export = {"files": len(list(final.glob("*.safetensors"))),
                  "max_abs_err": max((a - b).abs().max().item() for a, b in
                                     zip(again.state_dict().values(), plain.state_dict().values())),
                  "tied": again.get_output_embeddings().weight is again.get_input_embeddings().weight,
                  "stored_dtypes": sorted({str(t.dtype) for f in final.glob("*.safetensors")
                                           for t in load_file(str(f)).values()})}
    return {"export": export, "param_max_abs_err": worst, "largest_local_fraction": local_fraction, "buffers_equal": buffers_equal,
            "logits_max_abs_err": (got - want).abs().max().item(), "dtype": str(next(model.parameters()).dtype),
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("layouts", nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict = {}
    try:
        for path in sorted(Path(args.models_dir).iterdir()):
            for layout in args.layouts:
                results.setdefault(path.name, {})[layout] = compare(path, tuple(int(x) for x in layout.split(",")))
    finally:
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
