"""Chat policies over a trained run or an OpenAI-compatible server (`policy`), the
OpenAI-compatible server itself: its HTTP server (`serving`), request and reply schema
(`openai_api`), batching (`batching`), decode engines (`engines`) and a sample's streamed text
(`sample_stream`); and Hugging Face export (`export`).

Imports: `runtime` (and `models`); checked by tests/test_layout.py."""
