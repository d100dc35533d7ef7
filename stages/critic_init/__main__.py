"""`python -m rlpipe.stages.critic_init [-c FILE] [key=value ...]`: the stage alone on saved artifacts
(`rlpipe stage critic_init --help` lists its config keys)."""

from rlpipe.stages.common.cli import exit_process, stage_entry

main = stage_entry(__spec__.parent)

if __name__ == "__main__":  # the guard also keeps engine worker processes from re-running it
    exit_process(main())
