"""`python -m rlpipe.stages.import_model [-c FILE] [key=value ...]`: the stage alone
(`rlpipe stage import_model --help` lists its config keys)."""

from rlpipe.stages.common.cli import exit_process, stage_entry

main = stage_entry(__spec__.parent)

if __name__ == "__main__":
    exit_process(main())
