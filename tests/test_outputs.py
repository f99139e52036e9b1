"""The one output check and the one atomic writer every verb uses (moetailor.outputs)."""
import json
import os
import stat

import pytest

from moetailor.outputs import atomic_path, check_output, write_json


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_files_get_normal_permissions_and_leave_no_temp_file(tmp_path, umask_022):
    path = write_json(tmp_path / "sub" / "a.json", {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1}
    assert _mode(path) == 0o644                     # what any new file gets under umask 022, not mkstemp's 0600
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = write_json(tmp_path / "a.json", {"old": True})
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("{half")
            raise RuntimeError("killed mid-write")
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_an_existing_output_needs_overwrite(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--overwrite"):
        check_output(tmp_path / "a.json")
    assert check_output(tmp_path / "a.json", overwrite=True) == tmp_path / "a.json"
    assert check_output(tmp_path / "new" / "deeper" / "b.json") == tmp_path / "new" / "deeper" / "b.json"


def test_an_output_is_never_an_input_even_with_overwrite(tmp_path):
    stats = tmp_path / "stats.safetensors"
    stats.write_bytes(b"x")
    (tmp_path / "link.json").symlink_to(stats)
    os.link(stats, tmp_path / "hard.json")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w")
    (tmp_path / "model-link").symlink_to(model)
    for out, inputs, kw in [(stats, [stats], {}), (tmp_path / "link.json", [stats], {}),
                            (tmp_path / "hard.json", [stats], {}),
                            (model / "model.safetensors", [model], {}),                     # a file of the input
                            (tmp_path / "model-link", [model], {"directory": True}),         # symlink to the source
                            (tmp_path, [model], {"directory": True})]:                       # holds the input
        with pytest.raises(ValueError, match="never writes over its own input"):
            check_output(out, overwrite=True, inputs=inputs, **kw)
    # a new file beside the model's files is fine; a folder eval writes into may hold the input
    check_output(model / "stats.safetensors", inputs=[model])
    check_output(tmp_path, overwrite=True, inputs=[model], directory=True, replaces=False)


def test_file_versus_directory_and_unwritable_places_are_one_line_errors(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a directory, but this writes a file"):
        check_output(tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="is an existing file, but this writes a directory"):
        check_output(tmp_path / "f", overwrite=True, directory=True)
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output(tmp_path / "f" / "x.json")
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            check_output(locked / "x.json")
