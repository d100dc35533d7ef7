"""`python -m rlpipe.stages.import_data [-c FILE] [key=value ...]`: import one data file as an
artifact (`rlpipe stage import_data --help` lists its config keys; `rlpipe data import` is the same)."""

from rlpipe.stages.common.cli import exit_process, stage_entry

main = stage_entry(__spec__.parent)

if __name__ == "__main__":  # the guard also keeps engine worker processes from re-running it
    exit_process(main())
