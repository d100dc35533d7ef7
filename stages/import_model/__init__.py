"""The import_model stage: a pretrained model from a GGUF file (llama.cpp's format) as a Hugging
Face checkpoint artifact the other stages read (`rlpipe model import SRC OUT`)."""
