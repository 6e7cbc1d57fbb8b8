"""Fork-aware credit from the rollouts alone: TEMPO's prefix-tree values (arXiv 2509.18314), as weights.

Legend: B rollouts (P groups of G, contiguous), T completion positions.

A group's G completions share a prompt, so they form a prefix tree: a node is a completion prefix s,
V(s) the mean reward of the group's rollouts that start with s (V(root) = the group mean r̄). Token t
of rollout i is a BRANCH token when the rollouts sharing its prefix s_t do not all continue with the
same token. TEMPO adds a temporal-difference term at branch tokens only:

  A_it = A_i + (V(s_t + y_it) - V(s_t)) / d         d: A_i's divisor, A_i = (r_i - r̄) / d

so elsewhere A_it = A_i (GRPO). As a weight on A_i (the interface: A_it = A_i w_it), for r_i != r̄
(beyond float32 rounding):

  w_it = 1 + (V(s_t + y_it) - V(s_t)) / (r_i - r̄)

which is the same whatever the advantage scale (group, batch or none): d cancels. Rollouts with
r_i = r̄ (A_i = 0; with 0/1 rewards only in groups whose rewards are all equal, where every TD term is
0 too) get w = 1. With other rewards (a format bonus: 0, b, 1 + b) a rollout can sit at its group's
mean while its branches move V: TEMPO would give those tokens their TD term, A_i w_it cannot (A_i =
0), so they get none; tempo_weights warns when that happens.

What it preserves and what it does not:
  * mass: along rollout i the TD terms telescope from V(root) = r̄ to V(leaf) = r_i (identical
    completions share a leaf and a reward), so sum_t w_it = T_i + 1 over its valid tokens: GRPO's
    advantage mass A_i T_i plus one token's worth, put on the branch tokens;
  * sign: NOT preserved. w_it < 0 when the branch rollout i took moved the value against its own
    outcome by more than |r_i - r̄|, e.g. a correct rollout that took a branch where most rollouts
    failed: TEMPO then pushes that token down although the rollout was rewarded. The loss
    (grpo.policy_loss) takes advantages of either sign per token, so such weights are used as is.

Departures, as we read the paper: the TD term has coefficient 1 and is divided by A_i's own divisor so
that it has A_i's units; the tree is over the completion tokens through EOS (a rollout ending where
another continues is a branch at its EOS); truncated rollouts are in the tree with their reward. The
mass identity needs every completion to end in a token of its own (the sampler's EOS) or at the common
width (truncated); a completion that stops without one where another goes on has no token to carry
its last TD term (it still counts in V of the prefix it stops at).

The method's part in oar/credit.py's protocol (the whole step's weights at once) is
`credit_methods.tempo_prepare`.
"""

from __future__ import annotations

import warnings

import torch


def tempo_weights(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, rewards: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """Weights w (B, T) float32 with A_it = A_i w_it TEMPO's token advantages (module docstring).
    completion_ids (B, T) long, completion_mask (B, T) bool (generated tokens through EOS), rewards (B,).
    Padding positions get 1 (the loss masks them)."""
    assert completion_ids.shape == completion_mask.shape and rewards.shape == completion_ids.shape[:1], (
        completion_ids.shape,
        completion_mask.shape,
        rewards.shape,
    )
    assert group_size >= 2 and len(rewards) % group_size == 0, (len(rewards), group_size)
    ids, mask, r = (
        completion_ids.cpu().tolist(),
        completion_mask.bool().cpu().tolist(),
        rewards.double().cpu().tolist(),
    )
    w = [[1.0] * completion_ids.shape[1] for _ in ids]
    lost = 0  # branch tokens of rollouts at their group's mean: a TD term the weights cannot carry
    for g0 in range(0, len(ids), group_size):
        rows = range(g0, g0 + group_size)
        mean = sum(r[i] for i in rows) / group_size
        # at the mean: within float32 rounding of it (rewards are float32: 0.4 and the mean of 0, 0.4, 1.4, ...
        # differ by ~1e-8, where 1 / (r_i - mean) would make a weight of 5e7)
        tol = 1e-6 * max(1.0, *(abs(r[i]) for i in rows))
        at_mean = {i: abs(r[i] - mean) <= tol for i in rows}
        classes = [list(rows)]  # rollouts sharing the prefix so far; ended rollouts drop out
        for t in range(completion_ids.shape[1]):
            nxt = []
            for node in classes:
                active = [i for i in node if mask[i][t]]
                children: dict[int, list[int]] = {}
                for i in active:
                    children.setdefault(ids[i][t], []).append(i)
                ended = len(node) - len(active)  # only without an EOS token (see the docstring)
                if len(children) + (ended > 0) > 1:  # a branch: the TD term of each child
                    v_node = sum(r[i] for i in node) / len(node)
                    for child in children.values():
                        delta = sum(r[i] for i in child) / len(child) - v_node
                        for i in child:
                            w[i][t] = 1.0 if at_mean[i] else 1.0 + delta / (r[i] - mean)
                            lost += at_mean[i] and abs(delta) > tol
                nxt += [c for c in children.values()]
            classes = nxt
            if not classes:
                break
    if lost:
        # one message whatever the count: Python shows it once, not every step
        warnings.warn(
            "tempo: branch tokens of rollouts whose reward equals their group's mean get no TD term "
            "(A_i = 0; rewards other than 0/1, e.g. a format bonus): TEMPO would credit them",
            stacklevel=2,
        )
    return torch.tensor(w, dtype=torch.float32, device=completion_ids.device)
