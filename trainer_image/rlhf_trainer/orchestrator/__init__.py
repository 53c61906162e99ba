"""The rank-0 orchestrator: sample prompts, generate on the rollout servers, score,
filter (dynamic sampling), multi-turn; hands one typed `RolloutBatch` to the trainer.

  sampler.py       prompts -> groups of scored rows (single-turn or multi-turn)
  filtering.py     DAPO dynamic sampling: keep groups with signal, refill, give up after N rounds
  orchestrator.py  `Orchestrator.collect(step)` -> RolloutBatch; rollout dumps
  types.py         Row, RolloutBatch, RolloutStats
"""
