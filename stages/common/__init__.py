"""Pieces several stages share, each defined once: the stage command line and `import_ref` (cli),
the process group (distributed), DeepSpeed config/engine/saving (deepspeed), the progress display
(progress), checkpoint directories as inputs (checkpoints), tiny local models, model loading."""
