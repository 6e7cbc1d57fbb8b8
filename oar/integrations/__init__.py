"""oar inside other trainers. `oar.integrations.trl`: OAR's token credit in TRL's GRPOTrainer (docs/trl.md).

Each module here imports its trainer library, an optional dependency: `import oar` and this package never do.
"""
