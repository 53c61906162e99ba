"""Job configs for the end-to-end tests."""

from rlhf_contract.api import validate_job


def small_job(model_dir, out, **spec) -> dict:
    """A validated job config for the tiny model; `spec` sections override the defaults."""
    base = {
        "model": {"path": str(model_dir)}, "data": {"path": "builtin://last-digit", "maxPromptLength": 24},
        "rollout": {"engine": "cpu", "samplesPerPrompt": 4, "maxTokens": 5},
        "trainer": {"learningRate": 1e-3, "maxTokensPerMicroBatch": 48},
        "schedule": {"totalSteps": 2, "promptsPerStep": 4, "saveEvery": 2},
        "output": {"dir": str(out)},
    }
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "e2e"},
                         "spec": base}).to_config()
