"""The contract between the parts of rlhf-operator: the RLHFJob API models (CRD schema,
rules, presets, defaults), the pod contract (commands, environment names, ports, the
rollout server command line) and the trainer's narrow config.

Installable with pydantic and pyyaml alone; it imports none of the three programs
(`rlhf_operator`, `rlhf_trainer`, `rlhf_inference`), which each import it.
"""
