"""Chat policies over a trained run or an OpenAI-compatible server: the interface they share
(`interface`), our JAX policy and policies from a spec (`policy`), a run directory's files, model
and restore plan (`runs`), process 0's engine calls mirrored on a pod (`mirror`) and an
OpenAI-compatible endpoint as a policy (`openai_policy`); the OpenAI-compatible server itself:
its HTTP server (`serving`), request and reply schema (`openai_api`), batching (`batching`),
decode engines (`engines`) and a sample's streamed text (`sample_stream`); and Hugging Face
export (`export`).

Imports: `runtime` (and `models`); checked by tests/test_layout.py."""
