"""Train an agent with AceGRPO (or MLE-Ideator): ``python -m ace_jax``'s command line, run
from the checkout.

  python launch/tpu_train.py --config=configs/local.py              # 2-core CPU, the default
  python launch/tpu_train.py --config=configs/ace30b.py             # TPU pod (every host)
  python launch/tpu_train.py --config=configs/ace30b.py --dry_run   # memory / step-time plan
  python launch/tpu_train.py --config=configs/local.py --config.rl.group_size=8

Every flag is ``ace_jax/__main__.py``'s (its docstring says more).
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("ace_jax", run_name="__main__", alter_sys=True)
