"""`rlhfctl`: the one place that knows every part. `validate` and `crd` need only the
contract; `run` (local mode) starts the rollout servers and the trainer; `operator` runs
the Kubernetes operator."""
