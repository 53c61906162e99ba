"""A reward function for `reward.type: python` (examples/cluster-custom-reward.yaml): 1 when
the last \\boxed{...} of the response equals the row's answer (after stripping spaces), plus
0.1 for answering in a box at all; the logged score is the correctness alone.

`rlhfctl submit examples/cluster-custom-reward.yaml --working-dir examples` sends this file
to the job's pods in a ConfigMap."""

import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def reward_fn(response: str, answer: str, extra_info: dict) -> dict:
    boxes = BOXED.findall(response)
    if not boxes:
        return {"reward": 0.0, "score": 0.0}
    correct = float(boxes[-1].replace(" ", "") == str(answer).replace(" ", ""))
    return {"reward": correct + 0.1, "score": correct}
