"""`m2po demo` reuses a built tiny task only when it was built with the demo's seed and warm-up target."""
import json

from m2po_megatron.commands.demo import DEMO_TARGET_ACCURACY, task_is_current
from m2po_megatron.demo.tiny_model import INFO_FILE


def _write(tmp_path, info):
    (tmp_path / INFO_FILE).write_text(info if isinstance(info, str) else json.dumps(info))
    return tmp_path


def test_a_task_built_for_the_demo_is_reused(tmp_path):
    assert task_is_current(_write(tmp_path, {"seed": 0, "target_accuracy": DEMO_TARGET_ACCURACY}), 0)


def test_an_older_or_other_task_is_rebuilt(tmp_path):
    assert not task_is_current(tmp_path, 0)  # nothing built
    assert not task_is_current(_write(tmp_path, {"seed": 0, "target_accuracy": 0.25}), 0)  # an older demo's
    assert not task_is_current(_write(tmp_path, {"seed": 1, "target_accuracy": DEMO_TARGET_ACCURACY}), 0)
    assert not task_is_current(_write(tmp_path, '{"seed": 0, "target_'), 0)  # cut off mid-write
    assert not task_is_current(_write(tmp_path, "[1, 2]"), 0)
