"""The update's time and peak memory with mixed completion lengths (docs/speed.md, "The update's memory"):
train.py's step 5 for one pass (forward, log-probs, loss, backward, micro-batch by micro-batch), four ways,
each in a fresh process:

  today   every micro-batch at the step's width, the model's full logits (b, T + 1, V) and their gradient
  trim    each micro-batch at its own width (Rollout.trimmed), full logits
  head    the step's width, the hidden states through the head in chunks (oar/head.py)
  both    each micro-batch at its own width, through the head in chunks: what train.py runs

    python scripts/bench/bench_update.py --json docs/bench/update-memory-cpu.json        # 2 threads
    OMP_NUM_THREADS=1 python scripts/bench/bench_update.py --threads 1 \
        --json docs/bench/update-memory-cpu-1thread.json                                # 5.5 min, 2 loaded cores
    python scripts/bench/bench_update.py --rows 8 --max_len 64 --repeats 1 --json /tmp/u.json   # under a minute

The model is a random Qwen2 with Qwen2.5's vocabulary (151,936) on a narrow body (hidden 64, 2 layers), so that
the logits are what they are at 1.5B and the body costs little: at that vocabulary the logits are the update's
largest tensors. The rollouts: a prompt of 32 tokens and completions of lengths drawn uniformly from
[min_len, max_len] (seeded), right-padded to the step's longest, as the sampler lays them out.

Peak memory: VmHWM, the process's peak resident set, above its resident set right before the pass (the model,
the rollouts and their gradients' buffers already allocated by a warm-up pass), reset before each timed pass
(/proc/self/clear_refs); glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so that every freed tensor
larger than 64 KB goes back to the system and the resident set follows what is alive. Time: wall and CPU
seconds of each pass, medians over `--repeats`. Numbers: each variant's summed loss and every parameter's
gradient, against today's (largest difference, relative to today's largest).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = {"today": (False, False), "trim": (True, False), "head": (False, True), "both": (True, True)}


def model_and_rollouts(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oar.rollout import Rollout

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).float().train()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.rows,), generator=g)
    lp, t = args.prompt, int(lengths.max())
    ids = torch.randint(3, args.vocab, (args.rows, lp + t), generator=g)
    cols = torch.arange(lp + t)
    completion = (cols >= lp) & (cols < lp + lengths[:, None])
    ids = ids.masked_fill(~(completion | (cols < lp)), 0)
    attn = (completion | (cols < lp)).long()
    none = torch.zeros_like(completion)
    ro = Rollout(ids, attn, completion, none, none, torch.zeros(args.rows, dtype=torch.bool), [""] * args.rows, lp)
    return model, ro, lengths


def one_pass(model, ro, trim: bool, chunked: bool, micro: int, temperature: float = 1.0):
    """train.py's step 5a-5d for one pass with weights 1 (GRPO's) and seeded advantages: the summed loss."""
    import torch

    from oar.grpo import policy_loss
    from oar.training.learner import Learner

    learner = Learner(model, None, None, model, chunked_head=chunked)
    lp, valid = ro.prompt_width, ro.completion_mask[:, ro.prompt_width :]
    advantages = torch.randn(len(ro), generator=torch.Generator().manual_seed(2))
    norm = {"num_sequences": valid.any(1).sum().float(), "num_tokens": valid.sum().float()}
    total = 0.0
    for k in range(0, len(ro), micro):
        rows = slice(k, k + micro)
        mb = ro.select(rows).trimmed() if trim else ro.select(rows)
        t = mb.input_ids.shape[1] - lp
        fwd = learner.forward(mb.input_ids, mb.attention_mask, columns=t + 1)
        logprobs, _ = fwd.logprobs(mb.input_ids[:, lp:], temperature)
        token_adv = advantages[rows, None] * mb.completion_mask[:, lp:].float()
        loss, _ = policy_loss(logprobs, logprobs.detach(), token_adv, valid[rows, :t], **norm)
        loss.backward()
        total += float(loss)
    return total


def _rss(field: str) -> int:
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith(field + ":"))


def child(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    trim, chunked = VARIANTS[args.child]
    model, ro, _ = model_and_rollouts(args)
    one_pass(model, ro, trim, chunked, args.micro)  # warm-up: every .grad buffer allocated
    peaks, wall, cpu = [], [], []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=False)  # the gradient buffers stay: they are not the pass's
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        base = _rss("VmRSS")
        t0, c0 = time.perf_counter(), time.process_time()
        loss = one_pass(model, ro, trim, chunked, args.micro)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        peaks.append(_rss("VmHWM") - base)
    torch.save(torch.cat([p.grad.flatten() for p in model.parameters()]), args.grads_to)
    return {"loss": loss, "peak_extra_bytes": max(peaks), "wall_s": wall, "cpu_s": cpu}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="rollouts in the step")
    ap.add_argument("--micro", type=int, default=4, help="rollouts a micro-batch")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--min_len", type=int, default=16, help="shortest completion")
    ap.add_argument("--max_len", type=int, default=256, help="longest completion")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2.5's by default)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per variant, after a warm-up")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--grads_to", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_parts as bp

    _, ro, lengths = model_and_rollouts(args)
    widths = [
        ro.select(slice(k, k + args.micro)).trimmed().input_ids.shape[1] for k in range(0, args.rows, args.micro)
    ]
    res = {
        "what": "train.py's update, one pass, mixed completion lengths (scripts/bench/bench_update.py)",
        "machine": bp.machine(),
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "grads_to", "json")},
        "completion_lengths": lengths.tolist(),
        "step_width": ro.input_ids.shape[1],
        "micro_batch_widths": widths,
        "padding_share": {
            "step_width": 1 - float(lengths.sum()) / (args.rows * (ro.input_ids.shape[1] - args.prompt)),
            "own_width": 1 - float(lengths.sum()) / sum(args.micro * (w - args.prompt) for w in widths),
        },
        "logits_mb_per_micro_batch_at_step_width": args.micro
        * (ro.input_ids.shape[1] - args.prompt + 1)
        * args.vocab
        * 4
        / 2**20,
        "variants": {},
    }
    names = [v for v in args.variants.split(",") if v]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            grads = Path(tmp) / f"{name}.pt"
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child", name]
            cmd += ["--grads_to", str(grads)]
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.splitlines()[-1]
            r = json.loads(out)
            r |= {"wall_s_median": statistics.median(r["wall_s"]), "cpu_s_median": statistics.median(r["cpu_s"])}
            res["variants"][name] = r
            print(
                f"{name:6s} wall {r['wall_s_median']:7.2f} s   CPU {r['cpu_s_median']:7.2f} s   "
                f"peak above the start of the pass {r['peak_extra_bytes'] / 2**20:8.0f} MB   loss {r['loss']:.6f}",
                flush=True,
            )
        if "today" in names:
            today = res["variants"]["today"]
            want = torch.load(Path(tmp) / "today.pt")
            for name in names:
                v = res["variants"][name]
                got = torch.load(Path(tmp) / f"{name}.pt")
                v["vs_today"] = {
                    "wall_ratio": v["wall_s_median"] / today["wall_s_median"],
                    "cpu_ratio": v["cpu_s_median"] / today["cpu_s_median"],
                    "peak_ratio": v["peak_extra_bytes"] / today["peak_extra_bytes"],
                    "loss_abs_diff": abs(v["loss"] - today["loss"]),
                    "grad_max_abs_diff_rel": float((got - want).abs().max() / want.abs().max()),
                }
                print(f"{name:6s} vs today: " + "  ".join(f"{k} {x:.3g}" for k, x in v["vs_today"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
