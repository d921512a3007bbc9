"""Issue 35: the publish image's repository is fixed at deploy time; live settings may move the digest only.
And the previous settings' grace is a choice, 0 revoking a digest at once."""

from __future__ import annotations

import json
import logging

import pytest

from tests.helpers import EXAMPLES, IMAGE, ROUTE1, Clock, Runtimes, answer, mutated, runtime, settings, trainjob
from webhook.commands import serve
from webhook.commands.cli import main
from webhook.commands.flags import parser
from webhook.core import images, sources
from webhook.core.admission import Admission
from webhook.core.errors import Denied
from webhook.core.sources import switch_line
from webhook.kube.live_settings import LiveSettings, fixed_repositories
from webhook.process import metrics

REPO = IMAGE.split("@")[0]
MOVED = REPO + "@sha256:" + "b" * 64
ELSEWHERE = "registry.example/evil/publish@sha256:" + "e" * 64


@pytest.mark.parametrize("ref, repo", [
    (IMAGE, REPO),
    ("host:5000/path/publish@sha256:" + "a" * 64, "host:5000/path/publish"),
    ("[fd00::1]:5000/publish@sha256:" + "a" * 64, "[fd00::1]:5000/publish"),
    ("publish:v1", "publish"),
    ("publish", "publish"),
])
def test_the_repository_of_an_image_is_its_name(ref, repo):
    assert images.repository(ref) == repo


def test_the_repositories_flag_takes_names_and_refuses_what_is_not_one():
    assert sources.parse_repositories(f"{REPO}, host:5000/p") == {REPO, "host:5000/p"}
    assert sources.parse_repositories("") == frozenset()  # none: no publish image may be named
    with pytest.raises(Denied) as e:
        sources.parse_repositories(f"{REPO}:v1,{IMAGE},,registry.example/Upper")
    text = str(e.value)
    assert text.count("--publish-repositories") == 4
    assert "carries a tag" in text and "carries a digest" in text and "is empty" in text
    assert "is not an image repository name" in text


def test_settings_naming_another_repository_are_refused_naming_it():
    allowed = frozenset({REPO})
    assert sources.check(settings({"publish": {"image": MOVED}}), allowed).publish.image == MOVED
    assert sources.check(settings({}), frozenset()).publish is None  # no publish image: nothing to check
    with pytest.raises(Denied) as e:
        sources.check(settings({"publish": {"image": ELSEWHERE}}), allowed)
    (reason,) = e.value.reasons
    assert reason.field == "publish.image" and reason.sentinel.name == "ErrInvalid"
    assert "'registry.example/evil/publish'" in reason.text and REPO in reason.text
    with pytest.raises(Denied, match="none"):
        sources.check(settings(ROUTE1), frozenset())


def test_by_default_the_repository_is_the_one_the_server_starts_with():
    assert fixed_repositories(None, settings(ROUTE1)) == {REPO}
    assert fixed_repositories(None, settings({})) == frozenset()
    assert fixed_repositories(f"{REPO},other/x", settings(ROUTE1)) == {REPO, "other/x"}
    with pytest.raises(Denied, match="registry.gitlab.com"):  # the start-up settings themselves
        fixed_repositories("other/x", settings(ROUTE1))


class Text(LiveSettings):
    """A settings source whose text is set by the test."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.text = b""

    def read_text(self) -> bytes:
        return self.text


def test_a_live_edit_naming_another_repository_keeps_the_last_good_settings(caplog):
    metrics.get()
    live = Text(repositories=frozenset({REPO}))
    taken = []
    live.on_change = taken.append
    metrics.set_settings_valid(True)
    assert live.take(json.dumps({"publish": {"image": MOVED}}).encode()).publish.image == MOVED  # a digest moved
    with caplog.at_level(logging.ERROR):
        assert live.take(json.dumps({"publish": {"image": ELSEWHERE}}).encode()) is None
    assert [s.publish.image for s in taken] == [MOVED]
    assert b"dispatch_admission_settings_valid 0.0" in metrics.exposition()[0]
    assert "settings refused: the last good settings stay in use" in caplog.text
    assert "registry.example/evil/publish" in caplog.text
    live.text = json.dumps({"publish": {"image": ELSEWHERE}}).encode()
    with pytest.raises(Denied):  # the read before serving refuses the same way
        live.read()
    assert Text().take(json.dumps({"publish": {"image": ELSEWHERE}}).encode()) is not None  # unchecked: no list


def test_a_switch_logs_the_old_and_new_publish_images():
    line = switch_line("ConfigMap ns/cm", settings(ROUTE1), settings({"publish": {"image": MOVED}}))
    assert line["msg"] == "settings switched" and line["publish"] == MOVED and line["previous_publish"] == IMAGE
    assert switch_line("f", settings({}), settings(ROUTE1))["previous_publish"] is None


def test_serve_does_not_start_with_settings_from_another_repository(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(ROUTE1))
    runtimes = [a for p in sorted((EXAMPLES / "runtimes").glob("*.yaml")) for a in ("--runtime", str(p))]

    def options(*args):
        return serve.serve_config(parser().parse_args(["serve", "--settings", str(path), *runtimes, *args]))

    assert options().publish_repositories == {REPO}
    assert options("--publish-repositories", f"{REPO},registry.example/mine").publish_repositories == \
        {REPO, "registry.example/mine"}
    with pytest.raises(Denied, match="publish.image: repository 'registry.gitlab.com/phpboyscout/go/dispatch/publish'"
                                     " is not one fixed at deploy time"):
        options("--publish-repositories", "registry.example/mine")
    with pytest.raises(Denied, match="--publish-repositories: 'a:v1' carries a tag"):
        options("--publish-repositories", "a:v1")
    assert options("--previous-settings-grace", "0").grace == 0 and options().grace == 600


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "ten"])
def test_the_grace_is_seconds_zero_or_more(text, capsys):
    assert main(["serve", "--dev", "--previous-settings-grace", text]) == 2
    assert "--previous-settings-grace" in capsys.readouterr().err


def test_with_no_grace_the_previous_entry_is_refused_at_once():
    clock = Clock()
    adm = Admission(settings(ROUTE1), Runtimes(runtime()), monotonic=clock, grace=0)
    old_job = mutated(adm, trainjob())
    assert adm.switch(settings({"publish": {"image": MOVED}}))
    resp = answer(adm, old_job, "validate")
    assert resp["allowed"] is False and "differs from what the webhook's settings produce" in resp["status"]["message"]
    assert answer(adm, mutated(adm, trainjob()), "validate")["allowed"]
    # a grace of its own length: accepted within it, refused after
    adm = Admission(settings(ROUTE1), Runtimes(runtime()), monotonic=clock, grace=30)
    old_job = mutated(adm, trainjob())
    adm.switch(settings({"publish": {"image": MOVED}}))
    clock.now += 29
    assert answer(adm, old_job, "validate")["allowed"]
    clock.now += 1
    assert answer(adm, old_job, "validate")["allowed"] is False
