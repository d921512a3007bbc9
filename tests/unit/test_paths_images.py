import pytest

from webhook.core import images, paths

HEX = "a" * 64


@pytest.mark.parametrize("raw,norm", [
    ("/opt/dispatch", "/opt/dispatch"),
    ("//opt//dispatch", "/opt/dispatch"),
    ("///opt/dispatch", "/opt/dispatch"),
    ("/opt/./dispatch/", "/opt/dispatch"),
    ("/opt/x/../dispatch", "/opt/dispatch"),
    ("/../../opt/dispatch", "/opt/dispatch"),
    ("opt/dispatch", "/opt/dispatch"),
    ("./opt/dispatch/publish", "/opt/dispatch/publish"),
    ("", "/"),
    ("/", "/"),
    ("/opt/dispatcher/", "/opt/dispatcher"),
])
def test_normalise(raw, norm):
    assert paths.normalise(raw) == norm


@pytest.mark.parametrize("path", [
    "/opt/dispatch", "//opt//dispatch", "/opt/./dispatch/", "/opt/dispatch/publish", "/opt/a/../dispatch/x",
    "opt/dispatch", "../opt/dispatch", "/opt/dispatch/.", "/opt/dispatch//publish/",
])
def test_at_or_under_publish_dir(path):
    assert paths.under_publish_dir(path)


@pytest.mark.parametrize("path", [
    "/opt/dispatcher", "/opt", "/", "/opt/Dispatch", "/OPT/dispatch", "/opt/dispatch/../x", "/optdispatch",
    "/opt/dispatch-x", "/opt/dispatch\u0456",
])
def test_not_under_publish_dir(path):
    assert not paths.under_publish_dir(path)


@pytest.mark.parametrize("a,b,expected", [
    ("/opt", "/opt/dispatch", True), ("/", "/opt/dispatch", True), ("/opt/dispatch/x", "/opt/dispatch", True),
    ("/opt/dispatcher", "/opt/dispatch", False), ("/var/a", "/var/ab", False), ("/var/a/", "/var/a/b", True),
])
def test_overlaps(a, b, expected):
    assert paths.overlaps(a, b) is expected
    assert paths.overlaps(b, a) is expected


@pytest.mark.parametrize("ref", [
    f"registry.gitlab.com/phpboyscout/go/dispatch/publish@sha256:{HEX}",
    f"host:5000/path/publish@sha256:{HEX}",
    f"localhost:5000/publish@sha256:{HEX}",
    f"publish@sha256:{HEX}",
    f"0123456789abcdef0123456789abcdef01234567/p@sha256:{'0123456789abcdef' * 4}",
])
def test_pinned_accepted(ref):
    assert images.pinned_problem(ref) is None


@pytest.mark.parametrize("ref,fragment", [
    (f"publish:v1@sha256:{HEX}", "tag"),
    (f"host:5000/publish:v1@sha256:{HEX}", "tag"),
    ("publish:v1", "tag"),
    ("publish", "not pinned"),
    (f"publish@sha256:{'a' * 63}", "exactly 64"),
    (f"publish@sha256:{'a' * 65}", "exactly 64"),
    (f"publish@sha256:{'A' * 64}", "lower-case"),
    (f"publish@sha512:{'a' * 128}", "sha256"),
    (f"@sha256:{HEX}", "invalid image name"),
    (f"Publish@sha256:{HEX}", "invalid image name"),
    (f"publish@sha256:{HEX}\n", "64"),
])
def test_pinned_refused(ref, fragment):
    problem = images.pinned_problem(ref)
    assert problem is not None and fragment in problem
