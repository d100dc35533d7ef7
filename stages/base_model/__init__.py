"""The base_model stage: a BPE tokenizer trained on given texts and a freshly initialised tiny
Llama, built locally with no download (the demo's starting model; `python -m rlpipe.stages.base_model`)."""
