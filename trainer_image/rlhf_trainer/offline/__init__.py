"""Offline methods (`method: sft | rm | dpo`): training from a dataset alone, with the RL
trainer's models, parallel layouts, packing, checkpoints and metrics, and no rollout
servers. `data.py` turns rows into token sequences, `losses.py` holds the losses as pure
functions, `loop.py` is the run loop."""
