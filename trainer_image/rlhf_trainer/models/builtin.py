"""Built-in tiny model and tokenizer, made in code so nothing is downloaded.

`builtin://tiny-qwen2` is a 2-layer Qwen2 with hidden size 64 and random weights (seeded),
(`builtin://tiny-qwen2-hd32`: the same with 2 heads of 32, which vLLM's CPU backend serves)
and a word-level tokenizer over the digits and a few symbols. It is small enough that a
GRPO run on CPU learns the built-in toy tasks in a few minutes.

Simplification: the tokenizer has no chat template; prompts are plain text.
"""

from __future__ import annotations

import sys

from pathlib import Path

BUILTIN_PREFIX = "builtin://"
BUILTIN_MODELS = ("tiny-qwen2", "tiny-qwen2-hd32")

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
VOCAB = [PAD, EOS, UNK, *[str(d) for d in range(10)], "+", "=", ":"]


def is_builtin(uri: str) -> bool:
    return uri.startswith(BUILTIN_PREFIX)


def build_tokenizer():
    """A character-level tokenizer over VOCAB: "3714:" is five tokens.

    Texts have no spaces, so the tokenizer encodes and decodes the same whether it is
    loaded as itself or (as transformers 5 does for a Qwen2 directory) as a Qwen2
    byte-level tokenizer around the same vocabulary.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


HEADS = {"tiny-qwen2": (4, 2), "tiny-qwen2-hd32": (2, 1)}
"""(attention heads, KV heads) of each built-in model: hidden size 64, so head_dim 16 and 32.
vLLM's CPU attention refuses head_dim 16; `tiny-qwen2-hd32` is the one a real vLLM serves."""


def tiny_qwen2_config(name: str = "tiny-qwen2"):
    """The Qwen2Config of the built-in model `name` (no model code imported: cheap)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HEADS[name][0],
        num_key_value_heads=HEADS[name][1],
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=VOCAB.index(EOS),
        pad_token_id=VOCAB.index(PAD),
        torch_dtype="float32",
    )


def build_tiny_qwen2(seed: int = 0, name: str = "tiny-qwen2"):
    """The tiny Qwen2 causal LM `name` with seeded random weights (float32)."""
    import torch
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(name)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model


def _builtin_name(uri: str) -> str:
    """The name of the built-in model `uri`, or a ValueError naming model.path."""
    name = uri[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_MODELS:
        raise ValueError(
            f"model.path: unknown built-in model {uri!r}; choose one of "
            + ", ".join(BUILTIN_PREFIX + m for m in BUILTIN_MODELS)
        )
    return name


def materialize(uri: str, directory: str | Path, seed: int = 0) -> Path:
    """Write the built-in model `uri` as a Hugging Face directory; return its path.

    The directory is reused when it already holds the same model (same seed), so every
    process of a run loads identical weights.
    """
    name = _builtin_name(uri)
    directory = Path(directory)
    marker = directory / ".builtin"
    if marker.exists() and marker.read_text() == f"{name} seed={seed}":
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    _save_without_deepspeed_probe(build_tiny_qwen2(seed, name), directory)
    build_tokenizer().save_pretrained(directory)
    marker.write_text(f"{name} seed={seed}")
    return directory


def materialize_tokenizer(uri: str, directory: str | Path) -> Path:
    """Write what AutoTokenizer reads of the built-in model `uri` (its tokenizer files and
    config.json, as `materialize` writes them) but no weights: `rlhfctl validate` measures
    prompts with it without importing the model's code (about 3 s: transformers' modeling
    imports torch._dynamo and sympy)."""
    name = _builtin_name(uri)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_qwen2_config(name)
    config.architectures = ["Qwen2ForCausalLM"]  # as the model's save writes it
    config.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


def _save_without_deepspeed_probe(model, directory: Path) -> None:
    """`save_pretrained`, except that accelerate (which it calls to unwrap the model) does
    not import DeepSpeed merely because the trainer extra installs it: that import costs
    about 3 s (it pulls in mlflow) in every process that writes the built-in model, and a
    model just built is never inside a DeepSpeed engine (nor is any model while deepspeed
    is unimported)."""
    import accelerate.utils.other as unwrapping

    probe = unwrapping.is_deepspeed_available
    unwrapping.is_deepspeed_available = lambda: "deepspeed" in sys.modules
    try:
        model.save_pretrained(directory)
    finally:
        unwrapping.is_deepspeed_available = probe
