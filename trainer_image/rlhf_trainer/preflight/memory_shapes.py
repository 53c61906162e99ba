"""What the memory plan (memory_plan.py) measures of a model: parameter counts per
decoder layer and outside the layers (`model_shape`, on the meta device), and the bytes per
token each decoder layer saves for backward (`activations`): the real Hugging Face model
with one and two layers, real hidden / intermediate / head sizes and the trainer's own
attention (`apply_cp(model, None)`: packed per-document attention from explicit
boundaries), run under FakeTensorMode (no memory) in the training dtype, counting the
storages saved for backward. Both cached per shape."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

GIB = 1 << 30
MEASURE_TOKENS = 2048
"""Tokens of the fake forward that measures a layer's saved activations (linear in tokens:
the attention is per document, without a mask over the row)."""
BACKWARD_WORKING_FACTOR = 0.3
"""Backward's own working set (a layer's activation gradients), as a fraction of one layer's
saved set: calibrated on CPU against the allocator's peak (tests/unit/test_memory_plan.py)."""


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a decoder model, per TP rank where TP splits them."""

    num_layers: int
    hidden: int
    vocab: int
    layer: int
    """Parameters of one decoder layer."""
    layer_replicated: int
    """... replicated over tensor-parallel ranks (norms, adapters); the rest splits."""
    layer_trainable: int
    """... that train (LoRA: the adapters)."""
    embed: int
    head: int
    """Untied output head (0 when tied to the embedding)."""
    norm: int
    largest: int
    """Elements of the largest single parameter (gathered whole by the weight sync)."""
    root_trainable: int = 0
    """LoRA: trained copies outside the layers (`model.lora.modulesToSave`, e.g. the head)."""

    def total(self, *, head: bool = True) -> int:
        return self.num_layers * self.layer + self.embed + self.norm + (self.head if head else 0)

    def root_tp(self, tp: int, *, head: bool = True) -> float:
        return (self.embed + (self.head if head else 0)) / tp + self.norm


def hf_config(model_config: dict, num_layers: int | None = None):
    from transformers import AutoConfig

    fields = {k: v for k, v in model_config.items() if k not in ("architectures", "transformers_version", "_name_or_path")}
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
        fields.pop("layer_types", None)
    kind = fields.pop("model_type", None)
    if kind is None:
        raise ValueError("model.path: config.json has no model_type")
    return AutoConfig.for_model(kind, **fields)


def _lora_key(lora) -> str | None:
    return None if lora is None else json.dumps(lora.model_dump(mode="json"), sort_keys=True)


def _lora_spec(key: str | None):
    if key is None:
        return None
    from rlhf_contract.api.models import LoraSpec

    return LoraSpec.model_validate(json.loads(key))


def dtype_of(name: str):
    import torch

    return getattr(torch, name)


@functools.lru_cache(maxsize=32)
def _model_shape(config_json: str, lora_key: str | None) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM

    from ..parallel.tensor_parallel import LAYER_PLAN

    model_config = json.loads(config_json)
    hf = hf_config(model_config, num_layers=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    if lora_key is not None:
        from ..models.lora import add_adapters

        add_adapters(model, _lora_spec(lora_key))
    layer_mod = model.model.layers[0]
    params = dict(layer_mod.named_parameters())
    # norms and adapters are replicated over TP; the linears of LAYER_PLAN split
    replicated = sum(p.numel() for name, p in params.items()
                     if not any(name.startswith(prefix + ".") for prefix in LAYER_PLAN) or ".lora_" in name)
    trainable = sum(p.numel() for p in params.values() if p.requires_grad or lora_key is None)
    embed = model.model.embed_tokens.weight.numel()
    head_w = model.get_output_embeddings().weight
    head = 0 if head_w is model.model.embed_tokens.weight else head_w.numel()
    norm = sum(p.numel() for p in model.model.norm.parameters())
    largest = max(p.numel() for p in model.parameters())
    return ModelShape(num_layers=int(model_config["num_hidden_layers"]), hidden=int(hf.hidden_size),
                      vocab=int(hf.vocab_size), layer=sum(p.numel() for p in params.values()), layer_replicated=replicated,
                      layer_trainable=int(trainable), embed=embed, head=head, norm=norm, largest=largest,
                      root_trainable=sum(p.numel() for n, p in model.named_parameters()
                                         if lora_key is not None and p.requires_grad and not n.startswith("model.layers.")))


def model_shape(model_config: dict, lora=None) -> ModelShape:
    """Parameter counts of the causal LM of `model_config` (a config.json dict), with the
    adapters of `lora` (a `model.lora` spec) when given."""
    return _model_shape(json.dumps(model_config, sort_keys=True), _lora_key(lora))


def layer_per_tp_rank(shape: ModelShape, tp: int) -> float:
    """One layer's parameters on one TP rank."""
    return shape.layer_replicated + (shape.layer - shape.layer_replicated) / tp


