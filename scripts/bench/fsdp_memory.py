"""Peak memory of one training step (forward, backward, AdamW step) of a Qwen2.5-1.5B-shaped random
model in bf16 mixed precision: FSDP2 (oar/training/sharding.py's wrapping, as train.py --fsdp and
configs/fsdp2.yaml shard) beside an unsharded DDP process, as each process of a run holds it.

    python scripts/bench/fsdp_memory.py --device cuda --out fsdp_memory.json          # one H100, ~2 min
    python scripts/bench/fsdp_memory.py --device cpu --size tiny --world 2 --out /tmp/m.json

What is measured and what is computed:
  * measured, world size 1 (one process, its own process group): peak and end-of-step memory of a
    DDP-wrapped model and of an FSDP2-sharded one (torch.cuda.max_memory_allocated; on CPU only the
    counted bytes, there is no allocator peak).
  * computed, world size N = 2, 4, 8: one GPU cannot hold N NCCL ranks, so a rank's parameter, gradient
    and AdamW bytes under FSDP2 are counted exactly from the shapes (dim 0 padded to a multiple of N,
    as fully_shard pads), and its peak estimated as those plus the world-1 run's peak above them
    (activations and gathered bf16 layers, which do not depend on N at a fixed per-rank batch).
  * checked, --world N on CPU: N gloo processes shard the model for real; each reports its local
    parameter + AdamW bytes, which must equal the count above.
Mixed precision as accelerate does it: DDP keeps fp32 parameters and autocasts to bf16; FSDP2
keeps fp32 sharded parameters (master), gathers and computes in bf16 (MixedPrecisionPolicy), and
reduce-scatters gradients into fp32 shards. AdamW (torch, foreach) keeps two fp32 moments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {  # Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocab 151936, tied
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
}
GIB = 2**30


def build(size: str, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[size], max_position_embeddings=4096, attn_implementation="sdpa")
    with torch.device(device):
        return Qwen2ForCausalLM(config).float()


def shard_bytes(model, world: int) -> dict[str, int]:
    """Per-rank bytes of fp32 parameter, gradient and two AdamW moments under FSDP2 with `world`
    ranks (dim 0 padded to a multiple of world), and unsharded (DDP: also its fp32 gradient buckets)."""
    params = {id(p): p for p in model.parameters()}.values()  # a tied weight counts once
    per_rank = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in params)
    full = sum(p.numel() for p in params)
    return {"params": full, "fsdp_rank_bytes": per_rank * (4 + 4 + 8), "ddp_rank_bytes": full * (4 + 4 + 8 + 4)}


def one_step(model, vocab_size: int, device: str, batch: int, seq: int, autocast: bool):
    ids = torch.randint(0, vocab_size, (batch, seq), device=device, generator=torch.Generator(device).manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def measure(mode: str, args) -> dict:
    """One step in this process (its process group already set up); memory as the allocator saw it."""
    from oar.training.sharding import param_optimizer_bytes, shard

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build(args.size, args.device)
    if mode == "fsdp2":
        shard(model, torch.bfloat16)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = one_step(
        model, SHAPES[args.size]["vocab_size"], args.device, args.batch, args.seq, autocast=mode == "ddp"
    )
    held = param_optimizer_bytes(model, optimizer)
    out = {"mode": mode, "world": torch.distributed.get_world_size(), "param_optimizer_bytes": held["local"]}
    if cuda:
        out |= {"peak_bytes": torch.cuda.max_memory_allocated(), "end_bytes": torch.cuda.memory_allocated()}
    del model, optimizer
    return out


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if args.device == "cuda":
        torch.cuda.set_device(0 if args.backend == "gloo" else rank)  # gloo: every rank on the one GPU
    torch.distributed.init_process_group(
        args.backend or ("gloo" if args.device == "cpu" else "nccl"), rank=rank, world_size=world
    )
    try:
        results = [measure(mode, args) for mode in ("ddp", "fsdp2")]
        queue.put((rank, results))
    finally:
        torch.distributed.destroy_process_group()


def run_world(world: int, args) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"fsdp_memory.py: a rank of the world-{world} run exited with {p.exitcode}")
    got = dict(queue.get() for _ in range(world))
    return got[0]  # rank 0's figures (every rank holds the same up to padding)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=tuple(SHAPES), default="1.5b")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--world", type=int, default=1, help="ranks to start for real (on one GPU only 1 works with NCCL)")
    ap.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default: nccl on cuda, gloo on cpu. gloo on cuda runs --world ranks on ONE GPU for real "
        "(slow collectives, real per-rank memory: each process's allocator peak is its own)",
    )
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fsdp_memory.py: --device cuda but no CUDA device; use --device cpu --size tiny.")
    if args.device == "cuda" and args.world > torch.cuda.device_count() and args.backend != "gloo":
        raise SystemExit(
            f"fsdp_memory.py: --world {args.world} needs {args.world} GPUs (NCCL refuses two ranks on one GPU); "
            f"pass --backend gloo to run them all on one GPU, or measure world size 1 and compute larger ones."
        )

    measured = run_world(args.world, args)
    model = build(args.size, "meta")
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "size": args.size,
        "batch": args.batch,
        "seq": args.seq,
        "measured": measured,
    }
    fsdp = next(m for m in measured if m["mode"] == "fsdp2")
    ddp = next(m for m in measured if m["mode"] == "ddp")
    counted = shard_bytes(model, args.world)
    # The real shards must be what the count says: parameters + AdamW moments (gradients are freed
    # by then), plus AdamW's float32 step counter, one scalar per parameter tensor.
    steps = 4 * len({id(p) for p in model.parameters()})
    assert fsdp["param_optimizer_bytes"] == counted["fsdp_rank_bytes"] // 16 * 12 + steps, (fsdp, counted)
    rows = []
    for n in (1, 2, 4, 8):
        c = shard_bytes(model, n)
        row = {
            "world": n,
            "params": c["params"],
            "fsdp_param_grad_adam_gib": c["fsdp_rank_bytes"] / GIB,
            "ddp_param_grad_adam_buckets_gib": c["ddp_rank_bytes"] / GIB,
        }
        if "peak_bytes" in fsdp and args.world == 1:
            # Everything above the sharded states (activations, gathered bf16 layers, logits) is per rank.
            above = fsdp["peak_bytes"] - shard_bytes(model, 1)["fsdp_rank_bytes"]
            row |= {
                "fsdp_peak_estimate_gib": (c["fsdp_rank_bytes"] + above) / GIB,
                "ddp_peak_measured_gib": ddp["peak_bytes"] / GIB,
            }
        rows.append(row)
    report["per_rank"] = rows
    Path(args.out).write_text(json.dumps(report, indent=2))

    print(
        f"{report['device']}, Qwen2-shaped '{args.size}' ({counted['params'] / 1e6:.1f} M params), "
        f"batch {args.batch} x {args.seq} tokens, bf16 mixed precision"
    )
    for m in measured:
        peak = (
            f"peak {m['peak_bytes'] / GIB:7.2f} GiB, after step {m['end_bytes'] / GIB:7.2f} GiB, "
            if "peak_bytes" in m
            else ""
        )
        print(
            f"  measured  {m['mode']:5s} world {m['world']}: {peak}"
            f"params+AdamW held {m['param_optimizer_bytes'] / GIB:.3f} GiB"
        )
    print(
        "  world | FSDP2 params+grads+AdamW per rank | DDP (+ grad buckets) per rank | FSDP2 peak per rank (estimate)"
    )
    for r in rows:
        est = f"{r['fsdp_peak_estimate_gib']:8.2f} GiB" if "fsdp_peak_estimate_gib" in r else "       -"
        print(
            f"  {r['world']:5d} | {r['fsdp_param_grad_adam_gib']:29.3f} GiB "
            f"| {r['ddp_param_grad_adam_buckets_gib']:25.3f} GiB | {est}"
        )
    return report


if __name__ == "__main__":
    main()
