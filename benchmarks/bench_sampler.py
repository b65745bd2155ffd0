"""Speed of LP batch selection: 1,024 states out of up to 1,000,000, jitted vs plain NumPy.

Measures, after compilation, ``learnability.select_slots`` (scorer + top-rho + cooling +
Gumbel-top-k without replacement) on random statistics in the exploitation phase (rho < 1, so the
top-rho threshold is computed), and the same scorer + selection written straightforwardly in NumPy
(``np_select``, also the parity oracle of the tests), in the same run. Sizes 1e4, 1e5, 1e6.

Run: python benchmarks/bench_sampler.py [--repeats 5]
Last line: JSON with ``select_ms_1e6``, ``numpy_ratio`` (NumPy ms / ours at 1e6, higher is better)
and the raw per-size figures (median ms over repeats).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


import numpy as np


def np_schedule(step, spec):
    f = np.float32(np.clip((step - spec.explore_steps) / max(spec.anneal_steps, 1), 0.0, 1.0))
    if spec.anneal_steps == 0:
        f = np.float32(step >= spec.explore_steps)
    temp = np.float32(spec.temperature_start) * np.float32(spec.temperature_end / spec.temperature_start) ** f
    rho = np.float32(spec.rho_start) * np.float32(spec.rho_end / spec.rho_start) ** f
    return np.float32(temp), np.float32(rho)


def np_log_probs(stats, step, spec, min_keep=1):
    """NumPy version of ``learnability.log_probs`` (same definition, float32)."""
    valid = np.asarray(stats["valid"], bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        if spec.kind == "uniform":
            logit = np.where(valid, 0.0, -np.inf).astype(np.float32)
        else:
            std = np.sqrt(np.maximum(np.asarray(stats["reward_var"], np.float32), 0))
            if spec.prior == "parent":
                pstd = np.asarray(stats["prior_std"], np.float32)
                prior = np.where(np.isnan(pstd), spec.u0,
                                 spec.prior_shrink * spec.u0 + (1 - spec.prior_shrink) * pstd / spec.r_scale)
            else:
                prior = np.full_like(std, spec.u0)
            u = np.where(np.asarray(stats["visits"]) > 0, std / spec.r_scale, prior).astype(np.float32)
            h = np.clip(np.asarray(stats["headroom"], np.float32), 0, 1)
            lp = np.ones_like(u)
            if spec.use_variance:
                lp = lp * u ** np.float32(spec.alpha)
            if spec.use_headroom:
                lp = lp * h ** np.float32(spec.beta)
            lp = np.where(valid, lp, 0).astype(np.float32)
            temp, rho = np_schedule(step, spec)
            n_valid = int(valid.sum())
            k = max(int(np.ceil(np.float32(rho) * np.float32(n_valid))), min_keep)
            thr = np.partition(lp[valid], n_valid - k)[n_valid - k] if 0 < k <= n_valid else np.float32(0)
            logit = np.where(valid & (lp >= thr), lp / temp, -np.inf).astype(np.float32)
        if spec.use_cooling:
            last = np.asarray(stats["last_sampled"], np.int64)
            dt = np.maximum(step - last, 0).astype(np.float32)
            cool = np.where(last < 0, 1.0, -np.expm1(-dt / np.float32(spec.tau)))
            logit = logit + np.log(cool).astype(np.float32)
        m = logit.max()
        m = m if np.isfinite(m) else 0.0
        total = np.exp(logit - m).sum()
        return (logit - (m + np.log(total if total > 0 else 1.0))).astype(np.float32)


def np_select(rng, stats, step, spec, batch_size):
    """NumPy Gumbel-top-k: ``batch_size`` distinct slots ~ p without replacement."""
    logp = np_log_probs(stats, step, spec, batch_size)
    z = logp + rng.gumbel(size=logp.shape).astype(np.float32)
    top = np.argpartition(-z, batch_size)[:batch_size]
    return top[np.argsort(-z[top])]


def random_stats(n, seed=0, step=200):
    rng = np.random.default_rng(seed)
    visited = rng.random(n) < 0.7
    return {"valid": rng.random(n) < 0.95,
            "visits": np.where(visited, rng.integers(1, 5, n), 0).astype(np.int32),
            "last_sampled": np.where(rng.random(n) < 0.5, -1, rng.integers(0, step, n)).astype(np.int32),
            "reward_var": (rng.random(n) * 0.25).astype(np.float32),
            "headroom": rng.random(n).astype(np.float32),
            "prior_std": np.where(rng.random(n) < 0.1, np.nan, rng.random(n) * 0.5).astype(np.float32)}


def _median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--step", type=int, default=200, help="RL step (200: exploitation, rho = rho_end)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from ace_jax.curriculum import learnability as L

    spec = L.get_spec(L.default_config(), "lp")
    rows = {}
    for n in (10_000, 100_000, 1_000_000):
        stats_np = random_stats(n, step=args.step)
        stats = {k: jnp.asarray(v) for k, v in stats_np.items()}
        step = jnp.int32(args.step)
        keys = iter(jax.random.split(jax.random.key(0), 1000))
        t = time.perf_counter()
        jax.block_until_ready(L.select_slots(next(keys), stats, step, spec, args.batch))
        compile_ms = (time.perf_counter() - t) * 1e3
        ours = _median_ms(lambda: jax.block_until_ready(
            L.select_slots(next(keys), stats, step, spec, args.batch)), args.repeats)
        rng = np.random.default_rng(0)
        ref = _median_ms(lambda: np_select(rng, stats_np, args.step, spec, args.batch), args.repeats)
        rows[n] = {"jax_ms": round(ours, 2), "numpy_ms": round(ref, 2), "compile_ms": round(compile_ms, 1),
                   "numpy_ratio": round(ref / ours, 2)}
        print(f"N={n:>9,}: jax {ours:8.2f} ms   numpy {ref:8.2f} ms   ratio {ref / ours:5.2f}   "
              f"(first call incl. compile {compile_ms:.0f} ms)")
    growth = rows[1_000_000]["jax_ms"] / rows[10_000]["jax_ms"]
    print(f"time growth 1e4 -> 1e6 (100x states): {growth:.1f}x")
    out = {"select_ms_1e6": rows[1_000_000]["jax_ms"], "numpy_ratio": rows[1_000_000]["numpy_ratio"],
           "growth_1e4_to_1e6": round(growth, 2), "batch": args.batch, "step": args.step,
           "by_size": {str(k): v for k, v in rows.items()}, "cpu_count": os.cpu_count(),
           "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
