"""The training machinery, the package's top layer: settings (`config`), problems (`data`), model
loading (`models`), LoRA (`lora`), sharding (`sharding`), the policy as a run trains it (`learner`),
the update's micro-batch loop (`update`), checkpoints (`checkpoint`), the run log (`runlog`), held-out
evaluation (`evaluation`) and process start and end (`launch`). train.py and
eval.py call them; nothing below oar/training/ imports them (pyproject.toml's contracts)."""
