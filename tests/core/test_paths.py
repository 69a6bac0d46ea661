"""A path given to rlcore, by an option, a config key or an environment variable, is checked for its kind before it
is used, and a refusal is one line naming what gave it: `--config` naming a folder, a FIFO or a device said "does
not exist"; RLCORE_DATA_CACHE naming a file failed with FileExistsError; RLCORE_PLUGINS naming a file or a folder
said "cannot import plugin file"."""

from __future__ import annotations

import os

import pytest

from rlcore import ConfigError
from rlcore.paths import folder_problem, writable_folder


@pytest.fixture
def places(tmp_path):
    (tmp_path / "a-file").write_text("notes\n")
    (tmp_path / "a-dir").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    return tmp_path


@pytest.mark.parametrize("given, said", [
    ("a-dir", "is a folder, not a file"), ("a-fifo", "is a FIFO (named pipe), not a file"),
    ("/dev/zero", "is a character device, not a file"), ("missing.yaml", "does not exist"),
    ("a-file/c.yaml", "does not exist (a part of its path is a file, not a folder)"),
])
def test_config_of_each_kind_is_one_line_naming_the_option_and_the_kind(cli, places, monkeypatch, given, said):
    monkeypatch.chdir(places)
    for command in (["config", "validate"], ["run"], ["plan"]):
        rc, err = cli(*command, "--plugin", "grpo", "--config", given)
        assert rc == 2 and err == f"rlcore: error: --config {given}: {said}; give a YAML config file\n", (command, err)


def test_every_environment_variable_rlcore_reads_a_path_from_is_named_in_its_error(cli, places, monkeypatch):
    monkeypatch.chdir(places)
    (places / "c.yaml").write_text("model: tiny\ndataset: tiny:sft\n")
    monkeypatch.delenv("RLCORE_EXTRA_PLUGINS", raising=False)
    for given, said in [("a-file", "is not a .py file"), ("a-dir", "is a folder, not a .py file")]:
        monkeypatch.setenv("RLCORE_PLUGINS", str(places / given))
        rc, err = cli("config", "validate", "--plugin", "grpo", "--config", "c.yaml")
        assert rc == 2 and err.startswith(f"rlcore: error: RLCORE_PLUGINS names '{places / given}'") and said in err, err
    monkeypatch.delenv("RLCORE_PLUGINS")
    pytest.importorskip("trl")
    monkeypatch.setenv("RLCORE_DATA_CACHE", str(places / "a-file"))  # each kind: test_a_folder_to_write_into_...
    rc, err = cli("config", "validate", "--plugin", "sft", "--config", "c.yaml")
    assert rc == 2 and f"dataset_cache_dir: RLCORE_DATA_CACHE {places / 'a-file'}: is a file, not a folder" in err, err
    assert "Traceback" not in err


def test_a_folder_to_write_into_is_refused_naming_who_gave_it(places):
    assert folder_problem(places / "a-dir") is None and folder_problem(places / "new" / "deeper") is None
    assert folder_problem(places / "a-file") == "is a file, not a folder"
    assert folder_problem("/dev/null") == "is a character device, not a folder"
    assert folder_problem(places / "a-file" / "x") == f"cannot be made: {places / 'a-file'} is not a folder"
    assert writable_folder(places / "new" / "deeper", "dataset_cache_dir").is_dir()
    with pytest.raises(ConfigError, match=r"^RLCORE_DATA_CACHE .*a-fifo: is a FIFO \(named pipe\), not a folder; give a "
                       r"writable folder$"):
        writable_folder(places / "a-fifo", "RLCORE_DATA_CACHE")
