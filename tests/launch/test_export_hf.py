"""Run checkpoint -> HF directory (ace_jax/policy/export.py, launch/export_hf.py): the export loads in
transformers with the same logits and tokenizer, and round-trips through JaxPolicy.from_hf."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ace_jax.policy import export
from ace_jax.policy.interface import PolicyError
from ace_jax.policy.policy import JaxPolicy
from models import tokenizer as tok_lib
from models.qwen3 import flat_params
from tests.numerics import assert_close
from tests.run_fixture import make_tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["import numpy as np\nprint('VALIDATION_METRIC: 0.5')",
         "<|im_start|>user\nhé 日本 <think>x</think><|im_end|>\n", "   tabs\t\tand  spaces  ", ""]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(workdir, model, tokenizer, out_dir): a tiny run exported in fp32 to several shards."""
    base = tmp_path_factory.mktemp("export")
    workdir = str(base / "run")
    model, tokenizer = make_tiny_run(workdir)
    out = str(base / "hf")
    result = export.export_run(workdir, out, dtype="float32", max_shard_bytes="20kB")
    assert result.step == 1 and result.out_dir == out
    return workdir, model, tokenizer, out


def test_export_layout(exported):
    _, model, tokenizer, out = exported
    files = set(os.listdir(out))
    shards = sorted(f for f in files if f.startswith("model-"))
    assert len(shards) > 1 and {"config.json", "generation_config.json", "tokenizer.json",
                                "tokenizer_config.json", "model.safetensors.index.json"} <= files
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(set(index["weight_map"].values())) == shards
    for f in shards:  # within the bound (plus the header) unless one tensor alone is larger
        n_keys = sum(v == f for v in index["weight_map"].values())
        assert n_keys == 1 or os.path.getsize(os.path.join(out, f)) <= 20_000 + 4096, f
    cfg = json.load(open(os.path.join(out, "config.json")))
    im_end, eot = tokenizer.convert_tokens_to_ids([tok_lib.IM_END, tok_lib.ENDOFTEXT])
    assert cfg["torch_dtype"] == "float32" and cfg["model_type"] == "qwen3_moe"
    assert cfg["vocab_size"] == model.config.vocab_size and cfg["eos_token_id"] == im_end
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert gen["eos_token_id"] == [im_end, eot] and gen["pad_token_id"] == eot
    tok_cfg = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert tok_cfg["eos_token"] == tok_lib.IM_END and "<|im_start|>" in tok_cfg["chat_template"]


def test_transformers_gives_the_same_logits(exported):
    import torch
    from transformers import AutoModelForCausalLM

    _, model, _, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, size=(2, 12)).astype(np.int32)
    pos = np.broadcast_to(np.arange(12, dtype=np.int32), ids.shape)
    with torch.no_grad():
        hf_logits = hf(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    logits = np.asarray(model(ids, pos).logits)
    assert np.std(logits) > 1e-3  # not vacuous
    # torch vs XLA: the same math in another order through every layer
    assert_close(logits, hf_logits, reduction_len=model.config.hidden_size, ulps=16)


def test_transformers_tokenizer_encodes_identically(exported):
    from transformers import AutoTokenizer

    _, _, tokenizer, out = exported
    hf_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert len(hf_tok) == len(tokenizer) and hf_tok.eos_token == tok_lib.IM_END
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == tokenizer(text)["input_ids"], text
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=False) == tok_lib.render_chat(conv)


def test_export_round_trips_through_jax_policy_from_hf(exported):
    _, model, tokenizer, out = exported
    policy = JaxPolicy.from_hf(out, max_new_tokens=4)
    saved, loaded = flat_params(model), flat_params(policy.model)
    assert saved.keys() == loaded.keys()
    for k in saved:
        np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(saved[k]), err_msg=k)
    # Same weights and the same prompt tokens: the same policy (no need to sample and compile).
    conv = [{"role": "user", "content": "train a model"}]
    ids = tokenizer(tok_lib.render_chat(conv), add_special_tokens=False)["input_ids"]
    assert policy.encode(conv) == (ids, False)
    assert policy.sampling.eos_ids == tuple(tokenizer.convert_tokens_to_ids(
        [tok_lib.IM_END, tok_lib.ENDOFTEXT]))


