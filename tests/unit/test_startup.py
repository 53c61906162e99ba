"""Start-up cost of the commands the tests (and users) run many times: `rlhfctl validate`,
`plan`, `render` and `crd` import no more than they need. transformers' model code costs
about 3 s per process (it imports torch._dynamo and sympy); only commands that build a
model may pay it. Also that the cheap stand-ins they use (the built-in model's tokenizer and
config written without its weights) equal what the model's own save writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local-grpo.yaml"


def modules_after(*argv: str) -> set[str]:
    """The modules `rlhfctl <argv>` has imported when it returns (run in a fresh process)."""
    code = ("import json, sys\nfrom rlhf_launcher.cli import main\n"
            f"code = main({list(argv)!r})\n"
            "print(json.dumps({'code': code, 'modules': sorted(sys.modules)}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["code"] == 0, res.stderr[-3000:]
    return set(out["modules"])


def test_validate_measures_prompts_without_the_models_code():
    modules = modules_after("validate", str(EXAMPLE))
    assert "transformers.models.qwen2.tokenization_qwen2" in modules  # it did load the tokenizer
    assert not {"transformers.modeling_utils", "torch._dynamo", "sympy"} & modules


@pytest.mark.parametrize("argv", [["render", str(ROOT / "examples" / "rlhfjob.yaml")], ["crd"]], ids=["render", "crd"])
def test_render_and_crd_import_neither_torch_nor_transformers(argv):
    modules = modules_after(*argv)
    assert not {"torch", "transformers"} & modules


def test_the_builtin_tokenizer_alone_is_what_the_model_directory_holds(tmp_path):
    from transformers import AutoTokenizer

    from rlhf_trainer.models.builtin import materialize, materialize_tokenizer

    full = materialize("builtin://tiny-qwen2", tmp_path / "full", seed=0)
    alone = materialize_tokenizer("builtin://tiny-qwen2", tmp_path / "alone")
    assert sorted(p.name for p in alone.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (alone / name).read_text() == (full / name).read_text()
    assert json.loads((alone / "config.json").read_text()) == json.loads((full / "config.json").read_text())
    a, b = AutoTokenizer.from_pretrained(alone), AutoTokenizer.from_pretrained(full)
    assert type(a) is type(b)
    for text in ("3714:", "12+5=7:", "99999999:0", ""):
        assert a(text)["input_ids"] == b(text)["input_ids"]
    with pytest.raises(ValueError, match="model.path: unknown built-in model"):
        materialize_tokenizer("builtin://tiny-llama", tmp_path / "x")


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen2-hd32"])
def test_the_builtin_config_without_the_model_is_the_models_config(name):
    """`rlhfctl plan` reads the built-in model's config without building the model."""
    from rlhf_trainer.models.builtin import build_tiny_qwen2, tiny_qwen2_config

    assert tiny_qwen2_config(name).to_dict() == build_tiny_qwen2(0, name).config.to_dict()
