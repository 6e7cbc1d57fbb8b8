"""oar: GRPO with Outcome-grounded Advantage Reshaping (arXiv 2601.07408).

One file per concept: `grpo` (advantages, loss, log-probs), `probes` (outcome distributions),
`oar_perturb` (OAR-P scores), `oar_grad` (OAR-G scores), `gating` (bi-level weights), `rewards`
(answer extraction and checking), `sampler` (rollouts), `data` (problems), `models` (loading).
"""
