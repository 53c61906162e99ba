"""Batching in the trainer: padded log-probs equal the unpadded computation."""

import torch

from rlhf_trainer.batch import Row, pad_batch, response_logits, token_logprobs
from rlhf_trainer.models.builtin import build_tiny_qwen2


def test_padded_logprobs_equal_unpadded():
    model = build_tiny_qwen2(seed=1).eval()
    rows = [
        Row([6, 10, 4, 7, 15], [7, 1], [], 1.0, 1.0, False),
        Row([5, 15], [9], [], 0.0, 0.0, False),
        Row([3, 4, 5, 6, 7, 8, 15], [4, 4, 4], [], 0.0, 0.0, True),
    ]
    batch = pad_batch(rows, pad_id=0, device=torch.device("cpu"))
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    with torch.no_grad():
        got = token_logprobs(response_logits(model, batch), batch)
        for i, row in enumerate(rows):
            ids = torch.tensor([row.prompt_ids + row.response_ids])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(row.prompt_ids)
            want = [logp[p - 1 + j, tok].item() for j, tok in enumerate(row.response_ids)]
            assert torch.allclose(got[i, :len(want)], torch.tensor(want), atol=1e-5), (i, got[i], want)


def test_loss_mask_of_multi_turn_rows_reaches_the_batch():
    rows = [Row([6, 15], [7, 14, 8, 15, 9], [], 1.0, 1.0, False, loss_mask=[1, 0, 0, 0, 1]),
            Row([5, 15], [9], [], 0.0, 0.0, False)]
    batch = pad_batch(rows, pad_id=0, device=torch.device("cpu"))
    assert batch["response_mask"].tolist() == [[1, 0, 0, 0, 1], [1, 0, 0, 0, 0]]
    # environment tokens are still attended to: they are real input
    assert batch["attention_mask"][0].tolist() == [1] * 7
