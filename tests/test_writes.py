"""lclm.writes' start-up checks of the paths a CLI names: what `output_problem` refuses (object
storage, a file where a folder goes, a folder where a file goes, a parent that cannot be
written) and that it creates nothing when it finds no problem."""

import contextlib
import os
import subprocess

import pytest

from lclm import storage
from lclm.errors import StartupError
from lclm.writes import check_input, check_output, input_problem, output_problem


@contextlib.contextmanager
def _unwritable(path):
    """`path` (a directory) refuses new entries for real inside the block: immutable for root
    (whom mode 555 does not stop), mode 555 otherwise."""
    if os.geteuid() == 0:
        if subprocess.run(["lsattr", "-d", str(path)], capture_output=True).returncode:
            pytest.skip("chattr +i is not available here")
        subprocess.run(["chattr", "+i", str(path)], check=True)
        undo = ["chattr", "-i", str(path)]
    else:
        os.chmod(path, 0o555)
        undo = ["chmod", "755", str(path)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


@pytest.mark.parametrize("path", ["gs://bucket/run/eval", "s3://bucket/x"])
@pytest.mark.parametrize("folder", [True, False])
def test_an_object_store_output_is_refused_where_a_command_writes_local_only(
    path, folder, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    scheme = path.partition("://")[0]
    assert output_problem(path, folder).startswith(
        f"is on object storage ({scheme}://), which this command does not write"
    )
    assert input_problem(path) is None  # read through lclm.storage
    assert os.listdir(tmp_path) == []  # no local './gs:/...' folder


def test_an_unknown_scheme_is_refused_and_nothing_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for problem in (input_problem("hdfs://x/y"), output_problem("hdfs://x/y", remote=True)):
        assert problem.startswith("uses hdfs://, which lclm does not read or write")
    assert os.listdir(tmp_path) == []


def test_an_object_store_output_is_probed_with_an_object_that_is_removed(gcs):
    bucket = gcs.bucket()
    assert output_problem(bucket + "/eval", remote=True) is None
    assert output_problem(bucket + "/eval/report.md", folder=False, remote=True) is None
    assert storage.listdir(bucket) == []
    problem = output_problem("gs://no-such-bucket-lclm/eval", remote=True)
    assert problem.startswith("cannot be written (") and problem.endswith(
        "; check the bucket's name and this machine's access"
    )


def test_a_colon_inside_a_local_path_is_not_a_scheme(tmp_path):
    for path in [tmp_path / "a:b", tmp_path / "x" / "y://z", "hub:openwebtext"]:
        assert input_problem(str(path)) is None
    assert output_problem(str(tmp_path / "a:b")) is None
    assert output_problem(str(tmp_path / "x" / "y://z")) is None


def test_a_file_where_a_folder_goes_and_a_folder_where_a_file_goes(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert output_problem(str(afile)) == "is a file; pass a folder"
    assert output_problem(str(tmp_path), folder=False) == "is a folder; pass a file name"
    for folder in (True, False):
        assert (
            output_problem(str(afile / "sub" / "out"), folder)
            == f"cannot be made: {str(afile)!r} is a file; pass another path"
        )
    assert output_problem(str(afile), folder=False) is None  # a file to replace


def test_an_empty_path_and_a_broken_link_are_refused(tmp_path):
    assert output_problem("") == "is empty; pass a path"
    assert output_problem("", folder=False) == "is empty; pass a path"
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "dir")
    for folder in (True, False):
        assert (
            output_problem(str(tmp_path / "link"), folder)
            == "is a broken symbolic link; pass another path"
        )


def test_an_unwritable_parent_is_found(tmp_path):
    parent = tmp_path / "shared"
    (parent / "existing").mkdir(parents=True)
    with _unwritable(parent):
        for path, folder in [
            (parent, True),
            (parent / "new" / "deeper", True),
            (parent / "out.md", False),
        ]:
            problem = output_problem(str(path), folder)
            assert problem is not None
            assert problem.startswith(f"cannot be written: {str(parent)!r}: "), problem
            assert problem.endswith("; pass a writable path")
        # a writable folder inside it is fine: only what is written is asked about
        assert output_problem(str(parent / "existing")) is None
    assert sorted(os.listdir(parent)) == ["existing"]


def test_a_fine_path_creates_nothing(tmp_path):
    (tmp_path / "there").mkdir()
    for path, folder in [
        (tmp_path / "a" / "b" / "c", True),
        (tmp_path / "there", True),
        (tmp_path / "there" / "report.md", False),
        (tmp_path / "new" / "report.md", False),
    ]:
        assert output_problem(str(path), folder) is None
    assert sorted(os.listdir(tmp_path)) == ["there"]
    assert os.listdir(tmp_path / "there") == []  # the probe file is gone


def test_the_checks_raise_one_line_naming_the_flag_and_path(tmp_path):
    with pytest.raises(StartupError) as e:
        check_output("--out", "gs://bucket/tok")
    assert str(e.value).startswith("--out 'gs://bucket/tok' is on object storage (gs://)")
    assert "\n" not in str(e.value)
    with pytest.raises(StartupError) as e:
        check_input("--input", "hdfs://bucket/corpus.jsonl")
    assert str(e.value).startswith("--input 'hdfs://bucket/corpus.jsonl' uses hdfs://")
    check_output("--out", str(tmp_path / "fine"))
    check_input("--input", None)  # not given
    check_input("--input", str(tmp_path / "missing.jsonl"))  # its reader says it is missing
