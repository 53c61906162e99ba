"""`python -m rlhf_trainer`: one trainer process (started by torchrun)."""

from .loop import main

main()
