"""SPEC 2.1 on the real server process (two gunicorn workers, TLS): `serve --settings FILE` follows the file.

A good edit is taken by every worker within about a second, without a restart; for ten minutes the
previous settings' entry is still accepted on CREATE; a bad edit keeps the last good settings, the
replica stays ready and `dispatch_admission_settings_valid` reads 0 until a good edit comes.
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import pytest
import requests

from tests.helpers import eventually, metric_series, review, trainjob
from tests.process import SETTINGS

BASE = json.loads(SETTINGS.read_text())


def with_image(digit: str) -> dict:
    doc = json.loads(json.dumps(BASE))
    doc["publish"]["image"] = doc["publish"]["image"].split("@")[0] + "@sha256:" + digit * 64
    return doc


def settings_file(tmp: Path, digit: str) -> Path:
    path = tmp / "settings.json"
    path.write_text(json.dumps(with_image(digit)))
    return path


@pytest.fixture(scope="module")
def server(serve_module, tmp_path_factory):
    """The server and the settings file it follows."""
    path = settings_file(tmp_path_factory.mktemp("live-settings"), "a")
    return serve_module("--workers", "2", settings=path), path


def post(server, endpoint: str, doc: dict) -> dict:
    # a new connection each time, so both workers are asked
    return server[0].review(doc, endpoint, headers={"Connection": "close"})


def entry_of(response: dict) -> dict:
    [op] = json.loads(base64.b64decode(response["patch"]))
    return op["value"][0]


def mutated(server) -> dict:
    job = trainjob()
    job["spec"]["runtimePatches"] = [entry_of(post(server, "mutate", review(trainjob())))]
    return job


def image_in(job: dict) -> str:
    return re.search(r"sha256:(\w)", json.dumps(job["spec"]["runtimePatches"])).group(1)


def settings_valid(server) -> float:
    [value] = [v for _, v in metric_series(server[0].metrics(), "dispatch_admission_settings_valid")]
    return value


def until(check, what: str):
    return eventually(check, what, timeout=30)


def every_worker_writes(server, digit: str, times: int = 12) -> bool:
    return all(image_in(mutated(server)) == digit for _ in range(times))


def test_an_edit_is_taken_without_a_restart_and_the_previous_entry_stays_acceptable(server):
    hook, path = server
    path.write_text(json.dumps(with_image("a")))  # the start-up settings, whichever of these tests ran before
    until(lambda: every_worker_writes(server, "a"), "a worker does not write the settings' entry")
    old_job = mutated(server)
    path.write_text(json.dumps(with_image("b")))
    edited = time.monotonic()
    until(lambda: every_worker_writes(server, "b"), "a worker still writes the old entry")
    print(f"\nevery worker switched within {time.monotonic() - edited:.1f}s")
    assert "settings switched" in hook.log.read_text()
    # SPEC 2.1: the replica that mutated may still have had the old settings: its entry is accepted
    assert post(server, "validate", review(old_job))["allowed"]
    assert post(server, "validate", review(mutated(server)))["allowed"]
    forged = json.loads(json.dumps(old_job).replace("sha256:" + "a" * 64, "sha256:" + "0" * 64))  # never served
    refused = post(server, "validate", review(forged))
    assert refused["allowed"] is False and "differs from what the webhook's settings produce" in \
        refused["status"]["message"]


def test_a_bad_edit_keeps_the_last_good_settings_and_is_told(server):
    hook, path = server
    path.write_text(json.dumps(with_image("c")))
    until(lambda: every_worker_writes(server, "c"), "the good edit was not taken")
    assert settings_valid(server) == 1
    path.write_text('{"publish": {"image": "registry.example/publish:v2"}}')  # a tag: refused
    until(lambda: settings_valid(server) == 0, "dispatch_admission_settings_valid never went to 0")
    # write_text truncates first: a poll may read the file empty (refused too, and logged) before the whole edit
    until(lambda: "references a tag, not a digest" in hook.log.read_text(), "the tag's refusal was not logged")
    assert "settings refused: the last good settings stay in use" in hook.log.read_text()
    assert every_worker_writes(server, "c")  # still serving, with the last good settings
    assert requests.get(f"{hook.url}/readyz", verify=hook.ca, timeout=10).status_code == 200
    path.write_text("{not json")
    assert every_worker_writes(server, "c")
    path.write_text(json.dumps(with_image("d")))
    until(lambda: every_worker_writes(server, "d"), "the next good edit was not taken")
    until(lambda: settings_valid(server) == 1, "dispatch_admission_settings_valid stayed 0")


def test_an_edit_naming_another_repository_is_refused_and_a_moved_digest_taken(server):
    """Issue 35: the repository is fixed at start (here the start-up settings' own: no --publish-repositories);
    an edit may move the digest within it, never point it elsewhere. Every switch logs both images."""
    hook, path = server
    path.write_text(json.dumps(with_image("e")))
    until(lambda: every_worker_writes(server, "e"), "a digest moved within the repository was not taken")
    assert '"previous_publish": "registry.gitlab.com/phpboyscout/go/dispatch/publish@sha256:' in hook.log.read_text()
    elsewhere = with_image("e")
    elsewhere["publish"]["image"] = "registry.example/evil/publish@sha256:" + "9" * 64
    path.write_text(json.dumps(elsewhere))
    until(lambda: settings_valid(server) == 0, "an edit naming another repository was not refused")
    until(lambda: "repository 'registry.example/evil/publish' is not one fixed at deploy time" in hook.log.read_text(),
          "the refusal did not name the repository")
    assert every_worker_writes(server, "e")  # the last good settings keep serving
    assert requests.get(f"{hook.url}/readyz", verify=hook.ca, timeout=10).status_code == 200
    path.write_text(json.dumps(with_image("f")))
    until(lambda: every_worker_writes(server, "f"), "the next good edit was not taken")
    until(lambda: settings_valid(server) == 1, "dispatch_admission_settings_valid stayed 0")


def test_with_no_grace_the_digest_switched_away_from_is_refused_at_once(serve, tmp_path):
    """`--previous-settings-grace 0`: the way to revoke a digest; a create carrying its entry is refused from
    the switch on (with the default grace it is accepted for ten minutes: the test above)."""
    path = settings_file(tmp_path, "a")
    hooked = (serve("--workers", "2", "--previous-settings-grace", "0", settings=path), path)
    old_job = mutated(hooked)
    path.write_text(json.dumps(with_image("b")))
    until(lambda: every_worker_writes(hooked, "b"), "a worker still writes the old entry")
    for _ in range(6):  # each worker
        refused = post(hooked, "validate", review(old_job))
        assert refused["allowed"] is False and "differs from what the webhook's settings produce" in \
            refused["status"]["message"]
    assert post(hooked, "validate", review(mutated(hooked)))["allowed"]
