"""oar: GRPO with Outcome-grounded Advantage Reshaping (arXiv 2601.07408).

One file per concept, in layers whose imports point down only (pyproject.toml's import-linter
contracts check it), bottom to top:
  model calls   `lm` (position ids, caches, a logits forward)
  the maths     `grpo` (advantages, loss, log-probs), `probes` (outcome distributions), `oar_perturb`
                (OAR-P scores; `oar_perturb_exact` and `oar_perturb_window`, its
                exact and window modes), `oar_grad` (OAR-G scores),
                `gating` (bi-level weights), `tempo`, `entropy_credit`, `answers` and `rewards`
                (answer extraction and checking), `inverse_cdf` (the token choice)
  rollouts      `rollout` (a step's layout and masks)
  credit        `credit_settings` (what a method reads of a run), `credit_methods` (the built-ins),
                `credit` (the protocol, the table of methods, `step_credit`)
  sampling      `decode_loops` (the eager and the fixed-shape loop), `sampler` (rollouts)
  tasks         `tasks` (the built-in arith task and tiny-arith model; never the training machinery)
  training      `training` (config, data, model loading, LoRA, sharding, checkpoints, logging) and, beside
                it, `integrations` (OAR inside other trainers: TRL's GRPOTrainer; optional dependencies)
"""
