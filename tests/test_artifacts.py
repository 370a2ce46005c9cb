"""The one store of fitted artifacts (mla_quant/artifacts.py): identity from the payload, one lock, one provenance."""

import json
import threading
import time

from mla_quant.artifacts import artifact, model_identity


def test_the_identity_is_the_payload_and_a_stale_file_is_refitted(tmp_path):
    a = artifact(tmp_path, "codebooks-toy", {"bits": 2, "identity": {"model": "m"}}, ".json")
    same = artifact(tmp_path, "codebooks-toy", {"identity": {"model": "m"}, "bits": 2}, ".json")  # key order
    other = artifact(tmp_path, "codebooks-toy", {"bits": 4, "identity": {"model": "m"}}, ".json")
    assert a == same and a.path != other.path and a.path.name == f"codebooks-toy-{a.sha[:16]}.json"
    assert a.read_json() is None  # nothing stored yet
    stored = a.write_json({"levels": [1.0, 2.0]})
    assert a.read_json() == stored and stored["levels"] == [1.0, 2.0]
    prov = stored["provenance"]
    assert prov["config_sha256"] == a.sha == stored["config_sha256"]
    assert {"created", "host", "torch", "transformers"} <= set(prov)
    # the same file claiming another identity (copied by hand, or a hash prefix shared) is not reused
    other.path.write_text(a.path.read_text())
    assert other.read_json() is None
    a.path.write_text("{ truncated")
    assert a.read_json() is None


def test_a_second_job_waits_for_the_artifact_being_fitted_then_reuses_it(tmp_path):
    art = artifact(tmp_path, "mixed-sensitivity", {"budget": 70}, ".json")
    fitted, got = [], []

    def job(name, seconds):
        with art.held():
            stored = art.read_json()
            if stored is None:
                time.sleep(seconds)
                fitted.append(name)
                stored = art.write_json({"by": name})
            got.append(stored["by"])

    first = threading.Thread(target=job, args=("first", 1.0))
    first.start()
    time.sleep(0.3)
    second = threading.Thread(target=job, args=("second", 0.0))
    second.start()
    time.sleep(0.3)
    assert second.is_alive(), "the second job did not wait for the artifact being fitted"
    first.join(10)
    second.join(10)
    assert fitted == ["first"] and got == ["first", "first"]


def test_model_identity_leaves_out_where_the_model_runs():
    cfg = {"_target_": "x", "family": "deepseek_v3", "device": "cuda", "tokenizer": {"path": "t"},
           "resources": {"gpus": 8}, "dtype": "bfloat16"}
    assert model_identity(cfg) == {"_target_": "x", "family": "deepseek_v3", "dtype": "bfloat16"}
    assert json.dumps(model_identity(cfg), sort_keys=True) == json.dumps(
        model_identity({**cfg, "device": "cpu"}), sort_keys=True)
