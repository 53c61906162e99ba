"""Built-in tiny model and tokenizer, made in code so nothing is downloaded.

`builtin://tiny-qwen2` is a 2-layer Qwen2 with hidden size 64 and random weights (seeded),
(`builtin://tiny-qwen2-hd32`: the same with 2 heads of 32, which vLLM's CPU backend serves)
and a word-level tokenizer over the digits and a few symbols. It is small enough that a
GRPO run on CPU learns the built-in toy tasks in a few minutes.

`builtin://tiny-qwen2-tools` is the same model over a larger vocabulary with a chat template
in the Hermes / Qwen style that renders tools (`rollout.tools`): `<|im_start|>` / `<|im_end|>`
turns, `<tools>` in the system turn, tool results as `<tool_response>` in a user turn, calls
as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`. Its `<|im_end|>` is the EOS.

Simplifications: the first two tokenizers have no chat template (prompts are plain text);
the tools tokenizer's vocabulary has the opening of a calculator call,
`<tool_call>{"name": "calculator", "arguments": {"expression": "`, and its close `"}}</tool_call>`
as one token each, so that a random model can come upon a call by sampling (a real tokenizer
spells them out; the parser reads the decoded text either way), and its `<tools>` block names
the tools rather than printing their JSON schemas.
"""

from __future__ import annotations

import sys

from pathlib import Path

BUILTIN_PREFIX = "builtin://"
BUILTIN_MODELS = ("tiny-qwen2", "tiny-qwen2-hd32", "tiny-qwen2-tools")

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
VOCAB = [PAD, EOS, UNK, *[str(d) for d in range(10)], "+", "=", ":"]
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CALL_OPEN = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}</tool_call>'
TOOL_WORDS = ["\n", "system", "user", "assistant", "<tools>", "</tools>", "<tool_response>", "</tool_response>",
              CALL_OPEN, CALL_CLOSE]
"""The tools tokenizer's words beyond VOCAB: added tokens, so they are matched whole in any text
(and survive transformers loading the directory as a Qwen2 byte-level tokenizer)."""
TOOLS_TEMPLATE = (
    "{% set NL = '\\n' %}"  # a newline right after a tag would be trimmed (trim_blocks)
    "{% if tools %}<|im_start|>system{{ NL }}<tools>"
    "{% for tool in tools %}{{ (tool.function or tool).name }}{% if not loop.last %}+{% endif %}{% endfor %}"
    "</tools><|im_end|>{{ NL }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ NL }}<tool_response>{{ m.content }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ NL }}{% endif %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ NL }}{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}{% set f = call.function or call %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>{{ NL }}"
    "{% else %}<|im_start|>{{ m.role }}{{ NL }}{{ m.content }}<|im_end|>{{ NL }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)
"""The tools model's chat template (Hermes / Qwen 2.5 style, see the module docstring)."""


def is_builtin(uri: str) -> bool:
    return uri.startswith(BUILTIN_PREFIX)


def build_tokenizer(name: str = "tiny-qwen2"):
    """A character-level tokenizer over VOCAB: "3714:" is five tokens (`tiny-qwen2-tools`: with
    TOOL_WORDS, `<|im_start|>` and `<|im_end|>` as whole tokens and TOOLS_TEMPLATE).

    Texts have no spaces, so the tokenizer encodes and decodes the same whether it is
    loaded as itself or (as transformers 5 does for a Qwen2 directory) as a Qwen2
    byte-level tokenizer around the same vocabulary.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    if name == "tiny-qwen2-tools":
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(w, normalized=False, special=False) for w in TOOL_WORDS])
        tokenizer.add_special_tokens({"eos_token": IM_END, "additional_special_tokens": [IM_START]})
        tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def vocab_size(name: str) -> int:
    return len(VOCAB) + (len(TOOL_WORDS) + 2 if name == "tiny-qwen2-tools" else 0)


HEADS = {"tiny-qwen2": (4, 2), "tiny-qwen2-hd32": (2, 1), "tiny-qwen2-tools": (4, 2)}
"""(attention heads, KV heads) of each built-in model: hidden size 64, so head_dim 16 and 32.
vLLM's CPU attention refuses head_dim 16; `tiny-qwen2-hd32` is the one a real vLLM serves."""


def tiny_qwen2_config(name: str = "tiny-qwen2"):
    """The Qwen2Config of the built-in model `name` (no model code imported: cheap)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size(name),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=HEADS[name][0],
        num_key_value_heads=HEADS[name][1],
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=len(VOCAB) + len(TOOL_WORDS) if name == "tiny-qwen2-tools" else VOCAB.index(EOS),
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
    build_tokenizer(name).save_pretrained(directory)
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
    build_tokenizer(name).save_pretrained(directory)
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
