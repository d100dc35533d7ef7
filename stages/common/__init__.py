"""Pieces several stages share, each defined once: the stage command line and `import_ref` (cli),
the process group (distributed), DeepSpeed config/engine/saving (deepspeed), the progress display
(progress), checkpoint directories as inputs (checkpoints), tiny local models, model loading."""

#: Response tokens whose vocabulary-sized logits exist at once when log-probs and entropies are
#: taken (`forward.response_stats`; the optimize knob `logprob_chunk_tokens`, the reference stage's
#: pass): at V = 151,936 a chunk of 256 tokens is 156 MB of fp32 logits. (Here, not in forward.py:
#: configs read it without importing torch.)
LOGPROB_CHUNK_TOKENS = 256
