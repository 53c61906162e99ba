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
    assert list(report["parts"]) == ['pair', 'failures', 'ipc', 'parity', 'memory', 'engines', 'throughput', 'gpu-tests', 'nccl', 'attention', 'demo']
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
    assert "--parts: unknown mfu (known: pair, failures, ipc, parity, memory, engines, throughput, gpu-tests, nccl, attention, demo)" in capsys.readouterr().err


def test_the_ipc_parts_checksum_reads_bytes_so_one_flipped_bit_of_a_bf16_tensor_shows():
    sys.path.insert(0, str(SCRIPT.parent))
    from tensor_digest import sha256 as tensor_sha256

    t = torch.randn(64, 48).to(torch.bfloat16)
    same = t.clone()
    flipped = t.clone()
    flipped.view(torch.int16)[3, 5] ^= 1  # the last mantissa bit of one element
    assert tensor_sha256(t) == tensor_sha256(same) == tensor_sha256(t.t().contiguous().t())
    assert tensor_sha256(flipped) != tensor_sha256(t)
    zeros, negative_zeros = torch.zeros(4, dtype=torch.bfloat16), -torch.zeros(4, dtype=torch.bfloat16)
    assert torch.equal(zeros, negative_zeros) and tensor_sha256(zeros) != tensor_sha256(negative_zeros)


def test_the_report_is_written_after_every_part_so_a_cut_run_keeps_what_ran(tmp_path, monkeypatch):
    module = gpu_check()
    monkeypatch.setattr(module, "machine", lambda: {"gpus": 1, "gpu": "stand-in"})
    seen = []

    def command(name, result):
        if name == "memory":  # by the time the second part runs, the first one's result is on disk
            seen.append(json.loads((tmp_path / "gpu-check.json").read_text())["parts"])
        return [sys.executable, "-c", "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'status': 'ok'}))",
                str(result)]

    report = module.run_all(["pair", "memory"], tmp_path, command=command, boxes={"pair": 20, "memory": 20})
    assert list(seen[0]) == ["pair"] and seen[0]["pair"]["status"] == "ok"
    assert list(report["parts"]) == ["pair", "memory"]
    assert list(json.loads((tmp_path / "gpu-check.json").read_text())["parts"]) == ["pair", "memory"]


def test_a_part_the_budget_leaves_out_is_reported_as_skipped_with_why(tmp_path, monkeypatch):
    module = gpu_check()
    monkeypatch.setattr(module, "machine", lambda: {"gpus": 1, "gpu": "stand-in"})
    report = module.run_all(["pair", "failures"], tmp_path, total_s=12, boxes={"pair": 20, "failures": 20},
                            command=lambda name, result: [sys.executable, "-c", "import time; time.sleep(30)"])
    assert report["parts"]["pair"]["status"] == "timed out" and 11 < report["parts"]["pair"]["timeout_s"] <= 12
    assert report["parts"]["failures"] == {"status": "skipped", "reason": "the check's 12 s budget is spent"}
