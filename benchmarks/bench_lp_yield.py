"""Does LP sampling find informative groups? Fraction of sampled groups with non-zero reward variance.

Simulation (no policy, no sandbox): every state has a hidden success probability p. A selected
state is rolled out as a group of G Bernoulli(p) rewards (1 = valid submission, 0 = failure); a
group is *informative* (non-zero GRPO signal) when its rewards are not all equal. Every rollout
becomes a child state in a real ``EvolvingBuffer`` (with its real pruning), so the buffer grows.

Mix of initial states per task (fixed here, not tuned to the result): 40% always fail (p = 0),
25% always succeed (p = 1), 35% in between (p ~ U(0.05, 0.95)). A child of an extreme state keeps
its parent's p with probability 0.9, else gets p ~ U(0.05, 0.95) (a fix or a break); a child of an
in-between state gets clip(p + N(0, 0.1), 0, 1). Valid executions score q ~ U(0.3, 1.0) on a task
with gold 1.0 and median 0.5 (so headroom varies), children inherit q + N(0, 0.05).

Both samplers run the same number of steps from the same initial buffer and seed; the LP sampler
uses ``learnability.default_config()`` (the schedule's explore/anneal steps are printed). The LP
run with ``prior="constant"`` (DESIGN.md's plain u0 for unvisited states) is reported as well:
in this simulation it is WORSE than uniform, because unvisited children of always-failing states
(no score -> full headroom) then outrank everything visited.

Run: python benchmarks/bench_lp_yield.py [--steps 150]
Last line: JSON with ``yield_ratio`` (LP yield / uniform yield) and the raw figures.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Optional


import numpy as np

from ace_jax.curriculum import buffer as B
from ace_jax.curriculum import learnability as L
from sandbox.result import ExecutionResult, Status
from sandbox.tasks.targets import TaskTargets


def simulate(sampler: str, steps: int = 150, batch: int = 32, group: int = 8, n_tasks: int = 8,
             init_per_task: int = 40, capacity: int = 8192, seed: int = 0,
             lp_overrides: Optional[dict] = None) -> dict:
    """Runs the simulation with sampler ``sampler``; returns yield and counts."""
    rng = np.random.default_rng(seed)
    bcfg = B.default_config()
    bcfg.capacity = capacity
    targets = [TaskTargets(f"t{i}", gold=1.0, median=0.5, baseline=0.0) for i in range(n_tasks)]
    buf = B.EvolvingBuffer(bcfg, targets)
    lcfg = L.default_config()
    lcfg.seed = seed
    for k, v in (lp_overrides or {}).items():
        lcfg[k] = v
    smp = L.Sampler.from_config(lcfg, sampler)
    hidden: dict[int, tuple[float, float]] = {}  # state id -> (p, q)
    for t in targets:
        for j in range(init_per_task):
            u = rng.random()
            p = 0.0 if u < 0.40 else 1.0 if u < 0.65 else rng.uniform(0.05, 0.95)
            q = rng.uniform(0.3, 1.0)
            sid = buf.add_root(t.task_id, f"{t.task_id}-root-{j}", q if p > 0 else None)
            hidden[sid] = (p, q)
    informative = 0
    per_step = []
    for step in range(steps):
        slots = smp.select(buf.stats, step, batch)
        ids = buf.ids_for_slots(slots)
        buf.mark_sampled(ids, step)
        n_inf = 0
        for sid in ids:
            p, q = hidden[sid]
            rewards = (rng.random(group) < p).astype(np.float64)
            n_inf += int(0 < rewards.sum() < group)
            children, child_hidden = [], []
            for j, r in enumerate(rewards):
                if p in (0.0, 1.0):
                    cp = p if rng.random() < 0.9 else rng.uniform(0.05, 0.95)
                else:
                    cp = float(np.clip(p + rng.normal(0, 0.1), 0, 1))
                cq = float(np.clip(q + rng.normal(0, 0.05), 0, 1))
                res = (ExecutionResult(Status.OK, valid_submission=True, dev_score=cq) if r > 0
                       else ExecutionResult(Status.RUNTIME_ERROR, stderr="sim failure"))
                children.append(B.Child(f"{sid}-{step}-{j}", res, float(r)))
                child_hidden.append((cp, cq))
            for cid, h in zip(buf.add_children(sid, children, step), child_hidden):
                hidden.setdefault(cid, h)
        informative += n_inf
        per_step.append(n_inf / batch)
    return {"sampler": sampler, "yield": informative / (steps * batch), "groups": steps * batch,
            "informative_groups": informative, "final_states": len(buf),
            "yield_last_quarter": float(np.mean(per_step[-max(1, steps // 4):])),
            "explore_steps": int(lcfg.explore_steps), "anneal_steps": int(lcfg.anneal_steps)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    lp = simulate("lp", steps=args.steps, batch=args.batch, seed=args.seed)
    uni = simulate("uniform", steps=args.steps, batch=args.batch, seed=args.seed)
    # The same LP with DESIGN.md's constant prior u0 for unvisited states (reported, not hidden).
    lp_const = simulate("lp", steps=args.steps, batch=args.batch, seed=args.seed,
                        lp_overrides={"prior": "constant"})
    print(f"lp:      yield {lp['yield']:.3f} (last quarter {lp['yield_last_quarter']:.3f}), "
          f"{lp['final_states']} states")
    print(f"uniform: yield {uni['yield']:.3f} (last quarter {uni['yield_last_quarter']:.3f}), "
          f"{uni['final_states']} states")
    print(f"lp (constant prior u0): yield {lp_const['yield']:.3f}")
    out = {"yield_ratio": lp["yield"] / max(uni["yield"], 1e-12),
           "yield_ratio_constant_prior": lp_const["yield"] / max(uni["yield"], 1e-12),
           "yield_ratio_last_quarter": lp["yield_last_quarter"] / max(uni["yield_last_quarter"], 1e-12),
           "lp": lp, "uniform": uni, "lp_constant_prior": lp_const, "steps": args.steps, "batch": args.batch, "group": 8,
           "wall_s": round(time.perf_counter() - t0, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
