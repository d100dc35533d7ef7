"""The import_data stage: a user's prompts or preference pairs (JSONL, CSV, Parquet, or a Hugging
Face `datasets` directory) checked and written as a `prompts` / `preferences` artifact
(`python -m rlpipe.stages.import_data`, `rlpipe data import`). `sources` reads the files,
`rows` maps and checks the columns."""
