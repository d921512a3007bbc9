"""The harness's own promises: `eventually` (the one waiter) and the `Webhook` handle's unpacking."""

import pytest

from tests.helpers import eventually
from tests.process import RUNTIME_ARGS, SETTINGS, Webhook


def test_eventually_returns_the_first_truthy_value():
    answers = iter([0, None, "", [], "ready", "later"])
    assert eventually(lambda: next(answers), "an answer", timeout=5, every=0) == "ready"


def test_eventually_fails_naming_what_it_waited_for():
    calls = []
    with pytest.raises(AssertionError, match=r"the gauge at 0 \(waited 0s\)"):
        eventually(lambda: calls.append(1), "the gauge at 0", timeout=0.05, every=0.01)
    assert len(calls) >= 2, "polled more than once before giving up"


def test_a_webhook_unpacks_as_url_ca_log_and_process():
    hook = Webhook("https://127.0.0.1:8443", "/ca.crt", None, None, "http://127.0.0.1:9090")
    assert tuple(hook) == ("https://127.0.0.1:8443", "/ca.crt", None, None) and hook.port == 8443


def test_the_default_server_reads_the_example_settings_and_every_stock_runtime():
    assert SETTINGS.is_file() and RUNTIME_ARGS[0] == "--runtime"
    assert len(RUNTIME_ARGS) == 2 * len(list((SETTINGS.parent.parent / "runtimes").glob("*.yaml"))) > 0
