"""Writes examples/data/tool-call-format.jsonl, the cold start of examples/local-tools.yaml
and examples/local-agent.yaml, rendered by the chat template of builtin://tiny-qwen2-tools
exactly as `rollout.tools` renders an episode (tests/unit/test_tool_episodes.py checks it
token for token):

    python examples/data/make_tools_cold_start.py > examples/data/tool-call-format.jsonl

For each of the 100 sums of builtin://sum-mod-10 it shows:
- the sum answered at once, with each of the ten digits once (a guess: right 1 time in 10);
- the sum answered by a calculator call (CALLS_PER_SUM rows), so the cold-start model calls
  about CALLS_PER_SUM / (CALLS_PER_SUM + 10) of the time;
- the call's arguments once the call is opened (the prompt ends in its first token, the call's
  opening; ARGUMENTS_PER_SUM rows), so the calls it makes are right without it calling more;
- after the call and the calculator's result, the answer: the result's last digit
  (READS_PER_SUM rows), the format of reading a tool's result.

So the cold start knows HOW an episode with the tool goes but mostly guesses without it
(mean reward about 0.2); that the call is worth making on every sum is RL's to learn.
"""

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CALLS_PER_SUM = 1
READS_PER_SUM = 10
ARGUMENTS_PER_SUM = 9


def main() -> None:
    from rlhf_contract.api.tools import ToolsSpec
    from rlhf_trainer.models.builtin import CALL_CLOSE, CALL_OPEN, build_tokenizer
    from rlhf_trainer.rollout.tool_episodes import ChatFormat
    from rlhf_trainer.rollout.tools import load_tools

    tool_file = HERE.parent / "calculator_tool.py"
    spec = importlib.util.spec_from_file_location("calculator_tool", tool_file)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    fmt = ChatFormat(build_tokenizer("tiny-qwen2-tools"),
                     load_tools(ToolsSpec.model_validate({"functions": [{"file": str(tool_file),
                                                                          "function": "calculator"}]})))
    for a in range(10):
        for b in range(10):
            question, expression = f"{a}+{b}=", f"{a}+{b}"
            asked = fmt.render([{"role": "user", "content": question}], generation_prompt=True)
            call = CALL_OPEN + expression + CALL_CLOSE
            result = tool.calculator(expression)
            read = fmt.render([{"role": "user", "content": question}, {"role": "assistant", "content": call},
                               {"role": "tool", "content": result}], generation_prompt=True)
            rows = [(asked, str(d)) for d in range(10)]
            rows += [(asked, call)] * CALLS_PER_SUM + [(asked + CALL_OPEN, call[len(CALL_OPEN):])] * ARGUMENTS_PER_SUM
            rows += [(read, result[-1])] * READS_PER_SUM
            for prompt, response in rows:
                sys.stdout.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


if __name__ == "__main__":
    main()
