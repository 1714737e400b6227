"""A ``tinker://`` path never leads out of the service's ``--save-dir`` (issue 63, point 2): a part that is empty,
``.``, ``..`` or absolute is refused, and so is a folder whose real path (links resolved) lies outside, whether the
state is loaded into a new training client or an existing one, saved or deleted. The state planted outside is never
read, the refusal is a user error naming the path, and no error names the host's folders. In process, on a stand-in
Caller (no model); the folders are checked on disk."""

from __future__ import annotations

import os

import pytest

from llmrl.engine.tinker.checkpoints import Registry, parse_path
from testkit.tinker_caller import STATE_FILE, fake_service


def plant(folder) -> str:
    """A state folder as save_adapter writes it, at ``folder`` (outside the service's folder, in these tests)."""
    os.makedirs(folder)
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        f.write("planted")
    return str(folder)


def wait(service, answer: dict):
    return service.futures.wait(answer["request_id"], 10)


@pytest.mark.parametrize("path", ["tinker://../weights/x", "tinker://./weights/x", "tinker:///weights/x",
                                  "tinker://run/weights/..", "tinker://run/weights/.", "tinker://run/weights/",
                                  "tinker://../sampler_weights/x"])
def test_a_path_with_an_empty_dot_or_dotdot_part_is_refused_naming_it(path):
    with pytest.raises(ValueError, match="must not be empty, '.', '..' or absolute") as refused:
        parse_path(path)
    assert repr(path) in str(refused.value)


def test_a_state_planted_beside_the_save_dir_loads_into_no_training_client(tmp_path):
    """``<save-dir>/../weights/x`` loaded from ``tinker://../weights/x``, into a new client and an existing one."""
    plant(tmp_path / "weights" / "x")
    service, caller = fake_service(str(tmp_path / "saved"))
    try:
        with pytest.raises(ValueError, match="must not be empty"):
            service.registry.folder_of("tinker://../weights/x")
        made = wait(service, service.create_model({"session_id": "s", "model_seq_id": 0}))
        assert made.kind == "json"
        into = wait(service, service.load_weights({"model_id": "s:train:0", "path": "tinker://../weights/x",
                                                    "seq_id": 1}))
        new = wait(service, service.load_weights({"session_id": "s", "model_seq_id": 1,
                                                  "path": "tinker://../weights/x"}))
        for outcome in (into, new):
            assert outcome.kind == "error" and outcome.value["category"] == "user"
            assert "'tinker://../weights/x' is not a checkpoint path" in outcome.value["error"]
        assert caller.count("load_adapter") == 0 and "s:train:1" not in service.models
    finally:
        service.futures.close()


def test_a_link_out_of_the_save_dir_is_refused_on_load_save_and_delete(tmp_path):
    """A state (or a run's folder) inside ``--save-dir`` that is a link to a folder outside is neither read,
    written into nor deleted."""
    outside = plant(tmp_path / "elsewhere" / "state")
    service, caller = fake_service(str(tmp_path / "saved"))
    try:
        assert wait(service, service.create_model({"session_id": "s", "model_seq_id": 0})).kind == "json"
        saved = wait(service, service.save_weights({"model_id": "s:train:0", "path": "kept", "seq_id": 1}))
        path = saved.value["path"]
        folder = service.registry.folder_of(path)
        weights = os.path.dirname(folder)
        os.symlink(outside, os.path.join(weights, "linked"))
        linked = "tinker://s:train:0/weights/linked"
        with pytest.raises(ValueError, match="leads outside this service's --save-dir"):
            service.registry.folder_of(linked)
        loaded = wait(service, service.load_weights({"model_id": "s:train:0", "path": linked, "seq_id": 2}))
        assert loaded.kind == "error" and "leads outside" in loaded.value["error"]
        assert loaded.value["category"] == "user"
        made = wait(service, service.load_weights({"session_id": "s", "model_seq_id": 5, "path": linked}))
        assert made.kind == "error" and "leads outside" in made.value["error"]
        assert ("load_adapter", outside) not in caller.calls and caller.count("load_adapter") == 0
        # the run's own folder replaced by a link out: a save into it writes nothing there, a delete deletes nothing
        run = os.path.dirname(weights)
        os.rename(run, run + "-moved")
        os.symlink(tmp_path / "elsewhere", run)
        os.makedirs(tmp_path / "elsewhere" / "weights" / "kept")
        refused = wait(service, service.save_weights({"model_id": "s:train:0", "path": "other", "seq_id": 3}))
        assert refused.kind == "error" and "leads outside" in refused.value["error"]
        with pytest.raises(ValueError, match="leads outside"):
            service.delete_checkpoint("s:train:0", "weights/kept")
        assert sorted(os.listdir(tmp_path / "elsewhere")) == ["state", "weights"]
        assert os.listdir(tmp_path / "elsewhere" / "weights") == ["kept"]
        assert os.listdir(outside) == [STATE_FILE]
    finally:
        service.futures.close()


def test_errors_name_the_tinker_path_never_the_hosts_folders(tmp_path):
    save_dir = tmp_path / "saved"
    registry = Registry(str(save_dir))
    with pytest.raises(LookupError) as missing:
        registry.folder_of("tinker://s:train:0/weights/none")
    assert "'tinker://s:train:0/weights/none'" in str(missing.value) and str(tmp_path) not in str(missing.value)
    service, caller = fake_service(str(save_dir))
    try:
        assert wait(service, service.create_model({"session_id": "s", "model_seq_id": 0})).kind == "json"
        path = wait(service, service.save_weights({"model_id": "s:train:0", "path": "one", "seq_id": 1})).value["path"]
        os.remove(os.path.join(service.registry.folder_of(path), STATE_FILE))  # the Caller's error names the folder
        for answer in (service.load_weights({"model_id": "s:train:0", "path": path, "seq_id": 2}),
                       service.load_weights({"session_id": "s", "model_seq_id": 1, "path": path})):
            outcome = wait(service, answer)
            assert outcome.kind == "error"
            assert f"{path} holds no adapter state" in outcome.value["error"]
            assert str(tmp_path) not in outcome.value["error"]
    finally:
        service.futures.close()
