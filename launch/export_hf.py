"""Export a training run's checkpoint as a Hugging Face model directory (see ``ace_jax/policy/export.py``).

  python launch/export_hf.py --run=runs/local --out=exports/local   # newest step, the model's param dtype
  python launch/export_hf.py --run=runs/local --step=200 --out=exports/s200 --dtype=bfloat16
  python launch/export_hf.py --run=runs/local --out=gs://bucket/exports/local --max_shard_size=2GB

The directory loads with ``transformers.AutoModelForCausalLM.from_pretrained``, vLLM, and
``launch/serve.py --hf=<out>``. An existing non-empty ``--out`` is refused unless ``--overwrite``.
It runs on the host's CPU and streams (one block of one parameter in memory at a time, no
device used); the last line reports the tensors' size and the export's peak host memory. It forces
jax's CPU platform before jax starts: on one worker of a TPU pod (``WORKERS=0 tpu_pod_run.sh exec``)
it never initialises the TPU runtime, which would wait for the pod's other hosts.
"""
import sys

from absl import app, flags

_RUN = flags.DEFINE_string("run", None, "The training run directory (its workdir).")
_OUT = flags.DEFINE_string("out", None, "Directory (or fsspec URL) to write the HF model into.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest complete one).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"],
                           "Stored dtype (default: the model's param_dtype).")
_MAX_SHARD_SIZE = flags.DEFINE_string("max_shard_size", "5GiB",
                                      "Largest safetensors shard, e.g. 5GiB, 500MB or bytes.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an earlier export in --out.")


def main(argv):
    del argv
    if not _RUN.value or not _OUT.value:
        raise app.UsageError("--run and --out are required")
    import jax

    jax.config.update("jax_platforms", "cpu")   # before any backend: never the TPU runtime
    from ace_jax.policy import export
    from ace_jax.runtime import checkpoint
    from models import hf_mapping

    export.return_freed_memory()   # the blocks' buffers leave the resident memory when freed
    try:
        dtype = {} if _DTYPE.value is None else {"dtype": _DTYPE.value}
        result = export.export_run(_RUN.value, _OUT.value, step=_STEP.value,
                                   max_shard_bytes=_MAX_SHARD_SIZE.value,
                                   overwrite=_OVERWRITE.value, **dtype)
    except (export.PolicyError, checkpoint.CheckpointError, hf_mapping.CheckpointError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    mb = 1e6
    print(f"exported step {result.step} of {_RUN.value} to {result.out_dir}: "
          f"{', '.join(result.files)}", flush=True)
    print(f"tensors {result.tensor_bytes / mb:.1f} MB in {result.seconds:.1f} s; peak host memory: "
          f"{result.peak_rss_bytes / mb:.1f} MB above the start (getrusage max RSS), "
          f"{result.peak_buffer_bytes / mb:.1f} MB of buffers held at once, largest block read "
          f"{result.largest_block_bytes / mb:.1f} MB", flush=True)


if __name__ == "__main__":
    app.run(main)
