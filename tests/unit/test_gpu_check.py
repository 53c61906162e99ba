"""bench/gpu_check.py (`make gpu-check`) on a machine without CUDA: a clean report of every
part skipped for want of a GPU; and its driver keeps the other parts' results when a part
crashes, hangs or fails (parts played by small processes: the real parts need CUDA)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_a_gpu_every_part_is_skipped_in_one_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check().main([]) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert list(report["parts"]) == ["nccl", "pair", "failures", "ipc", "attention", "memory", "throughput", "demo"]
    assert all(p == {"status": "skipped", "reason": "no GPU: torch.cuda.is_available() is False"}
               for p in report["parts"].values())
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["gpus"] == 0
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert markdown.count("| skipped |") == len(report["parts"]) and "no GPU" in markdown
    assert markdown in capsys.readouterr().out


def test_a_part_that_crashes_hangs_or_fails_loses_only_its_own_result(tmp_path, monkeypatch):
    module = gpu_check()
    monkeypatch.setattr(module, "machine", lambda: {"gpus": 1, "gpu": "stand-in"})
    scripts = {
        "nccl": "import os, sys; print('segfault', file=sys.stderr); os._exit(139)",
        "attention": "import time; time.sleep(30)",
        "memory": "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'status': 'failed', 'error': 'x'}))",
        "throughput": ("import json, sys; open(sys.argv[1], 'w').write(json.dumps({'status': 'ok', 'summary': "
                       "'1 tokens/s', 'tables': {'t': [{'side': 'ours', 'MFU': '40%'}]}}))"),
    }
    report = module.run_all(list(scripts), tmp_path, command=lambda name, result: [sys.executable, "-c", scripts[name],
                                                                                    str(result)],
                            boxes={name: 3 for name in scripts})
    parts = report["parts"]
    assert parts["nccl"]["status"] == "failed" and parts["nccl"]["exit_code"] == 139
    assert "segfault" in parts["nccl"]["stderr_tail"]
    assert parts["attention"]["status"] == "timed out" and parts["attention"]["timeout_s"] == 3
    assert parts["memory"]["status"] == "failed" and parts["throughput"]["status"] == "ok"
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert "| throughput | ok |" in markdown and "| ours | 40% |" in markdown


def test_unknown_parts_are_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        gpu_check().main(["--parts", "nccl,mfu"])
    assert "--parts: unknown mfu (known: nccl, pair, failures, ipc, attention, memory, throughput, demo)" in capsys.readouterr().err