def test_bfloat16_export(exported, tmp_path):
    from safetensors import safe_open

    from models import hf_mapping

    workdir, model, _, _ = exported
    export.export_run(workdir, str(tmp_path / "bf16"), dtype="bfloat16")
    assert json.load(open(tmp_path / "bf16" / "config.json"))["torch_dtype"] == "bfloat16"
    shard = sorted(p for p in os.listdir(tmp_path / "bf16") if p.endswith(".safetensors"))[0]
    with safe_open(str(tmp_path / "bf16" / shard), "np") as f:
        key = next(iter(f.keys()))
        assert str(f.get_slice(key).get_dtype()) == "BF16"
    _, flat = hf_mapping.load_hf_checkpoint(tmp_path / "bf16", dtype="float32")
    want = flat_params(model)["embed_tokens/embedding"]
    np.testing.assert_allclose(flat["embed_tokens/embedding"], np.asarray(want), rtol=1e-2,
                               atol=1e-6)


def test_export_errors(exported, tmp_path):
    workdir, _, _, out = exported
    with pytest.raises(export.ExportError, match="not empty"):
        export.export_run(workdir, out, dtype="float32")
    with pytest.raises(export.ExportError, match="dtype"):
        export.export_run(workdir, str(tmp_path / "x"), dtype="float16")
    with pytest.raises(PolicyError, match="does not exist"):
        export.export_run(str(tmp_path / "no_run"), str(tmp_path / "x"))
    with pytest.raises(PolicyError, match="no config.json"):
        export.export_run(str(tmp_path), str(tmp_path / "x"))
    with pytest.raises(PolicyError, match=r"no checkpoint of step 9 .*have \[1\]"):
        export.export_run(workdir, str(tmp_path / "x"), step=9)
    assert not os.path.exists(tmp_path / "x") or not os.listdir(tmp_path / "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(export.ExportError, match="is a file"):
        export.export_run(workdir, str(tmp_path / "file"))


def test_overwrite_replaces_only_export_files(exported, tmp_path):
    workdir = exported[0]
    out = tmp_path / "again"
    export.export_run(workdir, str(out), dtype="float32", max_shard_bytes=20_000)
    (out / "README.md").write_text("keep me")
    result = export.export_run(workdir, str(out), overwrite=True)  # the default 5 GiB bound: one shard
    shards = [f for f in result.files if f.startswith("model-")]
    assert shards == ["model-00001-of-00001.safetensors"]
    assert (out / "README.md").read_text() == "keep me"


def test_parse_size():
    assert export.parse_size(123) == 123
    assert export.parse_size("5GB") == 5 * 10**9
    assert export.parse_size("500MiB") == 500 * 2**20
    assert export.parse_size("2g") == 2 * 10**9
    assert export.parse_size("1.5kB") == 1500
    for bad in ("five", "0", -1, "3 parsecs"):
        with pytest.raises(export.ExportError):
            export.parse_size(bad)


def test_cli(exported, tmp_path):
    workdir = exported[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "export_hf.py"), f"--run={workdir}",
           f"--out={tmp_path / 'cli'}", "--dtype=float32", "--max_shard_size=30kB"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "exported step 1" in p.stdout
    # the last line: the tensors' size and the streaming export's peak host memory
    assert re.search(r"tensors [\d.]+ MB in [\d.]+ s; peak host memory: [\d.]+ MB above the "
                     r"start \(getrusage max RSS\), [\d.]+ MB of buffers held at once, largest "
                     r"block read [\d.]+ MB", p.stdout.strip().splitlines()[-1]), p.stdout[-500:]
    assert (tmp_path / "cli" / "model.safetensors.index.json").is_file()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "not empty" in p.stderr


_EXPORT_AND_REPORT_BACKENDS = """
import json, runpy, sys
from absl import flags
module = runpy.run_path(sys.argv[1], run_name="export_hf")    # its flags, not its app.run
flags.FLAGS(sys.argv[1:])
module["main"]([sys.argv[1]])
from jax._src import xla_bridge
print(json.dumps({"backends": sorted(xla_bridge._backends),
                  "tried": sorted(getattr(xla_bridge, "_backend_errors", {}))}))
"""


def test_the_export_never_initialises_an_accelerator_runtime(exported, tmp_path):
    """With JAX_PLATFORMS unset, on a host where jax would try the TPU runtime (libtpu is
    installed here: jax tries it and records the failure), the export initialises only the CPU
    backend: on one worker of a pod, the TPU runtime would wait for the other hosts."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: jax would not try a TPU here either way")
    workdir = exported[0]
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    cmd = [sys.executable, "-c", _EXPORT_AND_REPORT_BACKENDS,
           os.path.join(ROOT, "launch", "export_hf.py"), f"--run={workdir}",
           f"--out={tmp_path / 'cpu'}", "--dtype=bfloat16"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"backends": ["cpu"], "tried": []}, got
    cfg = json.load(open(tmp_path / "cpu" / "config.json"))
    assert cfg["torch_dtype"] == "bfloat16"   # the runbook's export
