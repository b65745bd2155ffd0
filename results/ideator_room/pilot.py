"""The pilot of plan.md: fixes S, the implementer's SFT steps, on run seed 100.

Rule (plan.md, committed before any run): the largest S in {50, 100, 150, 200} whose
implementer alone (configs/local.py warm start, ``rl.num_steps=0``, ``sft.steps=S``) ends at most
60% of the six-task episodes (episode seeds 0-2, 8 steps) with a valid submission; S = 50 if none
does. The candidates are tried from the largest down and the first that qualifies is S (the rule
needs no other). Writes ``pilot.json`` (one record per S tried) beside this file.

    python results/ideator_room/pilot.py --root runs/ideator_room_pilot

from the checkout's root, with the package installed (``pip install -e .``, the README's setup).
"""
import argparse
import json
import os
import subprocess
import sys

from ace_jax.experiments import ablation

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

TASKS = ("iris-species", "wine-cultivar", "breast-cancer-diagnosis", "diabetes-progression",
         "wine-alcohol", "digits-8x8")
CANDIDATES = (200, 150, 100, 50)
MAX_VALID = 0.60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs/ideator_room_pilot")
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--backend", default="bwrap")
    args = parser.parse_args()
    records = []
    for steps in CANDIDATES:
        workdir = os.path.join(args.root, f"S{steps}", "implementer")
        res = ablation.run_job(workdir, {"sft.steps": steps, "seed": args.seed, "lp.seed": args.seed,
                                         "sandbox.backend": args.backend, "rl.num_steps": 0})
        if res.error:
            raise SystemExit(res.error)
        out = os.path.join(args.root, f"S{steps}", "eval")
        cmd = [sys.executable, "launch/evaluate.py", f"--policy=run:{os.path.abspath(workdir)}",
               f"--tasks={','.join(TASKS)}", "--seeds=0,1,2", "--max_steps=8",
               f"--out={os.path.abspath(out)}", f"--backend={args.backend}",
               "--max_new_tokens=384", "--stagnation_steps=1", "--no_progress"]
        if not os.path.exists(os.path.join(out, "results.json")):
            subprocess.run(cmd, cwd=REPO, check=True)
        with open(os.path.join(out, "results.json")) as f:
            stats = json.load(f)["overall"]["stats"]
        rec = {"sft_steps": steps, "valid": stats["valid"]["mean"],
               "human_rank": stats["human_rank"]["mean"], "seed": args.seed}
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if rec["valid"] <= MAX_VALID:
            break
    chosen = next((r["sft_steps"] for r in records if r["valid"] <= MAX_VALID), CANDIDATES[-1])
    with open(os.path.join(HERE, "pilot.json"), "w") as f:
        json.dump({"rule": f"largest S with valid <= {MAX_VALID}, tried from the largest down",
                   "tried": records, "S": chosen}, f, indent=1)
    print(f"S = {chosen}")


if __name__ == "__main__":
    main()
