"""Serve a policy over an OpenAI-compatible HTTP API (see ``ace_jax/policy/serving.py``).

  python launch/serve.py --run=runs/local                    # newest checkpoint of a run
  python launch/serve.py --run=runs/local --step=200 --port=8000
  python launch/serve.py --hf=exports/local                  # an HF directory (export_hf.py)

Then any OpenAI client can talk to it, e.g.
``ace_jax.policy.openai_policy.OpenAIPolicy("http://127.0.0.1:8000/v1")`` or
``curl -d '{"messages": [{"role": "user", "content": "hi"}]}' URL/v1/chat/completions``.
``--port=0`` picks a free port; the first line printed is ``serving <model> at <url>``.
Ctrl-C or SIGTERM stops it cleanly. Only warnings and errors are logged; ``--verbosity=0`` shows
INFO logs too (Orbax, requests at ``--verbosity=1``).

A run is loaded onto its own mesh when there are several devices (``JaxPolicy.from_run``). On a
pod, start the same command on every host: each loads its shards of the run (a collective),
process 0 serves HTTP and every engine call it makes (admitting a request, a decode step, a
cancel) is replayed by the other hosts (``multihost="leader"``, ``mirror.follow``), which print
``following process 0`` and exit when it stops. ``--distributed`` and friends set up
``jax.distributed`` as the trainer's ``mesh.*`` keys do. An ``--hf`` model is loaded whole on
each host's first device and served by process 0 alone.
"""
import signal
import sys


from absl import app, flags

from ace_jax.policy import mirror

_RUN = flags.DEFINE_string("run", None, "A training run directory (launch/tpu_train.py workdir).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of --run (default: the newest).")
_HF = flags.DEFINE_string("hf", None, "An HF model directory (config.json, safetensors, "
                          "tokenizer files) instead of --run.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Parameter dtype for --hf.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on; 0 picks a free one.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 256,
                                       "Largest reply in tokens per sample (and the default "
                                       "max_tokens); a larger max_tokens is refused (HTTP 400).")
_MAX_PROMPT_TOKENS = flags.DEFINE_integer("max_prompt_tokens", 1024,
                                          "Prompts are cut from the left to this many tokens.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0,
                                  "Temperature of requests that do not give one.")
_BATCH_WINDOW_MS = flags.DEFINE_float(
    "batch_window_ms", 20.0, "When the server is idle, the first request waits this many ms for "
    "others to start with it; requests arriving while it decodes join at the next step.")
_MAX_BATCH_SIZE = flags.DEFINE_integer("max_batch_size", 32, "Decode slots: the most samples "
                                       "decoded together; also the largest n.")
_DECODE_CHUNK_TOKENS = flags.DEFINE_integer(
    "decode_chunk_tokens", 8, "Decode steps between stop-string checks and streamed chunks: "
    "smaller streams more smoothly, larger syncs the host less often.", lower_bound=1)
_MODEL_NAME = flags.DEFINE_string("model_name", None, "Model id reported by the API "
                                  "(default: the run or directory name).")
_POD = mirror.define_pod_flags()
flags.adopt_module_key_flags(mirror)   # they show in --help


def main(argv):
    del argv
    if bool(_RUN.value) == bool(_HF.value):
        raise app.UsageError("give exactly one of --run or --hf")
    if _STEP.value is not None and not _RUN.value:
        raise app.UsageError("--step needs --run")
    from ace_jax.policy import policy as policy_lib, serving
    from ace_jax.train import logs

    logs.configure_logging()
    _POD.start()   # the compilation cache and jax.distributed, before any JAX backend
    kwargs = dict(max_new_tokens=_MAX_NEW_TOKENS.value, temperature=_TEMPERATURE.value,
                  max_prompt_tokens=_MAX_PROMPT_TOKENS.value, multihost="leader")
    if _MODEL_NAME.value:
        kwargs["name"] = _MODEL_NAME.value
    try:
        if _RUN.value:
            policy = policy_lib.JaxPolicy.from_run(_RUN.value, step=_STEP.value, **kwargs)
        else:
            policy = policy_lib.JaxPolicy.from_hf(_HF.value, dtype=_DTYPE.value, **kwargs)
    except Exception as e:  # noqa: BLE001 - any load failure ends the command with its reason
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    import jax

    if jax.process_index() != 0:   # a pod's other hosts replay process 0's engine calls
        print(f"following process 0 (process {jax.process_index()} of "
              f"{jax.process_count()})", flush=True)
        calls = mirror.follow()
        print(f"stopped after {calls} engine calls", flush=True)
        return
    try:
        _serve(policy, serving)
    finally:
        mirror.release_followers()


def _serve(policy, serving) -> None:
    server, thread, url = serving.start_server(
        policy, _HOST.value, _PORT.value, batch_window_ms=_BATCH_WINDOW_MS.value,
        max_batch_size=_MAX_BATCH_SIZE.value, max_new_tokens=_MAX_NEW_TOKENS.value,
        decode_chunk_tokens=_DECODE_CHUNK_TOKENS.value)
    print(f"serving {server.model_name} at {url}  (OpenAI base_url {url}/v1)", flush=True)

    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        serving.shutdown(server, thread)
        print("stopped", flush=True)


if __name__ == "__main__":
    app.run(main)
