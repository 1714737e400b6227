"""An example's --out folder: the example's own earlier outputs are replaced, a user's file of the same name never
is (a review's run replaced a summary.json of the user's without a word), other files are left alone."""

import pytest

from llmrl.engine.output_folder import MARKER, claim_output_folder


def test_a_new_folder_is_made_and_a_second_run_may_replace_what_the_first_wrote(tmp_path):
    out = tmp_path / "runs" / "demo"
    claim_output_folder(str(out))
    (out / "summary.json").write_text("{}")  # what the example writes
    (out / "notes.txt").write_text("mine")
    claim_output_folder(str(out))  # the example again: its own summary.json may be replaced
    assert (out / "notes.txt").read_text() == "mine" and (out / MARKER).is_file()


def test_a_users_file_of_an_outputs_name_stops_the_run_before_it_starts(tmp_path):
    (tmp_path / "summary.json").write_text("the user's")
    with pytest.raises(SystemExit, match="summary.json exists and was not written by an llmrl example: it is not "
                                         "overwritten; choose another --out"):
        claim_output_folder(str(tmp_path))
    assert (tmp_path / "summary.json").read_text() == "the user's" and not (tmp_path / MARKER).exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="is a file; name a folder"):
        claim_output_folder(str(tmp_path / "a-file"))
