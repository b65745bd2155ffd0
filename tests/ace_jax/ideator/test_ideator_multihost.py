"""The ideator on several hosts: an HTTP implementer is asked once per conversation (each
process its share) and every process gets every reply (two real JAX processes on this machine,
joined by ``jax.distributed`` over gloo)."""
import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                               process_id=int(sys.argv[2]))
    from ace_jax import config_utils
    from ace_jax.ideator import ideator_trainer
    from ace_jax.policy import interface

    class Answering(interface.ChatPolicy):
        '''Replies which process answered and to what (a chat policy as an endpoint is).'''
        name = "answering"

        def complete(self, conversations, seed=None):
            return [interface.Completion(text=f"{jax.process_index()}:{c[-1]['content']}",
                                         completion_tokens=1) for c in conversations]

    env = ideator_trainer.IdeatorEnv(config_utils.load_config_file("configs/ideator.py"),
                                     implementer=Answering())
    n = int(sys.argv[3])
    out = env._ask_implementer([[{"role": "user", "content": str(k)}] for k in range(n)], step=3)
    print("REPLIES " + json.dumps([dataclasses.asdict(c) for c in out]))
    jax.distributed.shutdown()
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("n", [5, 1])
def test_an_http_implementer_is_asked_once_per_conversation_and_shared(tmp_path, n):
    script = tmp_path / "ask.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    addr = f"127.0.0.1:{_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), addr, str(i), str(n)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    replies = [json.loads(next(x for x in o.splitlines() if x.startswith("REPLIES "))[8:])
               for o, _ in outs]
    assert replies[0] == replies[1]            # every process holds every reply
    half = -(-n // 2)                          # multihost.my_share: a contiguous block each
    assert [r["text"] for r in replies[0]] == [f"{int(k >= half)}:{k}" for k in range(n)]
