"""`rlpipe` with one function paused, for kill points inside a stage (test-only; nothing in rlpipe
reads these variables). RLPIPE_TEST_PAUSE='package.module:attribute@N' makes the N-th call of
that function touch $RLPIPE_TEST_PAUSE_FILE and sleep there, so the test's SIGKILL lands exactly
at that call. Without the variable this is plain `rlpipe`.

    RLPIPE_TEST_PAUSE=rlpipe.stages.sft.core:sft_loss@3 python pause_driver.py run mini.yaml --local
"""

import importlib
import os
import sys
import time
from pathlib import Path

spec = os.environ.get("RLPIPE_TEST_PAUSE")
if spec:
    ref, _, nth = spec.partition("@")
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    real = getattr(module, attr)
    calls = [0]

    def paused(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(nth or 1):
            Path(os.environ["RLPIPE_TEST_PAUSE_FILE"]).touch()
            time.sleep(3600)
        return real(*args, **kwargs)

    setattr(module, attr, paused)

from rlpipe.pipelines.cli import main  # noqa: E402

sys.argv = ["rlpipe", *sys.argv[1:]]
main()
