"""The AMX bf16 prefix kernel against torch's fused CPU flash kernel, kernel alone.

The split backend's prefix call as it makes it: a K/V head's query heads stacked as rows
(``[1, Hkv, rows, 64]``, 2 K/V heads), K/V a slice of a flat cache ``[keys, Hkv, 64]`` (row
stride Hkv x 64), bf16, one thread, no mask. Per shape the two arms alternate (ABBA...) in one
process; each call is timed in thread CPU time (``time.thread_time``: time other processes take
from this core does not count, their cache and memory-bandwidth effects do). Reported: min and
median ms, GFLOP/s at the min (4 x Hkv x rows x keys x 64 FLOPs), flash / amx.
-> results/amx_attention.json

    flock /work/notes/bench.lock taskset -c 0 .venv/bin/python -m benchmarks.amx_attention
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks._common import add_common_args, config_of, contention_probe, setup, write_json


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.model.attention import amx

    torch.set_num_threads(1)
    if amx.prefix_kernel() is None:
        raise SystemExit("the AMX kernel is not available here (see the INFO log)")
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads, dim = 2, 64
    out: dict[str, Any] = {"contention_before": contention_probe(), "shapes": []}
    for rows in args.rows:
        for keys in args.keys:
            g = torch.Generator().manual_seed(rows + keys)
            q = torch.randn(1, heads, rows, dim, generator=g).bfloat16()
            kc = torch.randn(keys + 64, heads, dim, generator=g).bfloat16()
            vc = torch.randn(keys + 64, heads, dim, generator=g).bfloat16()
            k, v = kc[32 : 32 + keys], vc[32 : 32 + keys]
            kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            arms = {
                "flash": lambda q=q, kt=kt, vt=vt: flash(q, kt, vt),
                "amx": lambda q=q, k=k, v=v: amx.attention_prefix(q[0], k, v),
            }
            times: dict[str, list[float]] = {a: [] for a in arms}
            for fn in arms.values():
                fn()
            for i in range(args.reps):
                for name in list(arms) if i % 2 == 0 else list(arms)[::-1]:
                    t0 = time.thread_time()
                    arms[name]()
                    times[name].append(time.thread_time() - t0)
            flops = 4 * heads * rows * keys * dim
            row: dict[str, Any] = {"rows": rows, "keys": keys, "load_1m": os.getloadavg()[0]}
            for name, ts in times.items():
                row[name] = {
                    "ms_min": min(ts) * 1e3,
                    "ms_median": statistics.median(ts) * 1e3,
                    "gflops_at_min": flops / min(ts) / 1e9,
                }
            row["flash_over_amx_min"] = row["flash"]["ms_min"] / row["amx"]["ms_min"]
            row["flash_over_amx_median"] = row["flash"]["ms_median"] / row["amx"]["ms_median"]
            out["shapes"].append(row)
            print(
                f"{rows:5d} x {keys:5d}: flash {row['flash']['ms_min']:.2f} ms "
                f"({row['flash']['gflops_at_min']:.0f} GF/s), amx {row['amx']['ms_min']:.2f} ms "
                f"({row['amx']['gflops_at_min']:.0f} GF/s): {row['flash_over_amx_min']:.2f}x",
                flush=True,
            )
    out["contention_after"] = contention_probe()
    out["affinity"] = sorted(os.sched_getaffinity(0))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap)
    ap.add_argument("--rows", default="512,1024")
    ap.add_argument("--keys", default="500,3000,6000")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.keys, args.reps = "64", "600", 2
    out_dir = setup(args)
    args.rows = [int(x) for x in args.rows.split(",")]
    args.keys = [int(x) for x in args.keys.split(",")]
    res = bench(args)
    write_json(
        out_dir / "amx_attention.json", res, script="amx_attention.py", config=config_of(args)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