# ---- measured activations --------------------------------------------------------------

@dataclass(frozen=True)
class Activations:
    """Bytes per token saved for backward, measured."""

    per_layer: float
    """One decoder layer's saved set."""
    layer_input: float
    """One layer's input, [hidden] in the compute dtype (what checkpointing keeps)."""
    outside: float
    """Saved outside the decoder layers (embedding output, rotary tables, ...)."""


def _saved_bytes(config_json: str, num_layers: int, dtype: str, lora_key: str | None, tokens: int) -> int:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from ..parallel.context_parallel import apply_cp

    hf = hf_config(json.loads(config_json), num_layers=num_layers)
    with FakeTensorMode():
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(hf, dtype=dtype_of(dtype))
        if lora_key is not None:
            from ..models.lora import add_adapters

            # peft moves each new adapter to its base layer's device with `Module.to`, which
            # cannot swap a fake tensor (it holds weakrefs) on torch 2.14; the adapters are made
            # on the fake CPU already and keep fp32 (peft's autocast_adapter_dtype, as in the
            # trainer), so while they are added `to` is the identity and the set measured is the same.
            to = torch.nn.Module.to
            torch.nn.Module.to = lambda self, *a, **k: self
            try:
                add_adapters(model, _lora_spec(lora_key))
            finally:
                torch.nn.Module.to = to
        apply_cp(model, None)  # the trainer's attention: packed, per document, from explicit bounds
        model.train()
        own = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        embeds = torch.zeros(1, tokens, hf.hidden_size, dtype=dtype_of(dtype), requires_grad=True)
        half = tokens // 2
        saved: dict[int, int] = {}
        keep = []

        def pack(t):
            storage = t.untyped_storage()
            if storage._cdata not in own:
                saved[storage._cdata] = storage.nbytes()
                keep.append(storage)  # the id stays this storage's while we count
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(inputs_embeds=embeds, position_ids=torch.arange(tokens)[None],
                        document_ids=torch.cat([torch.zeros(half, dtype=torch.long),
                                                torch.ones(tokens - half, dtype=torch.long)])[None],
                        document_bounds=(0, half, tokens), use_cache=False)
    return sum(saved.values())


@functools.lru_cache(maxsize=64)
def _activations(config_json: str, dtype: str, lora_key: str | None, tokens: int) -> Activations:
    one = _saved_bytes(config_json, 1, dtype, lora_key, tokens)
    two = _saved_bytes(config_json, 2, dtype, lora_key, tokens)
    hidden = json.loads(config_json)["hidden_size"]
    size = dtype_of(dtype).itemsize
    return Activations(per_layer=(two - one) / tokens, layer_input=hidden * size, outside=(2 * one - two) / tokens)


def activations(model_config: dict, dtype: str = "bfloat16", lora=None, tokens: int = MEASURE_TOKENS) -> Activations:
    """Measured bytes per token saved for backward by one decoder layer of `model_config`
    (and outside the layers) in `dtype`; cached per shape."""
    return _activations(json.dumps(model_config, sort_keys=True), dtype, _lora_key(lora), tokens)


def activation_bytes(act: Activations, num_layers: int, tokens: int, checkpointing: bool) -> float:
    """Peak bytes of a model's activations in one forward + backward of `tokens` tokens."""
    working = (1 + BACKWARD_WORKING_FACTOR) * act.per_layer  # the layer in backward: its saved set + gradients
    if checkpointing:
        per_token = num_layers * act.layer_input + working + act.outside
    else:
        per_token = (num_layers - 1) * act.per_layer + working + act.outside
    return tokens * per_token
