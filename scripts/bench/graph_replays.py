"""Does the compiled decode loop (`--decode_loop compiled`) replay CUDA graphs call after call?

    python scripts/bench/graph_replays.py --device cuda --calls 140 --json graph-replays.json

Each `decode` call allocates its state and cache anew, so torch's CUDA-graph trees see new addresses
every call, and torch stops re-recording after `cudagraph_unexpected_rerecord_limit` (128) such calls.
This calls the compiled loop `--calls` times on one shape of a small random Llama (8 prompts x 4
rollouts) and records, per call: seconds, whether its tokens equal the eager loop's, dynamo's graph
count and inductor's cudagraph counters; at call 3 and at the second-to-last call (past the limit when
`--calls` > 130) torch's profiler counts the graph launches (`cudaGraphLaunch`) and kernel launches.
A loop that replays graphs launches one graph per decode step (new tokens - 1, the first comes from
the prefill). On a CPU there are no graphs: the counts are 0 and inductor's counter says it skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oar.sampler import decode

PROMPTS, GROUP, PAD, EOS = 8, 4, 0, 1


def small_llama(device: str):
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    torch.manual_seed(1)
    return LlamaForCausalLM(config).to(device).eval()


def launches(run):
    """`run()`'s value, and the CUDA graph and kernel launches the host issued while it ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        value = run()
    names = [e.name for e in prof.events()]
    return value, {
        "graph_launches": sum("GraphLaunch" in n for n in names),
        "kernel_launches": sum("LaunchKernel" in n for n in names),
    }


def replays(device: str, calls: int, new_tokens: int) -> dict:
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    model = small_llama(device)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (PROMPTS, 12), generator=g).to(device)
    mask = torch.ones_like(ids)
    kw = dict(
        max_new_tokens=new_tokens,
        temperature=1.0,
        top_p=1.0,
        eos_token_ids={EOS},
        pad_token_id=PAD,
        seeds=list(range(PROMPTS * GROUP)),
        group_size=GROUP,
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(loop):
        sync()
        start = time.perf_counter()
        out = decode(model, ids, mask, loop=loop, **kw)
        sync()
        return out, time.perf_counter() - start

    eager, _ = timed("eager")
    rows = []
    for i in range(calls):
        if i in (3, calls - 2):
            (out, seconds), profiled = launches(lambda: timed("compiled"))
        else:
            (out, seconds), profiled = timed("compiled"), {}
        rows.append(
            {
                "call": i,
                "s": seconds,
                "same_tokens": out[0].tolist() == eager[0].tolist(),
                "graphs": counters["stats"]["unique_graphs"],
                "inductor": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k},
                **profiled,
            }
        )
    eager_s = statistics.median(timed("eager")[1] for _ in range(5))
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rerecord_limit": getattr(inductor_config.triton, "cudagraph_unexpected_rerecord_limit", None),
        "new_tokens": new_tokens,
        "rollouts": PROMPTS * GROUP,
        "eager_s_median": eager_s,
        "compiled_s_median_after_first": statistics.median(r["s"] for r in rows[1:]) if calls > 1 else None,
        "all_same_tokens": all(r["same_tokens"] for r in rows),
        "calls": rows,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=140)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = replays(a.device, a.calls, a.new_tokens)
    for r in result["calls"]:
        if "graph_launches" in r:
            print(json.dumps(r))
    print(json.dumps({k: v for k, v in result.items() if k != "calls"}))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
