"""A misspelt override key (issue 40): one line naming the closest key of the config, from Hydra's own
refusal text, before any work (``launch/run.py::_unknown_key_line``, ``npu_train.config.suggest_key``)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from npu_train.config import suggest_key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launcher():
    spec = importlib.util.spec_from_file_location("npt_launch_run", os.path.join(ROOT, "launch", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("typed,meant", [
    ("trian.accum", "train.accum"),        # the section misspelt
    ("train.acum", "train.accum"),         # the key misspelt
    ("trian.acum", "train.accum"),         # both
    ("data.sorce", "data.source"),
    ("runtime.thread", "runtime.threads"),
    ("lr", "train.lr"),                    # a key without its section
    ("stepz", "train.steps"),
    ("checkpoint.every", "train.save_every"),      # the setting lives in another section (issue 40)
    ("checkpoint.save_every", "train.save_every"),  # the right name, another section
    ("train.eval_every", "data.eval_every or train.save_every"),  # the exact name elsewhere, a close one here
    ("train.warmup", "runtime.furiosa.warmup or train.warmup_steps"),
    ("eval.every", "data.eval_every or train.save_every"),  # two keys hold the word
    ("learning_rate", "train.lr"),         # Hugging Face TrainingArguments' names
    ("train.max_steps", "train.steps"),
    ("per_device_train_batch_size", "train.micro_batch"),
    ("train.foo", None),                   # nothing close: no guess
    ("x.y.z", None),
])
def test_the_closest_config_key_is_suggested(typed, meant):
    assert suggest_key(typed) == meant


# what Hydra 1.3 prints for `python launch/run.py trian.accum=4` (captured by the launcher)
HYDRA_TEXT = """Could not override 'trian.accum'.
To append to your config use +trian.accum=4
Key 'trian' not in 'Config'
    full_key: trian
    object_type=Config
Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
"""


def test_a_key_of_another_section_is_suggested_in_the_refusal():
    """``checkpoint.every=5`` (a fresh-clone try) got no suggestion: the save interval is ``train.save_every``."""
    run = _launcher()
    text = HYDRA_TEXT.replace("trian.accum", "checkpoint.every").replace("Key 'trian' not in 'Config'",
                                                                        "Key 'every' not in 'CheckpointConf'")
    line = run._unknown_key_line(text)
    assert line.startswith("unknown key checkpoint.every:") and "did you mean train.save_every?" in line, line


def test_hydras_refusal_becomes_one_line_with_the_closest_key():
    run = _launcher()
    line = run._unknown_key_line(HYDRA_TEXT)
    assert line.startswith("unknown key trian.accum:") and "did you mean train.accum?" in line
    assert "\n" not in line and "full_key" not in line and "+trian" not in line
    # another composition error keeps Hydra's own words
    assert run._unknown_key_line("Error merging override train.accum=abc\nValue 'abc' could not be converted") is None


def test_a_removed_key_names_what_replaced_it():
    run = _launcher()
    text = HYDRA_TEXT.replace("trian.accum", "placement.calibrate").replace("'trian'", "'calibrate'")
    assert run._unknown_key_line(text) == ("placement.calibrate was removed: a finished run fits the rates; "
                                           "calibrate=true measures them")


# Hydra's texts for a value of the wrong type and an unparsable override (captured from Hydra 1.3)
WRONG_TYPE = ("Error merging override train.lr=abc\nValue 'abc' of type 'str' could not be converted to Float\n"
              "    full_key: train.lr\n    reference_type=TrainConf\n    object_type=TrainConf\n\n"
              "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")
NOT_PARSED = ("LexerNoViableAltException: backend=cpu;cpu\n                                      ^\n"
              "See https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details\n\n"
              "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")


def test_a_value_of_the_wrong_type_is_said_in_our_words():
    run = _launcher()
    line = run._override_value_line(WRONG_TYPE)
    assert line.startswith("train.lr=abc: expected a number (float)"), line
    assert "Error merging" not in line and "full_key" not in line and "\n" not in line
    acc = run._override_value_line(WRONG_TYPE.replace("train.lr", "train.accum").replace("Float", "Integer"))
    assert acc.startswith("train.accum=abc: expected a whole number (integer)"), acc
    flag = run._override_value_line("Error merging override train.recompute=maybe\n"
                                    "Value 'maybe' is not a valid bool (type str)\n    full_key: train.recompute\n")
    assert flag.startswith("train.recompute=maybe: expected true or false"), flag


def test_semicolons_in_backend_name_the_comma_form():
    run = _launcher()
    assert run._override_value_line(NOT_PARSED) == ("backend=cpu;cpu: cannot be parsed; separate cards with "
                                                    "commas: backend=cpu,cpu")
    other = run._override_value_line(NOT_PARSED.replace("backend=cpu;cpu", "data.source=a;b"))
    assert other.startswith("data.source=a;b: cannot be parsed") and "LexerNoViable" not in other, other
    assert run._override_value_line("Primary config module 'conf' not found.\n") is None
